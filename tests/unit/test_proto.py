"""The committed stubs are exactly what the .proto files generate, and the one proto <->
engine conversion (pdserve/proto/convert.py) round-trips every value the wire carries."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import convert, generate, pdserve_pb2


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = {p.name: p.read_text() for p in generate.generate(tmp_path)}
    assert sorted(fresh) == ["node_pb2.py", "node_pb2_grpc.py", "pdserve_pb2.py", "pdserve_pb2_grpc.py"]
    for name, text in fresh.items():
        committed = (generate.PROTO_DIR / name).read_text()
        assert committed == text, f"pdserve/proto/{name} is stale: run python -m pdserve.proto.generate"


# -- pdserve/proto/convert.py: the conversions the router, the nodes and the client share ----
# Float fields travel as float32: the values below are exact in float32, so a round trip is exact.
PARAMS = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.75, 100.0]),
    top_p=st.sampled_from([0.125, 0.5, 1.0]),
    top_k=st.none() | st.integers(1, 1000),
    min_p=st.sampled_from([0.0, 0.25, 1.0]),
    repetition_penalty=st.sampled_from([0.5, 1.0, 1.25, 100.0]),
    presence_penalty=st.sampled_from([-2.0, 0.0, 0.5]),
    frequency_penalty=st.sampled_from([-0.25, 0.0, 2.0]),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(8, 4096),
    min_tokens=st.integers(0, 8),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 50_000), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
)


@given(PARAMS)
def test_sampling_params_round_trip_router_to_wire_and_back(params):
    msg = pdserve_pb2.SamplingParams.FromString(convert.params_to_proto(params).SerializeToString())
    assert SamplingParams(**convert.sampling_kwargs(msg)) == params
    at_node = convert.params_from_proto(msg, seed=11)  # a node runs one sample with the router's seed
    assert at_node == dataclasses.replace(params, n=1, seed=11)


def test_unset_fields_are_the_engines_defaults():
    assert SamplingParams(**convert.sampling_kwargs(pdserve_pb2.SamplingParams())) == SamplingParams()
    assert convert.params_from_proto(pdserve_pb2.SamplingParams(), seed=3) == SamplingParams(seed=3)


def test_a_bad_field_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="^top_p "):
        convert.params_from_proto(pdserve_pb2.SamplingParams(top_p=2.0), seed=0)


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_finish_reasons_round_trip_and_nodes_may_send_the_value(reason):
    wire = convert.finish_reason_to_proto(reason)
    assert convert.finish_reason_from_proto(wire) is reason
    assert convert.finish_reason_to_proto(None if reason is None else reason.value) == wire
    assert convert.finish_reason_name(wire) == (None if reason is None else reason.value)


def test_every_wire_finish_reason_has_an_engine_reason():
    wire_values = set(pdserve_pb2.FinishReason.values())
    assert set(convert.FINISH_TO_PROTO.values()) == wire_values
    assert [convert.finish_reason_name(v) for v in sorted(wire_values)] == [None, "stop", "length", "abort"]


@dataclasses.dataclass
class Logprobs:
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def test_logprobs_to_proto():
    msg = convert.logprobs_to_proto(7, Logprobs(-0.25, [7, 9], [-0.25, -1.5]))
    assert (msg.token_id, msg.logprob) == (7, -0.25)
    assert [(t.token_id, t.logprob) for t in msg.top] == [(7, -0.25), (9, -1.5)]
