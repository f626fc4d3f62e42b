"""One sample's life across the cluster, as the router drives it.

One attempt (node request id: the sample's own; "<id>~<n>" for the n-th after a failure):

    pick D ──Decode(prompt, resumed)──▶ READY{descriptor, block ids}    (RESOURCE_EXHAUSTED or dead: next D)
    pick P ──Prefill(descriptor, block ids, resumed)──▶ next token       (RESOURCE_EXHAUSTED: next P, same blocks)
    relay D's tokens ──▶ client                                           (until D's finish, or a stop string)
    finally: cancel the D stream unless it ended                          (D frees its blocks at once)

A node lost mid-attempt (a call failed UNAVAILABLE / INTERNAL / UNKNOWN / CANCELLED, or
the decode stream ended unfinished) ends the attempt: the nodes involved are probed
(`NodeRegistry.probe`; one that does not answer is suspect for everyone and excluded
for this sample), and a new attempt runs with `resumed` = the tokens the client already
has (`relay.streamed_token_ids`): the new prefill computes prompt + those and samples
the next one, the new decode node goes on from there. The same `TokenRelay` (same
detokenizer, same stop-string state) carries on, so the client sees no gap and no
duplicate. Attempts are bounded by `RecoveryBudget` (resumes while decoding, retries
before the next token) and by the client's deadline, which every node call carries.

Why a failed prefill starts a new attempt instead of reusing D's reservation: the
failed prefill node may still write into those blocks, or send D an "aborted" done
that frees them while another prefill node writes; a fresh reservation under a new id
is never ambiguous (D frees the old one and drops what still arrives for it). Only a
RESOURCE_EXHAUSTED prefill (refused before it touched anything) reuses the reservation.

Owns the order of node calls and the mapping of node call failures to router errors;
what the client sees (text, stop strings, responses, usage, timings) is the sample's
`TokenRelay` (router/relay.py). It never multiplexes samples and never changes the
registry beyond marking a node suspect.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.proto.convert import params_to_proto
from pdserve.router.config import RouterConfig
from pdserve.router.errors import (DeadlineExceeded, NodeFailed, NoNodeAvailable, Overloaded, RouterError,
                                   from_node_error)
from pdserve.router.model import RouterModel
from pdserve.router.placement import Candidate, DecodePlacement, PrefillPlacement
from pdserve.router.registry import NodeEntry, NodeKind, NodeRegistry
from pdserve.router.relay import TokenRelay
from pdserve.router.validation import ValidatedRequest

log = logging.getLogger(__name__)

# Codes of a call whose node may be gone (killed, unreachable, its core dead): another
# node may succeed. Every other code is an answer about the request itself.
NODE_LOST_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                             grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class RouterState:
    """What every sample of every request shares."""

    config: RouterConfig
    model: RouterModel
    registry: NodeRegistry
    decode_placement: DecodePlacement
    prefill_placement: PrefillPlacement
    clock: Callable[[], float] = field(default=time.monotonic)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    request: ValidatedRequest
    index: int
    node_req_id: str  # unique per sample and per router, whatever id the client sent
    received_at: float
    deadline: float | None  # on the state's clock; None: the client set none



class NodeLost(Exception):
    """An attempt ended because a node call failed the way a lost node's does."""

    def __init__(self, error: RouterError, involved: Sequence[NodeEntry], decoding: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.involved = list(involved)  # nodes to probe: any of them may be the one that died
        self.decoding = decoding  # lost while decoding (a resume) or before the attempt's first token


@dataclass(slots=True)
class RecoveryBudget:
    """How many more attempts a sample may start after losing a node."""

    max_resumes: int
    max_retries: int
    resumes: int = 0
    retries: int = 0

    def spend(self, decoding: bool) -> bool:
        """Count one recovery; False once the kind's budget is spent."""
        if decoding:
            self.resumes += 1
            return self.resumes <= self.max_resumes
        self.retries += 1
        return self.retries <= self.max_retries

    def allow(self, decoding: bool, error: RouterError, remaining_s: float | None, cause: BaseException) -> str:
        """Count one recovery and name it ("resume" or "retry"); raise `error`'s kind once
        the budget is spent, or DeadlineExceeded once the deadline has passed."""
        what = "resume" if decoding else "retry"
        if not self.spend(decoding):
            raise type(error)(f"{error} (no {what} left for this sample)") from cause
        if remaining_s is not None and remaining_s <= 0:
            raise DeadlineExceeded(f"the deadline passed while recovering from: {error}") from cause
        return what


def attempt_ids(node_req_id: str) -> Iterator[str]:
    """The node request id of each attempt: the sample's own, then "<id>~<n>". Ids never
    repeat on a node (a decode node refuses a retired id for a while)."""
    yield node_req_id
    for n in itertools.count(1):
        yield f"{node_req_id}~{n}"


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    call: grpc.aio.UnaryStreamCall
    ready: node_pb2.Ready
    entry: NodeEntry


class SampleRun:
    def __init__(self, state: RouterState, spec: SampleSpec, emit: Callable[[pdserve_pb2.GenerateResponse], None]):
        self._state = state
        self._spec = spec
        self._relay = TokenRelay(spec.request, spec.index, state.model, spec.received_at, state.clock, emit)
        self._budget = RecoveryBudget(state.config.max_resumes, state.config.max_prefill_retries)
        self._excluded: dict[str, NodeEntry] = {}  # by node id: nodes lost during this sample

    async def run(self) -> None:
        for req_id in attempt_ids(self._spec.node_req_id):
            try:
                await self._attempt(req_id)
                return
            except NodeLost as lost:
                await self._recover(lost)

    async def _attempt(self, req_id: str) -> None:
        resumed = list(self._relay.streamed_token_ids)
        leg = await self._reserve_decode(req_id, resumed)
        try:
            prefill = await self._run_prefill(leg, req_id, resumed)
            self._relay.prefill.add(prefill)
            logprobs = prefill.logprobs if prefill.HasField("logprobs") else None
            if self._relay.push_sampled_token(prefill.first_token_id, logprobs):
                return  # this token ended it: the finally cancels D's reservation
            await self._relay_decode(leg)
        finally:
            leg.call.cancel()  # no-op once the stream has ended

    # -- recovery -----------------------------------------------------------------------

    async def _recover(self, lost: NodeLost) -> None:
        """Probe the nodes involved, then allow another attempt or raise the loss's error."""
        registry, timeout = self._state.registry, self._bounded(self._state.config.failure_probe_timeout_s)
        answered = await asyncio.gather(*(registry.probe(e, timeout) for e in lost.involved))
        for entry, alive in zip(lost.involved, answered):
            if not alive:
                self._excluded[entry.node_id] = entry
        what = self._budget.allow(lost.decoding, lost.error, self._remaining(), lost)
        log.warning("sample %s: %s after %d streamed tokens: %s", self._spec.node_req_id, what,
                    len(self._relay.streamed_token_ids), lost.error)

    def _usable(self, kind: NodeKind) -> list[NodeEntry]:
        return [e for e in self._state.registry.live(kind) if e.node_id not in self._excluded]

    def _none_left(self, kind: NodeKind, failures: Sequence[str] = ()) -> NoNodeAvailable:
        reasons = list(failures) or [f"{e.address} was lost during this request"
                                     for e in self._excluded.values() if e.kind is kind]
        detail = f": {'; '.join(reasons)}" if reasons else ""
        return NoNodeAvailable(f"no {kind.value} node is available{detail}")

    # -- decode reservation -------------------------------------------------------------

    async def _reserve_decode(self, req_id: str, resumed: list[int]) -> DecodeLeg:
        state = self._state
        live = self._usable(NodeKind.DECODE)
        if not live:
            raise self._none_left(NodeKind.DECODE)
        blocks = self._blocks_needed()
        refused: list[str] = []
        failures: list[str] = []
        for candidate in state.decode_placement.rank([e.candidate() for e in live]):
            entry = state.registry.get(candidate.node_id)
            if entry is None:
                continue
            try:
                call, ready = await self._ask_decode(entry, candidate, blocks, req_id, resumed)
                return DecodeLeg(call, ready, entry)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    state.decode_placement.mark_exhausted(candidate)
                    refused.append(entry.address)
                    continue
                failure = from_node_error("decode", entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                self._lose(entry, str(failure))  # failing before READY: it cannot serve anyone
                failures.append(str(failure))
            except NodeFailed as exc:
                self._lose(entry, str(exc))
                failures.append(str(exc))
        if refused:
            nodes = ", ".join(refused)
            raise Overloaded(f"no decode node can hold the request's KV cache ({blocks} blocks): {nodes}")
        raise self._none_left(NodeKind.DECODE, failures)

    def _lose(self, entry: NodeEntry, reason: str) -> None:
        self._state.registry.mark_suspect(entry, reason)
        self._excluded[entry.node_id] = entry

    async def _ask_decode(self, entry: NodeEntry, candidate: Candidate, blocks: int, req_id: str,
                          resumed: list[int]) -> tuple[grpc.aio.UnaryStreamCall, node_pb2.Ready]:
        placement = self._state.decode_placement
        placement.reserve(candidate, blocks)
        stub = node_pb2_grpc.DecodeNodeStub(self._state.registry.channel(entry))
        call = stub.Decode(self._decode_request(req_id, resumed), timeout=self._remaining())
        try:
            return call, await self._await_ready(call, entry.address)
        except BaseException:
            call.cancel()
            placement.reserve(candidate, -blocks)
            raise

    async def _await_ready(self, call: grpc.aio.UnaryStreamCall, address: str) -> node_pb2.Ready:
        timeout = self._bounded(self._state.config.ready_timeout_s)
        try:
            event = await asyncio.wait_for(call.read(), timeout)
        except TimeoutError as exc:
            remaining = self._remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("the deadline passed while a decode node reserved blocks") from exc
            raise NodeFailed(f"decode node {address} did not reserve blocks within {timeout:.1f}s") from exc
        if event is grpc.aio.EOF:
            raise NodeFailed(f"decode node {address} ended the stream before READY")
        if event.WhichOneof("event") != "ready":
            raise NodeFailed(f"decode node {address} sent {event.WhichOneof('event')} before READY")
        return event.ready

    def _decode_request(self, req_id: str, resumed: list[int]) -> node_pb2.DecodeRequest:
        request = self._spec.request
        return node_pb2.DecodeRequest(
            request_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self._node_params(),
            seed=request.params.seed,
            sample_index=self._spec.index,
            resumed_token_ids=resumed,
        )

    # -- prefill ------------------------------------------------------------------------

    async def _run_prefill(self, leg: DecodeLeg, req_id: str, resumed: list[int]) -> node_pb2.PrefillResponse:
        """The next token from some prefill node; a full queue sends the same reservation to the next one."""
        full: dict[str, str] = {}  # node id -> address: refused RESOURCE_EXHAUSTED, touched nothing
        while True:
            live = [e for e in self._usable(NodeKind.PREFILL) if e.node_id not in full]
            if not live and full:
                raise Overloaded(f"every prefill node's queue is full: {', '.join(full.values())}")
            if not live:
                raise self._none_left(NodeKind.PREFILL)
            tokens = [*self._spec.request.prompt_token_ids, *resumed]
            candidate = self._state.prefill_placement.choose([e.candidate() for e in live], tokens)
            entry = next(e for e in live if e.node_id == candidate.node_id)
            try:
                return await self._call_prefill(entry, candidate, len(tokens), leg.ready, req_id, resumed)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    full[entry.node_id] = entry.address
                    continue
                failure = from_node_error("prefill", entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                # The decode node may be the one that died (the prefill node could not push to it).
                raise NodeLost(failure, [entry, leg.entry], decoding=False) from exc

    async def _call_prefill(self, entry: NodeEntry, candidate: Candidate, num_tokens: int, ready: node_pb2.Ready,
                            req_id: str, resumed: list[int]) -> node_pb2.PrefillResponse:
        state = self._state
        stub = node_pb2_grpc.PrefillNodeStub(state.registry.channel(entry))
        call = stub.Prefill(self._prefill_request(ready, req_id, resumed),
                            timeout=self._bounded(state.config.prefill_timeout_s))
        try:
            return await call
        finally:
            call.cancel()  # no-op once answered
            state.prefill_placement.finished(candidate, num_tokens)

    def _prefill_request(self, ready: node_pb2.Ready, req_id: str, resumed: list[int]) -> node_pb2.PrefillRequest:
        request = self._spec.request
        return node_pb2.PrefillRequest(
            request_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self._node_params(),
            seed=request.params.seed,
            sample_index=self._spec.index,
            decode_kv_descriptor=ready.kv_descriptor,
            decode_block_ids=ready.block_ids,
            resumed_token_ids=resumed,
        )

    # -- decode stream ------------------------------------------------------------------

    async def _relay_decode(self, leg: DecodeLeg) -> None:
        address = leg.entry.address
        while True:
            try:
                event = await leg.call.read()
            except grpc.aio.AioRpcError as exc:
                failure = from_node_error("decode", address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                raise NodeLost(failure, [leg.entry], decoding=True) from exc
            if event is grpc.aio.EOF:
                raise NodeLost(NodeFailed(f"decode node {address} ended the stream unfinished"), [leg.entry],
                               decoding=True)
            if event.WhichOneof("event") != "tokens":
                raise NodeFailed(f"decode node {address} sent a second READY")
            if self._relay.push_decoded(event.tokens):
                await self._await_end(leg.call)
                return
            if self._relay.finished:
                return  # a stop string: the finally cancels D

    async def _await_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        # The node's last event is in; let its stream close by itself rather than cancel it.
        try:
            await asyncio.wait_for(call.read(), self._state.config.stream_end_grace_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass

    # -- helpers ------------------------------------------------------------------------

    def _node_params(self) -> pdserve_pb2.SamplingParams:
        params = params_to_proto(self._spec.request.params)
        params.n = 1  # a node runs one sample; sample_index says which
        return params

    def _blocks_needed(self) -> int:
        return self._spec.request.max_kv_blocks(self._state.config.block_size, self._state.model.max_model_len)

    def _remaining(self) -> float | None:
        if self._spec.deadline is None:
            return None
        return max(0.0, self._spec.deadline - self._state.clock())

    def _bounded(self, limit_s: float) -> float:
        remaining = self._remaining()
        return limit_s if remaining is None else min(limit_s, remaining)
