"""Router admission control: exact counts of the pure object, then the real router server
against fake nodes (refused at once with RESOURCE_EXHAUSTED, slots back on every exit).
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from pdserve.proto import node_pb2, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import AdmissionLimits
from pdserve.router.requests.admission import Admission
from pdserve.router.errors import Overloaded, status_of
from pdserve.router.config import RouterConfig
from pdserve.router.fronts.server import RouterServer, _parser, config_from_args
from pdserve.testing.fake_nodes import Script
from pdserve.testing.node_server import fake_nodes
from pdserve.testing.router import run
from pdserve.testing.waiting import until

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH


def test_admits_up_to_the_sequence_limit_then_refuses_with_resource_exhausted():
    admission = Admission(AdmissionLimits(max_inflight_requests=3, max_queued_tokens=1000))
    first = admission.admit(10, 2)
    second = admission.admit(10, 1)
    assert (admission.inflight, admission.queued_tokens) == (3, 30)
    with pytest.raises(Overloaded) as refused:
        admission.admit(1, 1)
    code, message = status_of(refused.value)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 sequences in flight" in message and "limit 3" in message
    assert admission.rejected == 1
    assert (admission.inflight, admission.queued_tokens) == (3, 30)  # a refusal holds nothing
    first.release()
    second.release()
    assert (admission.inflight, admission.queued_tokens) == (0, 0)


def test_queued_tokens_count_until_each_sample_responds():
    admission = Admission(AdmissionLimits(max_inflight_requests=100, max_queued_tokens=100))
    ticket = admission.admit(30, 3)
    assert admission.queued_tokens == 90
    with pytest.raises(Overloaded, match="90 prompt tokens waiting for prefill, this request adds 20, limit 100"):
        admission.admit(20, 1)
    ticket.responded(1)
    ticket.responded(1)  # a sample's later responses change nothing
    assert admission.queued_tokens == 60
    other = admission.admit(20, 1)
    assert (admission.inflight, admission.queued_tokens) == (4, 80)
    ticket.release()
    assert (admission.inflight, admission.queued_tokens) == (1, 20)
    ticket.responded(0)  # after release: nothing left to give back
    ticket.release()
    assert (admission.inflight, admission.queued_tokens) == (1, 20)
    other.release()
    assert (admission.inflight, admission.queued_tokens) == (0, 0)


def test_a_request_larger_than_a_limit_waits_for_an_empty_router_instead_of_never_fitting():
    admission = Admission(AdmissionLimits(max_inflight_requests=2, max_queued_tokens=50))
    small = admission.admit(10, 1)
    with pytest.raises(Overloaded):
        admission.admit(80, 1)
    with pytest.raises(Overloaded):
        admission.admit(1, 4)
    small.release()
    with admission.admit(80, 4):
        assert (admission.inflight, admission.queued_tokens) == (4, 320)
        with pytest.raises(Overloaded):
            admission.admit(1, 1)
    assert (admission.inflight, admission.queued_tokens) == (0, 0)


def test_the_context_manager_releases_on_an_exception():
    admission = Admission(AdmissionLimits(max_inflight_requests=1, max_queued_tokens=10))
    with pytest.raises(RuntimeError):
        with admission.admit(5, 1):
            raise RuntimeError("the request failed")
    assert (admission.inflight, admission.queued_tokens) == (0, 0)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_inflight_requests must be >= 1, got 0"):
        AdmissionLimits(max_inflight_requests=0, max_queued_tokens=1)
    with pytest.raises(ValueError, match="max_queued_tokens must be >= 1, got -5"):
        AdmissionLimits(max_inflight_requests=1, max_queued_tokens=-5)


def test_router_flags_set_the_limits():
    args = _parser().parse_args(["--model", "m", "--max-inflight-requests", "7", "--max-queued-tokens", "900"])
    config = config_from_args(args)
    assert config.admission == AdmissionLimits(max_inflight_requests=7, max_queued_tokens=900)


# -- the real router server, fake nodes ---------------------------------------------------

def request(prompt: list[int], max_tokens: int = 3) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


@contextlib.asynccontextmanager
async def router_server(router_model, **overrides):
    """The real router server, yielded itself so a test can read its admission counts."""
    path, loaded = router_model
    server = RouterServer(RouterConfig(model=path, port=0, **overrides), loaded)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


async def drain(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except asyncio.CancelledError:  # grpc.aio raises this for a call its client cancelled
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


def test_router_refuses_beyond_capacity_at_once_and_frees_slots_on_cancel_and_deadline(router_model):
    events = [node_pb2.DecodeTokens(token_ids=[5, 6], finish_reason=LENGTH, stop_token_id=-1)]
    script = Script(first_token=lambda i: 4, decode_events=lambda i: events, hang_prefill=True)

    async def scenario():
        async with router_server(router_model, admission=AdmissionLimits(max_inflight_requests=2)) as server:
            address, admission = f"127.0.0.1:{server.port}", server.admission
            async with fake_nodes(address, script) as (calls, _):
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = pdserve_pb2_grpc.GenerationStub(channel)
                    hung = [stub.Generate(request([1, 2, 3]), timeout=10) for _ in range(2)]
                    readers = [asyncio.create_task(drain(call)) for call in hung]
                    await until(lambda: len(calls.prefill_requests) == 2)
                    refused = await drain(stub.Generate(request([1, 2, 3]), timeout=10))
                    hung[0].cancel()  # its client goes away: its slot comes back
                    await until(lambda: admission.inflight == 1)
                    expired = await drain(stub.Generate(request([7, 8]), timeout=0.5))
                    await until(lambda: admission.inflight == 1)  # the deadline gave its slot back too
                    script.hang_prefill = False
                    hung[1].cancel()
                    await until(lambda: admission.inflight == 0)
                    ended = await asyncio.gather(*readers)
                    served = [await drain(stub.Generate(request([9, 9, 9]), timeout=10)) for _ in range(3)]
                    return refused, expired, ended, served, admission

    refused, expired, ended, served, admission = run(scenario())
    assert refused is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert expired is grpc.StatusCode.DEADLINE_EXCEEDED
    assert ended == [grpc.StatusCode.CANCELLED, grpc.StatusCode.CANCELLED]
    assert served == [grpc.StatusCode.OK] * 3
    assert (admission.inflight, admission.queued_tokens, admission.rejected) == (0, 0, 1)


def test_check_room_refuses_only_when_not_one_more_sequence_fits():
    admission = Admission(AdmissionLimits(max_inflight_requests=2, max_queued_tokens=100))
    admission.check_room()
    ticket = admission.admit(5, 2)
    with pytest.raises(Overloaded, match=r"2 sequences in flight, limit 2\); retry later"):
        admission.check_room()
    assert admission.rejected == 1
    ticket.release()
    admission.check_room()
