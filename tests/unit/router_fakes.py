"""Fake prefill and decode nodes for router tests: in-process grpc.aio servers, scripted tokens.

Also the harness around them: the real router server in-process (`running_router`), a
bounded event loop per test (`run`) and a collecting client (`generate`).

Each fake registers with the router through the real `Registry` RPCs (with the fingerprint
of a node running the router's tiny model, `fingerprint_for`) and heartbeats its stats, like a
real node. The fake prefill "pushes KV" by setting an event the fake
decode waits on (what a real decode node does on the transfer's done message), so the
decode stream only starts once the prefill has answered. Every call a fake receives,
and every call the router cancels, is recorded for the tests to assert on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch
import uvloop

from pdserve.model_factory import make_model
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.model import RouterModel, load_router_model
from pdserve.router.fronts.server import RouterServer

HEARTBEAT_S = 0.1
TEST_TIMEOUT_S = 30.0
FAKE_LAYOUT_ID = "127.0.0.1:1/fake-run"


@dataclass
class Script:
    """What the fakes answer; callables take the sample index."""

    first_token: Callable[[int], int] = lambda index: 304
    decode_events: Callable[[int], list[node_pb2.DecodeTokens]] = lambda index: []
    refuse_decode: bool = False
    hang_prefill: bool = False  # the prefill never answers (until cancelled)
    hang_after_events: bool = False  # the decode stream stays open after its events
    fail_decode_after_events: bool = False  # the decode node dies mid-stream
    prefill_logprobs: pdserve_pb2.TokenLogprobs | None = None
    # Answered with token 1 to a prefill that asks for prompt logprobs.
    prompt_logprobs: list[pdserve_pb2.TokenLogprobs] = field(default_factory=list)
    # A resume (resumed_token_ids set): the prefill's token and the decode events, given
    # the resumed tokens; None: the same as a first attempt.
    resumed_first_token: Callable[[list[int]], int] | None = None
    resumed_events: Callable[[list[int]], list[node_pb2.DecodeTokens]] | None = None
    fail_prefill: bool = False  # the prefill node fails UNAVAILABLE (as a dying one does)


@dataclass
class Calls:
    """Shared by all fakes of one test: what they saw."""

    decode_requests: list[node_pb2.SampleRequest] = field(default_factory=list)
    prefill_requests: list[node_pb2.PrefillRequest] = field(default_factory=list)
    cancelled: set[tuple[str, str]] = field(default_factory=set)  # (kind, request_id)
    kv_done: defaultdict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))

    @contextlib.contextmanager
    def watch(self, kind: str, request_id: str) -> Iterator[None]:
        """Around a fake's handler: records that the router cancelled the call."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):  # grpc.aio cancels the handler's task
            self.cancelled.add((kind, request_id))
            raise

    async def wait_cancelled(self, kind: str, request_id: str, timeout_s: float = 5.0) -> bool:
        async with asyncio.timeout(timeout_s):
            while (kind, request_id) not in self.cancelled:
                await asyncio.sleep(0.01)
        return True


class FakeDecode(node_pb2_grpc.DecodeNodeServicer):
    def __init__(self, script: Script, calls: Calls, stats: node_pb2.NodeStats) -> None:
        self.script, self.calls, self.stats = script, calls, stats
        self.refuse = script.refuse_decode  # per node, so a test can make one node full
        self.fail_after_events = script.fail_decode_after_events  # per node, so one node can die
        self.fail_before_ready = False  # per node: UNAVAILABLE before READY (a core that just died)
        self.lease_s: float | None = None  # per node: DEADLINE_EXCEEDED when the KV is this late
        self.requests: list[node_pb2.SampleRequest] = []

    async def Decode(self, request, context):
        self.calls.decode_requests.append(request)
        self.requests.append(request)
        with self.calls.watch("decode", request.request_id):
            if self.refuse:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake decode: no free KV blocks")
            if self.fail_before_ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode: engine core died")
            yield node_pb2.DecodeEvent(ready=node_pb2.Ready(kv_layout_id=FAKE_LAYOUT_ID, block_ids=[7, 3, 5]))
            try:
                await asyncio.wait_for(self.calls.kv_done[request.request_id].wait(), self.lease_s)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fake decode: the KV did not arrive in the lease")
            for tokens in self._events(request):
                await asyncio.sleep(0.01)
                yield node_pb2.DecodeEvent(tokens=tokens)
            if self.fail_after_events:
                await context.abort(grpc.StatusCode.INTERNAL, "fake decode: engine core died")
            if self.script.hang_after_events:
                await asyncio.Event().wait()

    def _events(self, request: node_pb2.SampleRequest) -> list[node_pb2.DecodeTokens]:
        resumed = list(request.resumed_token_ids)
        if resumed and self.script.resumed_events is not None:
            return self.script.resumed_events(resumed)
        return self.script.decode_events(request.sample_index)

    async def GetStats(self, request, context):
        return self.stats


class FakePrefill(node_pb2_grpc.PrefillNodeServicer):
    def __init__(self, script: Script, calls: Calls, stats: node_pb2.NodeStats) -> None:
        self.script, self.calls, self.stats = script, calls, stats
        self.fail = script.fail_prefill  # per node, so one node can die
        self.refuse = False  # per node: RESOURCE_EXHAUSTED, a full queue
        self.hang = False  # per node: a Prefill that never answers (a frozen node)
        self.withhold_kv = False  # per node: token 1 answered, the KV never lands (it froze mid-transfer)

    async def Prefill(self, request, context):
        self.calls.prefill_requests.append(request)
        with self.calls.watch("prefill", request.request_id):
            if self.hang or self.script.hang_prefill:
                await asyncio.Event().wait()
        if self.refuse:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake prefill: queue full")
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake prefill: connection reset")
        if self.withhold_kv:
            self.withhold_kv = False  # once: the next request's KV lands
        else:
            self.calls.kv_done[request.request_id].set()
        resumed = list(request.resumed_token_ids)
        first = self.script.first_token(request.sample_index)
        if resumed and self.script.resumed_first_token is not None:
            first = self.script.resumed_first_token(resumed)
        response = node_pb2.PrefillResponse(
            first_token_id=first,
            num_cached_tokens=16,
            prefill_s=0.25,
            kv_transfer_s=0.125,
            kv_transfer_bytes=4096,
        )
        if self.script.prefill_logprobs is not None:
            response.logprobs.CopyFrom(self.script.prefill_logprobs)
        if request.sampling_params.HasField("prompt_logprobs"):
            response.prompt_logprobs.extend(self.script.prompt_logprobs)
        return response

    async def GetStats(self, request, context):
        return self.stats


async def fingerprint_for(channel: grpc.aio.Channel) -> node_pb2.NodeFingerprint:
    """What a float32 node running the router's model (the tiny llama of `tiny_router_model`:
    3 layers, 2 KV heads of 16) registers with: the router's model name and block size."""
    info = await pdserve_pb2_grpc.GenerationStub(channel).GetModelInfo(pdserve_pb2.GetModelInfoRequest())
    return node_pb2.NodeFingerprint(model=info.model, dtype="float32", num_layers=3, num_kv_heads=2, head_dim=16,
                                    block_size=info.block_size, layout_version=1)


class FakeNode:
    """One fake node's server plus its registration and heartbeat loop."""

    def __init__(self, kind: str, servicer, router_address: str, node_id: str) -> None:
        self.kind, self.servicer, self.router_address, self.node_id = kind, servicer, router_address, node_id
        self.address = ""
        self.heartbeats = True
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self._register: node_pb2.RegisterRequest | None = None

    async def start(self, register: bool = True) -> None:
        """Serve; with register=False the router must know the node from its flags (static)."""
        self._server = grpc.aio.server()
        if self.kind == "decode":
            node_pb2_grpc.add_DecodeNodeServicer_to_server(self.servicer, self._server)
        else:
            node_pb2_grpc.add_PrefillNodeServicer_to_server(self.servicer, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        await self._server.start()
        if not register:
            return
        self._channel = grpc.aio.insecure_channel(self.router_address)
        registry = node_pb2_grpc.RegistryStub(self._channel)
        self._register = node_pb2.RegisterRequest(kind=self.kind, address=self.address, node_id=self.node_id,
                                                  fingerprint=await fingerprint_for(self._channel))
        await registry.Register(self._register)
        self._task = asyncio.create_task(self._heartbeat(registry))

    async def stop_heartbeats(self) -> None:
        """No more stats from this node: what the router last heard stays its latest."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _heartbeat(self, registry: node_pb2_grpc.RegistryStub) -> None:
        while True:
            if self.heartbeats:
                beat = node_pb2.HeartbeatRequest(node_id=self.node_id, stats=self.servicer.stats)
                if not (await registry.Heartbeat(beat)).known:
                    await registry.Register(self._register)
            await asyncio.sleep(HEARTBEAT_S)

    async def stop(self) -> None:
        await self.stop_heartbeats()
        if self._server is not None:
            await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()


def decode_stats(free_blocks: int = 100) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(kind="decode", num_blocks=100, used_blocks=100 - free_blocks)


def prefill_stats(queued: int = 0) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(kind="prefill", num_blocks=100, queued_prefill_tokens=queued)


@contextlib.asynccontextmanager
async def fake_nodes(
    router_address: str, script: Script, prefill: int = 1, decode: int = 1
) -> AsyncIterator[tuple[Calls, list[FakeNode]]]:
    """Start and register the fakes; always stop them, even when the test fails."""
    calls = Calls()
    nodes = [FakeNode("prefill", FakePrefill(script, calls, prefill_stats()), router_address, f"p{i}")
             for i in range(prefill)]
    nodes += [FakeNode("decode", FakeDecode(script, calls, decode_stats()), router_address, f"d{i}")
              for i in range(decode)]
    try:
        for node in nodes:
            await node.start()
        yield calls, nodes
    finally:
        for node in nodes:
            await node.stop()


def tiny_router_model(root) -> tuple[str, RouterModel]:
    path = make_model(root / "tiny", "llama", "tiny", dtype=torch.float32)
    return str(path), load_router_model(path)


def run(coro):
    """Run one scenario on uvloop, bounded in time."""

    async def bounded():
        async with asyncio.timeout(TEST_TIMEOUT_S):
            return await coro

    return uvloop.run(bounded())


@contextlib.asynccontextmanager
async def running_router(model: tuple[str, RouterModel], **overrides) -> AsyncIterator[str]:
    """The real router server on 127.0.0.1, an OS-picked port; yields its address."""
    path, loaded = model
    server = RouterServer(RouterConfig(model=path, port=0, **overrides), loaded)
    await server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


async def generate(
    address: str, request: pdserve_pb2.GenerateRequest, timeout_s: float | None = None
) -> list[pdserve_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return [r async for r in stub.Generate(request, timeout=timeout_s)]
