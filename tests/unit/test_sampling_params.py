from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.sampling_params import SamplingParams

NAN = float("nan")
INF = float("inf")

BAD_VALUES = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("temperature", -1),
    ("temperature", -1e-9),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", NAN),
    ("top_p", False),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", INF),
    ("repetition_penalty", NAN),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("presence_penalty", NAN),
    ("presence_penalty", None),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -INF),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "7"),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 16.0),
    ("max_tokens", None),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > the default max_tokens of 16
    ("min_tokens", 1.0),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 3),
    ("stop", {"a"}),
    ("stop", None),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 5),
    ("stop_token_ids", None),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("logprobs", True),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_message_states_bound_and_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, None, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == ((), (), False, None)
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, logprobs=0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3),
        dict(max_tokens=1, min_tokens=1, logprobs=20, seed=-3, n=4),
        dict(top_k=10**9, top_p=1e-6, seed=2**70),
    ],
)
def test_boundary_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


def test_stop_normalised_to_tuple():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop_token_ids=[7, 0]).stop_token_ids == (7, 0)


def test_numbers_normalised_to_plain_types():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, repetition_penalty=2, presence_penalty=1)
    for value in (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty):
        assert type(value) is float


def test_greedy_iff_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_frozen_hashable_and_compares_by_value():
    a = SamplingParams(stop=["x"], stop_token_ids=[1])
    b = SamplingParams(stop="x", stop_token_ids=(1,))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.temperature = 0.5  # type: ignore[misc]
