"""Heartbeats never wait on the engine core: the stats push message and the registration loop.

The registration loop runs against an in-process fake `Registry`; its only source of
stats is a plain accessor (what `CoreClient.latest_stats` is), so a core stuck in a long
step cannot delay a heartbeat. Before the core's first snapshot the node does not
register at all; a heartbeat answered `known=false` makes it register again.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from pdserve.engine.config import EngineConfig
from pdserve.node.config import NodeConfig
from pdserve.kv_transfer import TransferStats
from pdserve.node.messages import StatsData, StatsPush, decode, encode
from pdserve.node.front.registration import run_registration
from pdserve.proto import node_pb2, node_pb2_grpc
from pdserve.testing.router import run
from pdserve.testing.waiting import until


FINGERPRINT = {"model": "m", "dtype": "float32", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16,
               "block_size": 16, "layout_version": 1}


def snapshot(used: int) -> StatsData:
    return StatsData("prefill", 64, used, 1, 2, 3, 40, TransferStats(10, 1, 1, 0, 0.5), 6, 2)


def test_stats_push_round_trips():
    msg = StatsPush(snapshot(5))
    assert decode(encode(msg)) == msg


class FakeRegistry(node_pb2_grpc.RegistryServicer):
    def __init__(self) -> None:
        self.registrations: list[node_pb2.RegisterRequest] = []
        self.heartbeats: list[node_pb2.HeartbeatRequest] = []
        self.forget_next = False
        self.fail_next: grpc.StatusCode | None = None

    async def Register(self, request, context):
        self.registrations.append(request)
        return node_pb2.RegisterResponse(heartbeat_interval_ms=20)

    async def Heartbeat(self, request, context):
        self.heartbeats.append(request)
        if self.fail_next is not None:
            code, self.fail_next = self.fail_next, None
            await context.abort(code, "a slow router")
        known, self.forget_next = not self.forget_next, False
        return node_pb2.HeartbeatResponse(known=known)


@contextlib.asynccontextmanager
async def registering(registry: FakeRegistry, node_id: str, address: str, latest_stats):
    """`registry` served on a free port, and a node's registration loop running against it."""
    server = grpc.aio.server()
    node_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = NodeConfig(EngineConfig("/m"), router=f"127.0.0.1:{port}", node_id=node_id, heartbeat_interval_s=0.02)
    task = asyncio.create_task(run_registration(config, address, latest_stats, FINGERPRINT))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(0)


def test_heartbeats_carry_the_latest_snapshot_and_wait_for_the_first_one():
    registry = FakeRegistry()
    latest: list[StatsData | None] = [None]

    async def scenario():
        asked = [0]

        def latest_snapshot() -> StatsData | None:
            asked[0] += 1
            return latest[0]

        async with registering(registry, "p0", "127.0.0.1:7000", latest_snapshot):
            await until(lambda: asked[0] >= 3)  # it looked for a snapshot three times, found none
            before_first = (len(registry.registrations), len(registry.heartbeats))
            latest[0] = snapshot(3)
            await until(lambda: len(registry.heartbeats) >= 2)
            latest[0] = snapshot(9)  # what the core pushed next
            await until(lambda: registry.heartbeats[-1].stats.used_blocks == 9)
            registry.forget_next = True
            await until(lambda: len(registry.registrations) == 2)
            return before_first

    before_first = run(scenario())
    assert before_first == (0, 0)
    first = registry.registrations[0]
    assert (first.kind, first.address, first.node_id) == ("prefill", "127.0.0.1:7000", "p0")
    assert (first.fingerprint.model, first.fingerprint.block_size, first.fingerprint.head_dim) == ("m", 16, 16)
    beat = registry.heartbeats[0]
    assert beat.node_id == "p0"
    assert (beat.stats.used_blocks, beat.stats.reserved_blocks, beat.stats.queued_prefill_tokens) == (3, 1, 40)
    assert beat.stats.kv_transfer.bytes == 10


def test_a_failed_heartbeat_does_not_register_the_node_again():
    """Registering again would end the router's streams on this node: only `known=false` does."""
    registry = FakeRegistry()

    async def scenario() -> int:
        async with registering(registry, "d0", "127.0.0.1:7001", lambda: snapshot(1)):
            await until(lambda: len(registry.heartbeats) >= 2)
            registry.fail_next = grpc.StatusCode.DEADLINE_EXCEEDED
            failed_at = len(registry.heartbeats)
            await until(lambda: len(registry.heartbeats) >= failed_at + 3)  # the failed one, two after it
            registrations_after_failure = len(registry.registrations)
            registry.forget_next = True  # what does make it register again
            await until(lambda: len(registry.registrations) == 2)
            return registrations_after_failure

    assert run(scenario()) == 1
    assert [r.node_id for r in registry.registrations] == ["d0", "d0"]
