from __future__ import annotations

import dataclasses
import itertools
import struct

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.sampling_params import (
    MAX_ABS_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from pdserve.proto import pdserve_pb2
from pdserve.proto.convert import params_from_proto, params_to_proto, sampling_kwargs

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
    ("temperature", 100.01),
    ("temperature", 1e30),
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
    ("repetition_penalty", 1e-38),  # overflows the sampler's logits to inf: NaN draws
    ("repetition_penalty", 0.0099),
    ("repetition_penalty", 100.5),
    ("repetition_penalty", 1e38),
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
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", 2.0),
    ("prompt_logprobs", False),
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
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs, p.prompt_logprobs) == ((), (), False, None, None)
    assert not p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, logprobs=0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01),
        dict(repetition_penalty=100.0, temperature=100.0),
        dict(max_tokens=1, min_tokens=1, logprobs=20, seed=-3, n=4),
        dict(prompt_logprobs=0),
        dict(prompt_logprobs=20),
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


def test_rebuilt_from_plain_fields_is_the_same_value_frozen_and_hashable():
    original = SamplingParams(temperature=0.5, top_k=3, seed=9, stop=["a", "bc"], stop_token_ids=[4], logprobs=2)
    plain = {**dataclasses.asdict(original), "stop": ["a", "bc"], "stop_token_ids": [4]}  # what JSON gives back
    again = SamplingParams.rebuilt(plain)
    assert again == original and hash(again) == hash(original) and again.stop == ("a", "bc")
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.temperature = 0.5  # type: ignore[misc]


def test_rebuilt_needs_exactly_the_fields():
    plain = dataclasses.asdict(SamplingParams())
    with pytest.raises(TypeError, match="missing \\['seed'\\]"):
        SamplingParams.rebuilt({k: v for k, v in plain.items() if k != "seed"})
    with pytest.raises(TypeError, match="unknown \\['beam'\\]"):
        SamplingParams.rebuilt({**plain, "beam": 2})


def test_new_bounds_are_stated_in_the_message():
    with pytest.raises(ValueError, match=r"^repetition_penalty must be >= 0.01, got 1e-38$"):
        SamplingParams(repetition_penalty=1e-38)
    with pytest.raises(ValueError, match=r"^repetition_penalty must be <= 100, got 1000$"):
        SamplingParams(repetition_penalty=1000)
    with pytest.raises(ValueError, match=r"^temperature must be <= 100, got 250$"):
        SamplingParams(temperature=250)


def as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def test_a_bound_sent_as_a_proto_float32_is_accepted():
    """A client's 0.01 reaches the router and the nodes as float32 0.0099999998."""
    sent = as_float32(MIN_REPETITION_PENALTY)
    assert sent < MIN_REPETITION_PENALTY
    assert SamplingParams(repetition_penalty=sent).repetition_penalty == sent
    # The router's request and its message to the nodes both carry float32.
    request = pdserve_pb2.SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY, temperature=MAX_TEMPERATURE)
    at_router = SamplingParams(**sampling_kwargs(request))
    at_node = params_from_proto(params_to_proto(at_router), seed=1)
    assert (at_node.repetition_penalty, at_node.temperature) == (sent, MAX_TEMPERATURE)
    below = as_float32(0.00999)
    with pytest.raises(ValueError, match=r"^repetition_penalty must be >= 0.01, got 0.00999$"):
        SamplingParams(repetition_penalty=below)


# Every extreme the bounds admit, at once; the sampler must stay finite under each.
EXTREMES = [
    SamplingParams(temperature=t, repetition_penalty=r, presence_penalty=p, frequency_penalty=f, min_tokens=10,
                   top_p=top_p, seed=7)
    for t, r, p, f, top_p in itertools.product(
        (1e-9, MAX_TEMPERATURE), (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        (-MAX_ABS_PENALTY, MAX_ABS_PENALTY), (-MAX_ABS_PENALTY, MAX_ABS_PENALTY), (1e-6, 1.0))
]


def test_the_sampler_stays_finite_at_every_admitted_extreme():
    """Logits as large as a real model's, every token seen (prompt and output), eos masked by
    min_tokens: processed logits are finite where not masked, and the draw follows them (a NaN
    row would fall through to the last vocabulary id)."""
    vocab, eos = 64, 0
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=generator) * 40  # [1, vocab]
    prompt = list(range(vocab)) * 4
    output = [5, 5, 5, 9, 9, 63]  # fewer than min_tokens: eos stays masked
    sampler = Sampler([eos])
    for params in EXTREMES:
        rows = [SamplingRow(params, prompt, output, seed=params.seed)]
        processed = sampler.process_logits(logits, rows)  # [1, vocab]
        assert processed[0, eos] == float("-inf")
        assert torch.isfinite(processed[0, 1:]).all(), params
        token = sampler(logits, rows).token_ids[0]
        assert token != eos and 0 < token < vocab, params
        if params.temperature < 1e-5 or params.top_p < 1e-3:  # one-hot: the draw is the argmax
            assert token == int(processed[0].argmax()), params
