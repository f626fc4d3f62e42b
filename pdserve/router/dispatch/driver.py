"""One sample's life across the cluster, as the router drives it, on either architecture.

A sample is a sampled sequence or a whole beam search: the same loop runs both, with the
sample's sink (pdserve/router/requests/relay.py's token relay, or pdserve/router/requests/beam_results.py's
collector) taking what its nodes send, and its `NodeAsks` (pdserve/router/dispatch/asks.py) saying what
it asks them. A sample runs as attempts (node request id: the sample's own; "<id>~<n>" for the n-th
after a loss), each along the sample's route (pdserve/router/dispatch/routes.py: disaggregated pools or
colocated nodes):

    rank the route's nodes ──open(prompt, resumed)──▶ opening event
                                       (RESOURCE_EXHAUSTED: next node; lost: excluded, probed, next node)
    the route's lead-in                (disaggregated: the prefill leg)
    the stream's events ──▶ the sink ──▶ client  (until the node's finish, or a stop string)
    finally: cancel the stream unless it ended  (the node frees its blocks at once)

When no ranked node opens the stream, the sample ends `Overloaded` (RESOURCE_EXHAUSTED)
if any usable node refused, now or moments ago (placement skips it until its next
stats), and `NoNodeAvailable` (UNAVAILABLE, naming why each was lost) if every one was lost.

A node lost mid-attempt (a call failed UNAVAILABLE / INTERNAL / UNKNOWN / CANCELLED, or
the stream ended unfinished) ends the attempt with `NodeLost`: the nodes it implicates
get a GetStats probe (`NodeRegistry.probe`; one that does not answer is suspect for
everyone and excluded for this sample), the ones the route excludes outright are never
asked again for this sample, and a new attempt runs with `resumed` = the tokens the
client already has (`sink.streamed_token_ids`; a beam search streams none, so it starts over): the new node prefills prompt + those
and goes on from there. The same `TokenRelay` (same detokenizer, same stop-string
state) carries on, so the client sees no gap and no duplicate. Attempts are bounded by
`RecoveryBudget` (resumes while decoding, retries before the next token) and by the
client's deadline, which every node call carries. A new attempt keeps the sample's route
while the route can serve it with the nodes left (`Route.fed`); a disaggregated sample whose pools
can no longer feed any decode node it may use (decode nodes that serve prefill, one left) moves to
its fallback, the local route, for good.

Owns the order of node calls and the mapping of node call failures to router errors;
what the client sees (text, stop strings, responses, usage, timings) is the sample's
sink's. Must never: pick a status code itself (pdserve/router/errors.py
does), multiplex samples, change the registry beyond a probe, ask a node excluded for
this sample again, or leave a node call open when the sample ends.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.proto import node_pb2
from pdserve.router.errors import DeadlineExceeded, NodeFailed, NoNodeAvailable, Overloaded, from_node_error
from pdserve.router.cluster.liveness import GoneWatch, NodeGone, unless_gone
from pdserve.router.cluster.placement import Candidate
from pdserve.router.dispatch.recovery import NODE_LOST_CODES, LossReason, NodeLost, RecoveryBudget, attempt_ids
from pdserve.router.cluster.registry import NodeEntry, NodeKind
from pdserve.router.dispatch.asks import NodeAsks
from pdserve.router.dispatch.routes import Leg, Load, Route, Sink
from pdserve.router.dispatch.state import RouterState, SampleSpec

log = logging.getLogger(__name__)


class SampleDriver:
    """Drives one sample along its route until it ends; raises a `RouterError` if it cannot."""

    def __init__(self, state: RouterState, route: Route, spec: SampleSpec, sink: Sink, asks: NodeAsks,
                 fallback: Route | None = None) -> None:
        self.state = state
        self.spec = spec
        self.sink = sink
        self.asks = asks
        self._route = route
        # Where the sample goes once its route cannot serve it with the nodes it may still use.
        self._fallback = fallback
        config = state.config
        self._budget = RecoveryBudget(config.max_resumes, config.max_prefill_retries, config.max_node_failures_per_request)
        self._excluded: dict[str, tuple[NodeEntry, str]] = {}  # by node id: lost during this sample, and why

    async def run(self) -> None:
        for req_id in attempt_ids(self.spec.node_req_id):
            try:
                await self._attempt(req_id)
                return
            except NodeLost as lost:
                await self._recover(lost)

    async def _attempt(self, req_id: str) -> None:
        leg = await self._open(req_id, list(self.sink.streamed_token_ids))
        try:
            if await self._route.lead_in(self, leg):
                return  # the lead-in's token ended the sample: the finally cancels the stream
            await self._relay_stream(leg)
        finally:
            leg.call.cancel()  # no-op once the stream has ended

    # -- recovery -----------------------------------------------------------------------

    async def _recover(self, lost: NodeLost) -> None:
        """Exclude and probe the nodes the loss implicates, then allow another attempt or raise."""
        for entry in lost.exclude:
            self._exclude(entry, str(lost.error))
        timeout = self.bounded(self.state.config.failure_probe_timeout_s)
        answered = await asyncio.gather(*(self.state.registry.probe(e, timeout) for e in lost.probe))
        for entry, alive in zip(lost.probe, answered):
            if not alive:
                self._exclude(entry, f"{entry.address} was lost during this request")
        what = self._budget.allow(lost.decoding, lost.error, self.remaining(), lost)
        self.state.resumes.count(lost.cause())
        log.warning("sample %s: %s on %s nodes after %d streamed tokens: %s", self.spec.node_req_id, what,
                    self._route.kind.value, len(self.sink.streamed_token_ids), lost.error)

    def _exclude(self, entry: NodeEntry, reason: str) -> None:
        self._excluded.setdefault(entry.node_id, (entry, reason))  # the first reason is the telling one

    async def _lost_before_opening(self, entry: NodeEntry, reason: str) -> None:
        # Never asked again for this sample; one that does not answer GetStats either is
        # suspect for every request (skipped until its next stats).
        self._exclude(entry, reason)
        await self.state.registry.probe(entry, self.bounded(self.state.config.failure_probe_timeout_s))

    # -- what a route may use -----------------------------------------------------------

    def usable(self, kind: NodeKind) -> list[NodeEntry]:
        return [e for e in self.state.registry.live(kind) if e.node_id not in self._excluded]

    def none_left(self, kind: NodeKind) -> NoNodeAvailable:
        reasons = [reason for entry, reason in self._excluded.values() if entry.serves(kind)]
        detail = f": {'; '.join(reasons)}" if reasons else ""
        return NoNodeAvailable(f"no {kind.value} node is available{detail}")

    def remaining(self) -> float | None:
        if self.spec.deadline is None:
            return None
        return max(0.0, self.spec.deadline - self.state.clock())

    def bounded(self, limit_s: float) -> float:
        remaining = self.remaining()
        return limit_s if remaining is None else min(limit_s, remaining)

    # -- opening the stream -------------------------------------------------------------

    async def _open(self, req_id: str, resumed: list[int]) -> Leg:
        """The best ranked node that answers with its opening event; a refusal or a lost node
        before that moves on to the next one."""
        route = self._route_for_attempt()
        kind = route.kind
        live = [e for e in self.usable(kind) if route.takes(e)]
        if not live:
            raise self.none_left(kind)
        live = [e for e in live if route.fed(self, e)] or live  # none fed: the lead-in says what is missing
        request, model = self.spec.request, self.state.model
        load = Load(len(request.prompt_token_ids) + len(resumed),
                    self.asks.num_blocks(self.state.config.block_size, model.max_model_len),
                    route.prefix([*request.prompt_token_ids, *resumed], live), self.state.stamps.next())
        refused: list[str] = []
        for candidate in route.rank([e.candidate() for e in live], load):
            entry = self.state.registry.get(candidate.node_id)
            if entry is None:
                continue
            try:
                return await self._ask(entry, candidate, load, req_id, resumed)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    route.mark_exhausted(candidate)
                    refused.append(entry.address)
                    continue
                failure = from_node_error(kind.value, entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                await self._lost_before_opening(entry, str(failure))
            except NodeFailed as exc:  # no opening event: gone, or broke the protocol
                await self._lost_before_opening(entry, str(exc))
        if all(e.node_id in self._excluded for e in live):
            raise self.none_left(kind)
        # The rest refused, now or moments ago (placement skips those until their next stats).
        nodes = ", ".join(refused) or f"every {kind.value} node refused moments ago"
        raise Overloaded(f"no {kind.value} node can take the request ({load.num_blocks} KV blocks): {nodes}")

    def _route_for_attempt(self) -> Route:
        """The sample's route, or from now on its fallback when the route can feed none of the
        nodes the sample may still use and the fallback has one: in a pool of decode nodes that
        serve prefill, the one left after a loss computes the resumed prompt itself."""
        route, fallback = self._route, self._fallback
        if fallback is None or fallback is route:
            return route
        if any(route.fed(self, e) for e in self.usable(route.kind) if route.takes(e)):
            return route
        if any(fallback.takes(e) for e in self.usable(fallback.kind)):
            log.info("sample %s: no node left to compute its prompt on the %s route; on the %s route from here",
                     self.spec.node_req_id, route.name.value, fallback.name.value)
            self._route = fallback
        return self._route

    async def _ask(self, entry: NodeEntry, candidate: Candidate, load: Load, req_id: str, resumed: list[int]) -> Leg:
        """Open the route's call and wait for its opening event (a refusal comes at once, as an error)."""
        route = self._route
        route.claim(candidate, load)
        call = route.open(self.state.registry.channel(entry), self.asks.sample_request(req_id, resumed, load.stamp),
                          self.remaining())
        try:
            first = await self._opening_event(call, entry)
        except BaseException:
            call.cancel()
            route.withdraw(candidate, load)
            raise
        route.opened(candidate, load)
        return Leg(req_id, resumed, call, entry, first, prefix=load.prefix)

    async def _opening_event(self, call: grpc.aio.UnaryStreamCall, entry: NodeEntry) -> node_pb2.DecodeEvent:
        opening, node = self._route.opening, f"{self._route.kind.value} node {entry.address}"
        expected, name = opening.event or self.sink.event, opening.name or self.sink.opening_name
        timeout = None if opening.timeout_s is None else self.bounded(opening.timeout_s)
        try:
            event = await asyncio.wait_for(unless_gone(call.read(), [entry]), timeout)
        except NodeGone as exc:
            raise NodeFailed(str(exc)) from exc
        except TimeoutError as exc:
            remaining = self.remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"the deadline passed while waiting for {name} from {node}") from exc
            raise NodeFailed(f"{node} did not send {name} within {timeout:.1f}s") from exc
        if event is grpc.aio.EOF:
            raise NodeFailed(f"{node} ended the stream before {name}")
        if event.WhichOneof("event") != expected:
            raise NodeFailed(f"{node} sent {event.WhichOneof('event')} before {name}")
        return event

    # -- the stream ---------------------------------------------------------------------

    async def _relay_stream(self, leg: Leg) -> None:
        """Hand the stream's events to the sink until the sample ends; raises `NodeLost` when
        the node goes away first."""
        node, sink = f"{self._route.kind.value} node {leg.entry.address}", self.sink
        # One watch on the stream's nodes for the whole stream, not one per event.
        with GoneWatch([leg.entry, *leg.feeders]) as watch:
            # An opening event the sink takes (a colocated node's) is the first one to hand it.
            event = leg.first if leg.first.WhichOneof("event") == sink.event else await self._next_event(leg, watch)
            while True:
                if event.WhichOneof("event") != sink.event:
                    raise NodeFailed(f"{node} sent {event.WhichOneof('event')}, not {sink.event}")
                if sink.push(event):
                    # Its node cached what it computed: the prompt and every token but the last.
                    self._route.ended(leg, [*self.spec.request.prompt_token_ids, *sink.streamed_token_ids[:-1]])
                    await self._await_end(leg.call)
                    return
                if sink.finished:
                    return  # a stop string: the caller cancels the call
                event = await self._next_event(leg, watch)

    async def _next_event(self, leg: Leg, watch: GoneWatch) -> node_pb2.DecodeEvent:
        # Runs once per streamed token: every message and judgement is built only on a failure.
        try:
            event = await watch.until(leg.call.read())
        except NodeGone as gone:
            # Frozen or replaced (the stream's node, or the prefill node still sending it KV): it
            # answers nothing, so no probe; never asked again for this sample.
            raise NodeLost(NodeFailed(str(gone)), probe=[], decoding=self._decoding, exclude=[gone.entry],
                           reason=LossReason.NODE_GONE) from gone
        except grpc.aio.AioRpcError as exc:
            failure = from_node_error(self._route.kind.value, leg.entry.address, exc)
            if self._kv_never_came(leg, exc):
                # Token 1 left its prefill node before the KV: the transfer failed after it.
                raise NodeLost(failure, probe=list(leg.feeders), decoding=self._decoding,
                               reason=LossReason.KV_LOST) from exc
            if exc.code() not in NODE_LOST_CODES:
                raise failure from exc
            raise self._route.stream_lost(leg, failure, self._decoding) from exc
        if event is grpc.aio.EOF:
            node = f"{self._route.kind.value} node {leg.entry.address}"
            raise self._route.stream_lost(leg, NodeFailed(f"{node} ended the stream unfinished"), self._decoding)
        if leg.feeders and event.WhichOneof("event") == self.sink.event:
            # The KV has landed: the stream no longer depends on its sender.
            watch.forget(leg.feeders)
            leg.feeders.clear()
        return event

    @property
    def _decoding(self) -> bool:
        """Lost once the client has tokens: a resume; before any: a retry."""
        return bool(self.sink.streamed_token_ids)

    def _kv_never_came(self, leg: Leg, exc: grpc.aio.AioRpcError) -> bool:
        """The stream's node gave up waiting for KV (its reservation's lease) while the
        client's own deadline still runs: a lost transfer, not the client's timeout."""
        remaining = self.remaining()
        return (exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and bool(leg.feeders)
                and (remaining is None or remaining > 0))

    async def _await_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        # The node's last event is in; let its stream close by itself rather than cancel it.
        try:
            await asyncio.wait_for(call.read(), self.state.config.stream_end_grace_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass
