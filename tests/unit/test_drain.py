"""Draining, one seam at a time: what a node still holds, the router's admission once closed,
resumes counted by reason (a drain that runs out of time is its own reason; the series is
tests/unit/test_router_metrics.py's)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.node.front.drain import still_held
from pdserve.node.messages import StatsData
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.router.config import AdmissionLimits
from pdserve.router.dispatch.recovery import LossReason, NodeLost
from pdserve.router.errors import NodeFailed, RouterDraining, status_of
from pdserve.router.requests.admission import Admission


def core_stats(**held: int) -> StatsData:
    values = dict(num_waiting=0, num_running=0, used_blocks=0, reserved_blocks=0) | held
    return StatsData(kind="prefill", num_blocks=64, queued_prefill_tokens=0, **values)


def test_a_node_holds_nothing_only_with_no_rpc_request_or_block():
    assert still_held(0, core_stats()) is None
    assert still_held(1, core_stats()) == "1 open requests"
    # A prefill node whose RPC ended at token 1 still holds the blocks its pushes read.
    assert still_held(0, core_stats(reserved_blocks=3)) == "3 blocks held for transfers"
    assert still_held(0, core_stats(num_running=1, used_blocks=2)) == "1 running, 2 blocks in use"
    assert still_held(0, None) == "its engine core is mid-step"


def test_a_closed_admission_refuses_new_requests_unavailable_and_tells_when_idle():
    async def scenario():
        admission = Admission(AdmissionLimits(max_inflight_requests=8, max_queued_tokens=1000))
        assert admission.idle.is_set()
        ticket = admission.admit(10, 2)
        assert not admission.idle.is_set()
        admission.close("draining (stopping)")
        with pytest.raises(RouterDraining) as refused:
            admission.check_room()
        assert status_of(refused.value) == (grpc.StatusCode.UNAVAILABLE, "the router is draining (stopping) and "
                                            "takes no new request; retry on another router")
        ticket.release()  # what was admitted runs on to its end
        await asyncio.wait_for(admission.idle.wait(), 1.0)
        assert (admission.inflight, admission.queued_tokens) == (0, 0)

    asyncio.run(scenario())


def test_a_loss_on_a_draining_node_counts_as_its_drain_running_out_of_time():
    async def scenario():
        registry = NodeRegistry(5.0, 1.0, channel_factory=lambda address: None)
        entry = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
        lost = NodeLost(NodeFailed("stream broke"), probe=[entry], decoding=True)
        assert lost.cause() is LossReason.NODE_FAILED
        registry.heartbeat("d0", None, draining=True)
        assert lost.cause() is LossReason.DRAIN_TIMEOUT
        gone = NodeLost(NodeFailed("gone"), probe=[], decoding=True, exclude=[entry], reason=LossReason.NODE_GONE)
        assert gone.cause() is LossReason.DRAIN_TIMEOUT

    asyncio.run(scenario())
