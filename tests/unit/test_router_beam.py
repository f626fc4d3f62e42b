"""A beam search request at the router's edge: what it accepts, and each refusal naming its field.

n is the number of beams returned (unset: all beam_width of them, vLLM's meaning); beam_width
is bounded by what the logprobs cap lets every beam report; sampling fields a beam search
cannot honour are refused rather than silently ignored. Without a live colocated node or a
live prefill + decode pair the search is refused FAILED_PRECONDITION naming beam_width, which
the HTTP front answers 400.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from pdserve.model_factory import make_model
from pdserve.proto import pdserve_pb2
from pdserve.engine.sampling_params import beams_to_keep, max_beam_width
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch.orchestrator import Orchestrator
from pdserve.router.dispatch.routes import ColocatedRoute, DisaggregatedRoute
from pdserve.router.dispatch.state import RouterState
from pdserve.router.requests.beam_option import BeamOption
from pdserve.router.errors import InvalidRequest, NeedsNodes
from pdserve.router.model import load_router_model
from pdserve.router.fronts.openai_api import error_of
from pdserve.router.cluster.placement import DecodePlacement, PrefillPlacement
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.router.requests.validation import RequestValidator


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("beam-model") / "tiny", "llama", "tiny", dtype=torch.float32)
    return dataclasses.replace(load_router_model(path), max_model_len=64)


@pytest.fixture
def validator(model):
    return RequestValidator(model, max_n=64, draw_seed=lambda: 42, new_request_id=lambda: "id")


def beam_request(width: int, length_penalty: float | None = None, **params) -> pdserve_pb2.GenerateRequest:
    option = pdserve_pb2.BeamSearch(beam_width=width)
    if length_penalty is not None:
        option.length_penalty = length_penalty
    return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[1, 2, 3]), beam_search=option,
                                       sampling_params=pdserve_pb2.SamplingParams(**params))


def refused(validator, request) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        validator.validate(request)
    assert str(err.value).startswith(err.value.field)
    return err.value


def test_a_beam_search_returns_every_beam_unless_n_says_fewer(validator):
    out = validator.validate(beam_request(4, 0.5, max_tokens=8, ignore_eos=True))
    assert out.beam == BeamOption(4, 0.5) and out.params.n == 4 and out.params.max_tokens == 8
    assert validator.validate(beam_request(3, n=2)).params.n == 2
    assert validator.validate(beam_request(3, temperature=0.0)).beam == BeamOption(3, 1.0)
    assert validator.validate(beam_request(3, seed=5)).beam is not None  # a seed changes nothing: allowed
    assert validator.validate(pdserve_pb2.GenerateRequest(text="hi")).beam is None


def test_beam_width_is_bounded_by_the_logprobs_cap(validator, model):
    assert len(model.eos_token_ids) == 1
    assert (max_beam_width(1, ignore_eos=False), max_beam_width(1, ignore_eos=True), max_beam_width(3, False)) == \
        (10, 10, 5)
    assert validator.validate(beam_request(10)).beam.beam_width == 10
    for width in (0, 11):
        err = refused(validator, beam_request(width))
        assert err.field == "beam_width"
        assert str(err) == (f"beam_width must be in [1, 10] (each beam reports its top max(2, 1 + #eos ids) * "
                            f"beam_width logprobs, at most 20), got {width}")


@pytest.mark.parametrize("params,field", [
    ({"n": 4}, "n"), ({"n": 0}, "n"), ({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"),
    ({"top_k": 5}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"min_tokens": 2}, "min_tokens"), ({"stop": ["x"]}, "stop"), ({"stop_token_ids": [7]}, "stop_token_ids"),
    ({"logprobs": 1}, "logprobs"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
])
def test_what_a_beam_search_cannot_honour_is_refused_by_name(validator, params, field):
    assert refused(validator, beam_request(3, **params)).field == field


def test_a_non_finite_length_penalty_is_refused(validator):
    assert refused(validator, beam_request(2, float("nan"))).field == "length_penalty"


def orchestrator(model, registry: NodeRegistry) -> Orchestrator:
    config = RouterConfig(model="unused")
    state = RouterState(config, model, registry, DecodePlacement(1.0), PrefillPlacement(8, 0, 16))
    return Orchestrator(state)


def test_neither_a_colocated_node_nor_a_pair_is_failed_precondition_naming_beam_width_and_http_400(model):
    registry = NodeRegistry(heartbeat_timeout_s=3.0, channel_close_grace_s=0.1)
    with pytest.raises(NeedsNodes) as err:
        orchestrator(model, registry).choose_route([1, 2, 3], beam_search=True)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and err.value.field == "beam_width"
    assert str(err.value).startswith("beam_width: beam search runs on a colocated node or a prefill + decode pair")
    http = error_of(err.value)
    assert http.status == 400 and http.body["error"]["param"] == "beam_width"
    assert http.body["error"]["code"] == "FAILED_PRECONDITION"


def test_a_live_prefill_and_decode_pair_can_run_a_beam_search_and_one_kind_alone_cannot(model):
    registry = NodeRegistry(heartbeat_timeout_s=3.0, channel_close_grace_s=0.1, channel_factory=lambda _: None)
    router = orchestrator(model, registry)
    registry.register(NodeKind.PREFILL, "127.0.0.1:7002", "p0")
    with pytest.raises(NeedsNodes):
        router.choose_route([1, 2, 3], beam_search=True)
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    assert isinstance(router.choose_route([1, 2, 3], beam_search=True), DisaggregatedRoute)
    registry.register(NodeKind.COLOCATED, "127.0.0.1:7003", "c0")
    assert isinstance(router.choose_route([1, 2, 3], beam_search=True), ColocatedRoute)  # a colocated node first, as for samples
    assert beams_to_keep(3, num_eos=1, ignore_eos=False) == 6 and beams_to_keep(3, 2, False) == 9
