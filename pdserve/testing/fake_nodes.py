"""Scripted fake prefill and decode nodes: what they answer (`Script`) and what they saw (`Calls`).

The fake prefill "pushes KV" by setting an event the fake decode waits on (what a real decode node
does on the transfer's done message), so a decode stream only goes past READY once the prefill has
answered. Every call a fake receives, and every call the router cancels, is recorded for a test to
assert on. Behaviours a test turns on per node are plain attributes of the servicer: a refusal
(RESOURCE_EXHAUSTED), a death before READY or mid-stream, a frozen node, KV that never lands, a
reservation lease. A hang is an event nobody sets, never a sleep.

Must never: decide anything the router decides, or sleep where it waits for a condition (the gap
between two events of a stream paces it like a node's steps; it is no wait).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.testing.waiting import until

FAKE_LAYOUT_ID = "127.0.0.1:1/fake-run"
FAKE_BLOCK_IDS = (7, 3, 5)
EVENT_GAP_S = 0.01  # between two events of a stream: each reaches the router on its own


@dataclass
class Script:
    """What the fakes answer; the callables take the sample index (or, on a resume, the resumed tokens)."""

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
    event_gap_s: float = EVENT_GAP_S

    def first_token_for(self, request: node_pb2.PrefillRequest) -> int:
        resumed = list(request.resumed_token_ids)
        if resumed and self.resumed_first_token is not None:
            return self.resumed_first_token(resumed)
        return self.first_token(request.sample_index)

    def events_for(self, request: node_pb2.SampleRequest) -> list[node_pb2.DecodeTokens]:
        resumed = list(request.resumed_token_ids)
        if resumed and self.resumed_events is not None:
            return self.resumed_events(resumed)
        return self.decode_events(request.sample_index)


@contextlib.contextmanager
def noting_cancel(note: Callable[[], object]) -> Iterator[None]:
    """Around a fake's handler: `note()` when the router cancels the call."""
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):  # grpc.aio cancels the handler's task
        note()
        raise


@dataclass
class Calls:
    """Shared by all fakes of one test: what they saw, and the KV pushes between them."""

    decode_requests: list[node_pb2.SampleRequest] = field(default_factory=list)
    prefill_requests: list[node_pb2.PrefillRequest] = field(default_factory=list)
    cancelled: set[tuple[str, str]] = field(default_factory=set)  # (kind, request_id)
    kv_done: defaultdict[str, asyncio.Event] = field(default_factory=lambda: defaultdict(asyncio.Event))

    def watch(self, kind: str, request_id: str):
        """Around a fake's handler: records that the router cancelled the call."""
        return noting_cancel(lambda: self.cancelled.add((kind, request_id)))

    async def wait_cancelled(self, kind: str, request_id: str, timeout_s: float = 5.0) -> bool:
        return bool(await until(lambda: (kind, request_id) in self.cancelled, timeout_s))


def decode_stats(free_blocks: int = 100, num_blocks: int = 100) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(kind="decode", num_blocks=num_blocks, used_blocks=num_blocks - free_blocks)


def prefill_stats(queued: int = 0, num_blocks: int = 100) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(kind="prefill", num_blocks=num_blocks, queued_prefill_tokens=queued)


def taken_in(stats: node_pb2.NodeStats, request: node_pb2.SampleRequest | node_pb2.PrefillRequest) -> None:
    """As a node's core: its stats show the highest placement stamp it has taken in."""
    stats.placed_through = max(stats.placed_through, request.placement_stamp)


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
        taken_in(self.stats, request)
        with self.calls.watch("decode", request.request_id):
            if self.refuse:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake decode: no free KV blocks")
            if self.fail_before_ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake decode: engine core died")
            yield node_pb2.DecodeEvent(ready=node_pb2.Ready(kv_layout_id=FAKE_LAYOUT_ID, block_ids=FAKE_BLOCK_IDS))
            try:
                await asyncio.wait_for(self.calls.kv_done[request.request_id].wait(), self.lease_s)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fake decode: the KV did not arrive in the lease")
            del self.calls.kv_done[request.request_id]  # landed: a long run keeps no event per request
            for tokens in self.script.events_for(request):
                if self.script.event_gap_s:
                    await asyncio.sleep(self.script.event_gap_s)
                yield node_pb2.DecodeEvent(tokens=tokens)
            if self.fail_after_events:
                await context.abort(grpc.StatusCode.INTERNAL, "fake decode: engine core died")
            if self.script.hang_after_events:
                await asyncio.Event().wait()

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
        taken_in(self.stats, request)
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
        response = node_pb2.PrefillResponse(
            first_token_id=self.script.first_token_for(request),
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
