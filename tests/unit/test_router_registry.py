"""The node registry with a fake clock and fake channels: registration, heartbeats, expiry."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.proto import node_pb2
from pdserve.router.cluster.liveness import GoneWatch
from pdserve.router.cluster.registry import NodeKind, NodeRegistry

TIMEOUT_S = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeChannel:
    def __init__(self, address: str) -> None:
        self.address = address
        self.closed_with: float | None = None

    async def close(self, grace: float | None = None) -> None:
        self.closed_with = grace


class Channels:
    def __init__(self) -> None:
        self.made: list[FakeChannel] = []

    def __call__(self, address: str) -> FakeChannel:
        self.made.append(FakeChannel(address))
        return self.made[-1]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def channels():
    return Channels()


@pytest.fixture
def registry(clock, channels):
    return NodeRegistry(TIMEOUT_S, channel_close_grace_s=3.0, clock=clock, channel_factory=channels)


def stats(free: int, queued: int = 0) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(num_blocks=50, used_blocks=50 - free, queued_prefill_tokens=queued)


def ids(entries) -> list[str]:
    return sorted(e.node_id for e in entries)


def test_registered_nodes_are_live_by_kind_and_carry_their_stats(registry):
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    registry.register(NodeKind.PREFILL, "127.0.0.1:7002", "p0")
    assert ids(registry.live(NodeKind.DECODE)) == ["d0"] and ids(registry.live(NodeKind.PREFILL)) == ["p0"]
    before = registry.get("d0").candidate()
    assert (before.free_blocks, before.stats_seq) == (0, 0)  # no stats yet
    assert registry.heartbeat("d0", stats(free=20))
    after = registry.get("d0").candidate()
    assert (after.free_blocks, after.stats_seq) == (20, 1)


def test_unknown_heartbeat_asks_the_node_to_register(registry):
    assert registry.heartbeat("ghost", stats(free=1)) is False


def test_a_silent_node_is_dropped_and_comes_back_by_registering(registry, clock):
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    clock.now = TIMEOUT_S  # exactly the timeout: still live
    assert ids(registry.live(NodeKind.DECODE)) == ["d0"] and registry.expire() == []
    clock.now = TIMEOUT_S + 0.1
    assert registry.live(NodeKind.DECODE) == []
    assert ids(registry.expire()) == ["d0"]
    assert registry.heartbeat("d0", stats(free=1)) is False
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    assert ids(registry.live(NodeKind.DECODE)) == ["d0"]


def test_heartbeats_keep_a_node_alive(registry, clock):
    registry.register(NodeKind.PREFILL, "127.0.0.1:7002", "p0")
    for _ in range(5):
        clock.now += TIMEOUT_S * 0.9
        assert registry.heartbeat("p0", stats(free=1))
    assert registry.expire() == [] and ids(registry.live(NodeKind.PREFILL)) == ["p0"]


def test_a_restarted_node_replaces_its_old_entry(registry):
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0-restarted")  # same address, new id
    registry.register(NodeKind.DECODE, "127.0.0.1:7009", "d0-restarted")  # same id, new address
    [entry] = registry.live(NodeKind.DECODE)
    assert (entry.node_id, entry.address) == ("d0-restarted", "127.0.0.1:7009")


def test_static_nodes_are_live_only_while_they_answer(registry, clock):
    entry = registry.add_static(NodeKind.DECODE, "127.0.0.1:7005")
    assert registry.live(NodeKind.DECODE) == []  # not polled yet
    registry.heartbeat(entry.node_id, stats(free=9))  # what a successful GetStats records
    assert ids(registry.live(NodeKind.DECODE)) == [entry.node_id]
    clock.now += TIMEOUT_S + 1
    assert registry.live(NodeKind.DECODE) == [] and registry.expire() == []  # silent, but kept
    registry.heartbeat(entry.node_id, stats(free=9))
    assert ids(registry.live(NodeKind.DECODE)) == [entry.node_id]


def test_static_node_polling_over_grpc_marks_unreachable_nodes_not_live():
    async def scenario():
        registry = NodeRegistry(TIMEOUT_S, channel_close_grace_s=0.0)
        registry.add_static(NodeKind.PREFILL, "127.0.0.1:1")  # nothing listens on port 1
        try:
            await registry.poll_static(timeout_s=0.5)
            return registry.live(NodeKind.PREFILL)
        finally:
            await registry.close()

    assert asyncio.run(scenario()) == []


def test_channels_are_cached_per_address_and_closed_with_grace_when_the_node_goes(registry, clock, channels):
    async def scenario():
        entry = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
        assert registry.channel(entry) is registry.channel(entry)
        clock.now += TIMEOUT_S + 1
        registry.expire()
        await asyncio.sleep(0)
        await registry.close()

    asyncio.run(scenario())
    [channel] = channels.made
    assert channel.closed_with == 3.0



class AnsweringStub:
    """GetStats that answers, or fails the way a dead node's address does."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    async def GetStats(self, request, timeout=None):
        if not self.alive:
            raise FakeRpcError()
        return stats(free=1)


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused")


def test_a_suspect_node_is_not_live_until_its_next_stats(registry):
    entry = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    registry.register(NodeKind.DECODE, "127.0.0.1:7002", "d1")
    registry.mark_suspect(entry, "its stream broke")
    assert ids(registry.live(NodeKind.DECODE)) == ["d1"]
    assert registry.heartbeat("d0", stats(free=5))
    assert ids(registry.live(NodeKind.DECODE)) == ["d0", "d1"]


@pytest.mark.parametrize("alive", [True, False])
def test_a_probe_marks_only_a_node_that_does_not_answer(registry, monkeypatch, alive):
    import pdserve.router.cluster.registry as registry_module

    entry = registry.register(NodeKind.PREFILL, "127.0.0.1:7003", "p0")
    monkeypatch.setitem(registry_module._STUBS, NodeKind.PREFILL, lambda channel: AnsweringStub(alive))
    assert asyncio.run(registry.probe(entry, timeout_s=1.0)) is alive
    assert ids(registry.live(NodeKind.PREFILL)) == (["p0"] if alive else [])


# ---- draining: a node that got SIGTERM leaves placement, finishes, then deregisters ----

def test_a_draining_node_is_not_live_but_stays_known_while_it_heartbeats(registry, clock):
    entry = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    registry.register(NodeKind.DECODE, "127.0.0.1:7002", "d1")
    assert registry.heartbeat("d0", stats(free=5), draining=True)
    assert ids(registry.live(NodeKind.DECODE)) == ["d1"]
    assert ids(registry.draining(NodeKind.DECODE)) == ["d0"]
    # Not gone: the calls it holds run to their end on it.
    assert registry.get("d0") is entry and not entry.gone.is_set()
    for _ in range(3):  # its heartbeats keep it known past the timeout, and never live again
        clock.now += TIMEOUT_S * 0.9
        assert registry.heartbeat("d0", stats(free=5)) and registry.heartbeat("d1", stats(free=5))
    assert registry.expire() == []
    assert ids(registry.live(NodeKind.DECODE)) == ["d1"] and entry.draining
    assert entry.stats.used_blocks == 45  # its stats still land


def test_a_node_whose_drain_ran_out_of_time_is_forgotten_and_its_calls_move_on(registry, channels):
    async def scenario():
        entry = registry.register(NodeKind.PREFILL, "127.0.0.1:7002", "p0")
        registry.channel(entry)
        registry.heartbeat("p0", stats(free=1), draining=True)
        assert registry.deregister("p0", drained=False) is True
        assert registry.get("p0") is None and registry.draining(NodeKind.PREFILL) == []
        # A call still open on it sees it gone, and why.
        assert entry.gone.is_set()
        assert entry.gone_reason == "127.0.0.1:7002 left the cluster before its drain finished"
        assert registry.deregister("p0", drained=False) is False  # twice: not known any more
        assert registry.heartbeat("p0", stats(free=1)) is False  # a late heartbeat: register again
        await asyncio.sleep(0)
        await registry.close()

    asyncio.run(scenario())
    assert channels.made[0].closed_with == 3.0


def test_a_node_that_drained_is_forgotten_without_failing_a_stream_it_fed(registry):
    """A drained prefill node's pushes were all acknowledged: a decode stream that still lists
    it as a feeder (its first token not yet relayed) must not be resumed when it leaves."""
    async def scenario():
        prefill = registry.register(NodeKind.PREFILL, "127.0.0.1:7002", "p0")
        decode = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
        registry.heartbeat("p0", stats(free=1), draining=True)
        with GoneWatch([decode, prefill]) as watch:
            assert registry.deregister("p0", drained=True) is True
            assert registry.get("p0") is None and not prefill.gone.is_set()
            # The stream's next await completes rather than raising NodeGone.
            assert await watch.until(asyncio.sleep(0, result="token")) == "token"
        await registry.close()

    asyncio.run(scenario())


def test_a_node_started_again_after_a_drain_registers_afresh_and_is_live(registry):
    registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    registry.heartbeat("d0", stats(free=1), draining=True)
    registry.deregister("d0", drained=True)
    entry = registry.register(NodeKind.DECODE, "127.0.0.1:7001", "d0")
    assert not entry.draining and ids(registry.live(NodeKind.DECODE)) == ["d0"]
