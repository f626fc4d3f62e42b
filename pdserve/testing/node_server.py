"""A fake node's real gRPC server on 127.0.0.1, registered with the router and heartbeating, like
a real node: `FakeNode`, and `fake_nodes` / `colocated_nodes`, which start a set and always stop it.

A fake registers through the real `Registry` RPCs with the fingerprint of a float32 node running
the router's model (`fingerprint_for`: the router's name and block size, the model's shape), sends
its stats once before `start` returns (placement ranks it from then on), and then every heartbeat;
a heartbeat answered known=false registers it again, as a real node does.

Must never: leave a server, channel or heartbeat task behind once stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from pdserve.kv_transfer.base import KV_LAYOUT_VERSION
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.fake_colocated import FakeColocated
from pdserve.testing.fake_nodes import Calls, FakeDecode, FakePrefill, Script, decode_stats, prefill_stats

HEARTBEAT_S = 0.1
ADD_SERVICER = {
    "prefill": node_pb2_grpc.add_PrefillNodeServicer_to_server,
    "decode": node_pb2_grpc.add_DecodeNodeServicer_to_server,
    "colocated": node_pb2_grpc.add_ColocatedNodeServicer_to_server,
}


@dataclass(frozen=True)
class ModelShape:
    """The KV shape a node's fingerprint states; the router checks it against its model's."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


TINY_SHAPE = ModelShape(num_layers=3, num_kv_heads=2, head_dim=16)  # tests/conftest.py's tiny llama


async def fingerprint_for(channel: grpc.aio.Channel, shape: ModelShape = TINY_SHAPE) -> node_pb2.NodeFingerprint:
    """What a float32 node running the router's model registers with: the router's model name and block size."""
    info = await pdserve_pb2_grpc.GenerationStub(channel).GetModelInfo(pdserve_pb2.GetModelInfoRequest())
    return node_pb2.NodeFingerprint(model=info.model, dtype="float32", num_layers=shape.num_layers,
                                    num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                                    block_size=info.block_size, layout_version=KV_LAYOUT_VERSION)


class FakeNode:
    """One fake node's server plus its registration and heartbeat loop; `servicer.stats` is what it reports."""

    def __init__(self, kind: str, servicer, router_address: str, node_id: str, *,
                 shape: ModelShape = TINY_SHAPE, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.kind, self.servicer, self.router_address, self.node_id = kind, servicer, router_address, node_id
        self.shape, self.heartbeat_s = shape, heartbeat_s
        self.address = ""
        self.heartbeats = True
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self._register: node_pb2.RegisterRequest | None = None

    async def start(self, register: bool = True) -> None:
        """Serve; with register=False the router must know the node from its flags (static)."""
        self._server = grpc.aio.server()
        ADD_SERVICER[self.kind](self.servicer, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        await self._server.start()
        if not register:
            return
        self._channel = grpc.aio.insecure_channel(self.router_address)
        registry = node_pb2_grpc.RegistryStub(self._channel)
        self._register = node_pb2.RegisterRequest(kind=self.kind, address=self.address, node_id=self.node_id,
                                                  fingerprint=await fingerprint_for(self._channel, self.shape))
        await registry.Register(self._register)
        await self._beat(registry)
        self._task = asyncio.create_task(self._heartbeat(registry))

    async def stop_heartbeats(self) -> None:
        """No more stats from this node: what the router last heard stays its latest."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _heartbeat(self, registry: node_pb2_grpc.RegistryStub) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)  # the heartbeat's period, not a wait for anything
            if self.heartbeats:
                await self._beat(registry)

    async def report(self) -> None:
        """Send `servicer.stats` now, out of the heartbeat's turn: placement ranks from them once
        this returns."""
        async with grpc.aio.insecure_channel(self.router_address) as channel:
            await self._beat(node_pb2_grpc.RegistryStub(channel))

    async def _beat(self, registry: node_pb2_grpc.RegistryStub) -> None:
        beat = node_pb2.HeartbeatRequest(node_id=self.node_id, stats=self.servicer.stats)
        if not (await registry.Heartbeat(beat, timeout=5)).known:
            await registry.Register(self._register)

    async def stop(self) -> None:
        await self.stop_heartbeats()
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()


@contextlib.asynccontextmanager
async def started(nodes: Sequence[FakeNode], register: bool = True) -> AsyncIterator[list[FakeNode]]:
    """Start (and register) the nodes in order; always stop them, even when the test fails."""
    try:
        for node in nodes:
            await node.start(register)
        yield list(nodes)
    finally:
        for node in nodes:
            await node.stop()


@contextlib.asynccontextmanager
async def fake_nodes(
    router_address: str, script: Script, prefill: int = 1, decode: int = 1
) -> AsyncIterator[tuple[Calls, list[FakeNode]]]:
    """Prefill nodes p0.. then decode nodes d0.., all answering `script`, all seen by one `Calls`."""
    calls = Calls()
    nodes = [FakeNode("prefill", FakePrefill(script, calls, prefill_stats()), router_address, f"p{i}")
             for i in range(prefill)]
    nodes += [FakeNode("decode", FakeDecode(script, calls, decode_stats()), router_address, f"d{i}")
              for i in range(decode)]
    async with started(nodes):
        yield calls, nodes


@contextlib.asynccontextmanager
async def colocated_nodes(router_address: str, *servicers: FakeColocated) -> AsyncIterator[list[FakeNode]]:
    """One colocated node c0.. per servicer."""
    nodes = [FakeNode("colocated", servicer, router_address, f"c{i}") for i, servicer in enumerate(servicers)]
    async with started(nodes):
        yield nodes
