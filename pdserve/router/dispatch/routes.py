"""The two ways a sample's tokens are made, as routes the one driver (pdserve/router/dispatch/driver.py) follows.

Disaggregated (a decode node, then a prefill node):

    rank decode nodes ──Decode(prompt, resumed)──▶ READY{KV layout id, block ids}
                                                   (placement counts prompt + max_tokens on D)
    lead-in: pick P ──Prefill(layout id, D's address, block ids, resumed)──▶ its answer ──▶ the sink
                                                   (RESOURCE_EXHAUSTED: next P, same blocks;
                                                    a sample's token 1 may end it; a beam
                                                    search's is not the client's)
    relay D's events ──▶ the sink (tokens; a beam search's one `beams` event)
    lost: a decode stream implicates D (probed); a prefill, P and D (both probed)

Colocated (one node runs both phases — the baseline):

    rank colocated nodes ──Generate(prompt, resumed)──▶ tokens 1..n (a beam search: its beams) ──▶ the sink
    no lead-in
    lost: the stream implicates its node (probed), excluded outright for this sample

Why a failed prefill ends the attempt instead of reusing D's reservation: the failed
prefill node may still write into those blocks, or send D an "aborted" done that frees
them while another prefill node writes; a fresh reservation under a new id is never
ambiguous (D frees the old one and drops what still arrives for it). Only a
RESOURCE_EXHAUSTED prefill (refused before it touched anything) reuses the reservation.

Owns, per architecture: the stub and RPC that open a sample's stream, the event that
stream must open with, the lead-in between that event and the relay, the placement
bookkeeping of each opening, and which nodes a loss implicates. Must never: relay
tokens past the lead-in, pick a status code itself (pdserve/router/errors.py does), or change
the registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc
from pdserve.router.errors import NodeFailed, NoNodeAvailable, Overloaded, RouterError, from_node_error
from pdserve.router.cluster.liveness import NodeGone, unless_gone
from pdserve.engine.block_pool import BlockHash
from pdserve.router.cluster.placement import Candidate, ColocatedPlacement, DecodePlacement, PrefillPlacement
from pdserve.router.cluster.prefix_affinity import PrefixAffinity
from pdserve.router.dispatch.recovery import NODE_LOST_CODES, LossReason, NodeLost
from pdserve.router.cluster.registry import NodeEntry, NodeKind
from pdserve.router.dispatch.asks import NodeAsks
from pdserve.router.dispatch.state import PromptRoute, RouterState, SampleSpec


@dataclass(frozen=True, slots=True)
class Opening:
    """The event a route's stream must open with, and how long the driver waits for it."""

    event: str | None  # the DecodeEvent field ("ready"); None: the first one the sample's sink takes
    name: str | None  # in messages ("READY"); None: the sink's name for its first event
    timeout_s: float | None  # None: only the client's deadline bounds it


@dataclass(frozen=True, slots=True)
class Load:
    """What one opening asks of its node, as placement counts it."""

    num_tokens: int  # to prefill: prompt + resumed tokens
    num_blocks: int  # to hold: prompt + max_tokens
    prefix: tuple[BlockHash, ...] = ()  # those tokens' leading blocks, where the route keeps prefix affinity
    stamp: int = 0  # the opening's placement stamp (its SampleRequest.placement_stamp)


@dataclass(frozen=True, slots=True)
class Leg:
    """One attempt's stream on one node, from its opening event on."""

    req_id: str
    resumed: list[int]  # the tokens the client had when the attempt started
    call: grpc.aio.UnaryStreamCall
    entry: NodeEntry
    first: node_pb2.DecodeEvent
    # Nodes still feeding the stream's node (a prefill node whose KV may still be on its
    # way after token 1): the stream waits on them too, until its first tokens event.
    feeders: list[NodeEntry] = field(default_factory=list)
    prefix: tuple[BlockHash, ...] = ()  # the opening's `Load.prefix`


class Sink(Protocol):
    """What takes a sample's node answers and turns them into the client's responses: a token
    relay (pdserve/router/requests/relay.py) or a beam search's results (pdserve/router/requests/beam_results.py)."""

    event: str  # the DecodeEvent field it takes
    opening_name: str  # in messages: that event, when a stream opens with it
    streamed_token_ids: list[int]  # what the client already has: a resume re-prefills them
    finished: bool

    def push(self, event: node_pb2.DecodeEvent) -> bool:
        """Take one event; True if the node ended the sample."""

    def take_prefill(self, prefill: node_pb2.PrefillResponse) -> bool:
        """Take a prefill node's answer; True if it ended the sample."""


class SampleView(Protocol):
    """What a route may use of the sample it serves (the driver is one)."""

    spec: SampleSpec
    state: RouterState
    sink: Sink
    asks: NodeAsks

    def usable(self, kind: NodeKind) -> list[NodeEntry]: ...

    def none_left(self, kind: NodeKind) -> NoNodeAvailable: ...

    def bounded(self, limit_s: float) -> float: ...


class Route(ABC):
    """What differs between the architectures; the driver's loops are the same for both."""

    kind: NodeKind  # the nodes a sample's stream is opened on
    name: PromptRoute  # where the prompt is computed
    opening: Opening

    def takes(self, entry: NodeEntry) -> bool:
        """Can this node of the route's kind open its streams? (All can, but for the local route.)"""
        return True

    def fed(self, sample: SampleView, entry: NodeEntry) -> bool:
        """Can a stream opened on `entry` get its prompt computed, with the nodes `sample` may
        still use? (Always, but on the disaggregated route.)"""
        return True

    def prefix(self, token_ids: Sequence[int], live: Sequence[NodeEntry]) -> tuple[BlockHash, ...]:
        """The leading-block hashes `rank` and `claim` weigh, given the `live` nodes the route
        may ask (none: the route keeps no affinity)."""
        return ()

    @abstractmethod
    def rank(self, candidates: Sequence[Candidate], load: Load) -> list[Candidate]:
        """The nodes to ask for `load`, best first; nodes that just refused are left out."""

    @abstractmethod
    def mark_exhausted(self, candidate: Candidate) -> None:
        """`candidate` refused for lack of room."""

    @abstractmethod
    def claim(self, candidate: Candidate, load: Load) -> None:
        """Count `load` against `candidate` before asking it."""

    @abstractmethod
    def withdraw(self, candidate: Candidate, load: Load) -> None:
        """Take back what `claim` counted: the stream never opened."""

    def opened(self, candidate: Candidate, load: Load) -> None:
        """The stream's opening event arrived (nothing to count by default)."""

    @abstractmethod
    def open(self, channel: grpc.aio.Channel, request: node_pb2.SampleRequest,
             timeout_s: float | None) -> grpc.aio.UnaryStreamCall:
        """Start the node call whose events the driver relays."""

    async def lead_in(self, sample: SampleView, leg: Leg) -> bool:
        """What runs between the opening event and the relay; True if it ended the sample."""
        return False

    @abstractmethod
    def stream_lost(self, leg: Leg, error: RouterError, decoding: bool) -> NodeLost:
        """The loss to raise when `leg`'s stream fails the way a lost node's does."""

    def ended(self, leg: Leg, computed_token_ids: Sequence[int]) -> None:
        """The sample ended on `leg`'s node, whose KV holds `computed_token_ids` (nothing to
        remember by default)."""


class ColocatedRoute(Route):
    kind = NodeKind.COLOCATED
    name = PromptRoute.COLOCATED
    # The first event follows the whole prefill (a beam search's, the whole search), however
    # long the node's queue: only the client's deadline bounds it.
    opening = Opening(None, None, None)

    def __init__(self, placement: ColocatedPlacement) -> None:
        self._placement = placement

    def prefix(self, token_ids: Sequence[int], live: Sequence[NodeEntry]) -> tuple[BlockHash, ...]:
        affinity = self._placement.affinity
        return affinity.hashes(token_ids) if affinity is not None else ()

    def rank(self, candidates: Sequence[Candidate], load: Load) -> list[Candidate]:
        return self._placement.rank(candidates, load.prefix)

    def mark_exhausted(self, candidate: Candidate) -> None:
        self._placement.mark_exhausted(candidate)

    def claim(self, candidate: Candidate, load: Load) -> None:
        self._placement.assign(candidate, load.stamp, load.num_tokens, load.num_blocks, load.prefix)

    def withdraw(self, candidate: Candidate, load: Load) -> None:
        self._placement.withdraw(candidate, load.stamp, load.num_tokens, load.num_blocks)

    def opened(self, candidate: Candidate, load: Load) -> None:
        self._placement.prefilled(candidate, load.stamp, load.num_tokens)  # token 1 is out: the prompt left its queue

    def open(self, channel: grpc.aio.Channel, request: node_pb2.SampleRequest,
             timeout_s: float | None) -> grpc.aio.UnaryStreamCall:
        return node_pb2_grpc.ColocatedNodeStub(channel).Generate(request, timeout=timeout_s)

    def stream_lost(self, leg: Leg, error: RouterError, decoding: bool) -> NodeLost:
        return NodeLost(error, probe=[leg.entry], decoding=decoding, exclude=[leg.entry])

    def ended(self, leg: Leg, computed_token_ids: Sequence[int]) -> None:
        if self._placement.affinity is not None:
            self._placement.affinity.remember_generated(leg.entry.node_id, leg.prefix, computed_token_ids)


class LocalPrefillRoute(ColocatedRoute):
    """Decode nodes started with `--local-prefill`, asked as colocated nodes (`Generate`): the
    prompt is computed where its tokens will be decoded, no KV moves. Their blocks are counted
    in the decode pool's placement, which the disaggregated route reserves from too."""

    kind = NodeKind.DECODE
    name = PromptRoute.DECODE_NODE

    def takes(self, entry: NodeEntry) -> bool:
        return entry.local_prefill


class DisaggregatedRoute(Route):
    kind = NodeKind.DECODE
    name = PromptRoute.PREFILL_POOL

    def __init__(self, decode: DecodePlacement, prefill: PrefillPlacement, ready_timeout_s: float,
                 prefill_timeout_s: float, local_affinity: PrefixAffinity | None = None) -> None:
        self._decode = decode
        self._prefill = prefill
        self._prefill_timeout_s = prefill_timeout_s
        self.opening = Opening("ready", "READY", ready_timeout_s)
        # The local route's, when decode nodes also prefill: a decode node caches the prompt
        # whose KV it imports, so a later prompt sharing it computes only the rest there.
        self._local_affinity = local_affinity

    def prefix(self, token_ids: Sequence[int], live: Sequence[NodeEntry]) -> tuple[BlockHash, ...]:
        if self._local_affinity is None or not any(e.local_prefill for e in live):
            return ()  # no decode node here computes prompts: nothing to remember
        return self._local_affinity.hashes(token_ids)

    def fed(self, sample: SampleView, entry: NodeEntry) -> bool:
        # A decode node with --serve-prefill is in the prefill pool, but never feeds itself.
        return any(p.node_id != entry.node_id for p in sample.usable(NodeKind.PREFILL))

    def rank(self, candidates: Sequence[Candidate], load: Load) -> list[Candidate]:
        return self._decode.rank(candidates)

    def mark_exhausted(self, candidate: Candidate) -> None:
        self._decode.mark_exhausted(candidate)

    def claim(self, candidate: Candidate, load: Load) -> None:
        self._decode.reserve(candidate, load.stamp, load.num_blocks)
        if self._local_affinity is not None:
            self._local_affinity.remember(candidate.node_id, load.prefix)

    def withdraw(self, candidate: Candidate, load: Load) -> None:
        self._decode.reserve(candidate, load.stamp, -load.num_blocks)

    def open(self, channel: grpc.aio.Channel, request: node_pb2.SampleRequest,
             timeout_s: float | None) -> grpc.aio.UnaryStreamCall:
        return node_pb2_grpc.DecodeNodeStub(channel).Decode(request, timeout=timeout_s)

    def stream_lost(self, leg: Leg, error: RouterError, decoding: bool) -> NodeLost:
        # A decode node that still answers may serve the resume: only its probe excludes it.
        return NodeLost(error, probe=[leg.entry], decoding=decoding)

    def ended(self, leg: Leg, computed_token_ids: Sequence[int]) -> None:
        if self._local_affinity is not None and leg.entry.local_prefill:  # only those compute prompts
            self._local_affinity.remember_generated(leg.entry.node_id, leg.prefix, computed_token_ids)

    async def lead_in(self, sample: SampleView, leg: Leg) -> bool:
        """The prefill leg: the prompt into the decode node's blocks, its answer to the sink at
        once (the prefill node answers when it samples token 1; the rest of its KV may still be moving)."""
        return sample.sink.take_prefill(await self._run_prefill(sample, leg))

    async def _run_prefill(self, sample: SampleView, leg: Leg) -> node_pb2.PrefillResponse:
        """The next token from some prefill node; a full queue sends the same reservation to the next one."""
        full: dict[str, str] = {}  # node id -> address: refused RESOURCE_EXHAUSTED, touched nothing
        tokens = [*sample.spec.request.prompt_token_ids, *leg.resumed]
        while True:
            # Never the decode node itself (a decode node with --serve-prefill is in both pools):
            # the local route computes a prompt there, without moving its KV.
            live = [e for e in sample.usable(NodeKind.PREFILL)
                    if e.node_id not in full and e.node_id != leg.entry.node_id]
            if not live and full:
                raise Overloaded(f"every prefill node's queue is full: {', '.join(full.values())}")
            if not live:
                raise sample.none_left(NodeKind.PREFILL)
            stamp = sample.state.stamps.next()
            candidate = self._prefill.choose([e.candidate() for e in live], tokens, stamp)
            entry = next(e for e in live if e.node_id == candidate.node_id)
            try:
                response = await self._call_prefill(sample, leg, entry, candidate, stamp, len(tokens))
                leg.feeders.append(entry)
                return response
            except NodeGone as gone:
                # The prefill node froze, or the decode node it fills did: either way, a new attempt.
                raise NodeLost(NodeFailed(str(gone)), probe=[], decoding=False, exclude=[gone.entry],
                               reason=LossReason.NODE_GONE) from gone
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full[entry.node_id] = entry.address
                    continue
                failure = from_node_error("prefill", entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                # The decode node may be the one that died (the prefill node could not push to it).
                raise NodeLost(failure, probe=[entry, leg.entry], decoding=False) from exc

    async def _call_prefill(self, sample: SampleView, leg: Leg, entry: NodeEntry, candidate: Candidate,
                            stamp: int, num_tokens: int) -> node_pb2.PrefillResponse:
        stub = node_pb2_grpc.PrefillNodeStub(sample.state.registry.channel(entry))
        request = sample.asks.prefill_request(leg.req_id, leg.resumed, leg.first.ready, leg.entry.address, stamp)
        call = stub.Prefill(request, timeout=sample.bounded(self._prefill_timeout_s))
        try:
            return await unless_gone(call, [entry, leg.entry])
        finally:
            call.cancel()  # no-op once answered
            self._prefill.finished(candidate, stamp, num_tokens)

