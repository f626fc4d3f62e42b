"""One sample's life on colocated nodes (each runs both phases), as the router drives it.

    rank colocated nodes ──Generate──▶ tokens 1..n ──▶ client   (RESOURCE_EXHAUSTED or lost: next node)
    node lost mid-stream (a call failed with a NODE_LOST_CODES code, or its stream ended
    unfinished): a new attempt ("<id>~<n>") on another node ──Generate(prompt,
        resumed_token_ids = the tokens the client has)──▶ which prefills prompt + those
        tokens and goes on from there; attempts are bounded by the sample's
        `RecoveryBudget` and the client's deadline, which every call carries. A lost
        node is never asked again for this sample, and is probed (`NodeRegistry.probe`):
        one that does not answer is suspect for every request until its next stats
    finally: cancel the call unless it ended                     (the node frees its blocks)

The counterpart of router/sample.py's `SampleRun` for the colocated baseline: the same
`TokenRelay` (router/relay.py) owns everything the client sees, so both architectures
answer the same client in the same way. Owns the order of node calls, the placement
bookkeeping of each call and the mapping of node call failures to router errors.

Must never: pick a status code itself (router/errors.py does), ask a node that was lost
during this sample again, or leave a node call open when the sample ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.proto.convert import params_to_proto
from pdserve.router.errors import (NodeFailed, NoNodeAvailable, Overloaded, RouterError,
                                   from_node_error)
from pdserve.router.placement import Candidate, ColocatedPlacement
from pdserve.router.registry import NodeEntry, NodeKind
from pdserve.router.relay import TokenRelay
from pdserve.router.sample import NODE_LOST_CODES, RecoveryBudget, RouterState, SampleSpec, attempt_ids

log = logging.getLogger(__name__)

ROLE = "colocated"


class ColocatedRun:
    def __init__(self, state: RouterState, placement: ColocatedPlacement, spec: SampleSpec,
                 emit: Callable[[pdserve_pb2.GenerateResponse], None]) -> None:
        self._state = state
        self._placement = placement
        self._spec = spec
        self._relay = TokenRelay(spec.request, spec.index, state.model, spec.received_at, state.clock, emit)
        self._budget = RecoveryBudget(state.config.max_resumes, state.config.max_prefill_retries)
        self._lost: dict[str, RouterError] = {}  # by node id: nodes lost during this sample, and how

    async def run(self) -> None:
        for req_id in attempt_ids(self._spec.node_req_id):
            try:
                await self._attempt(req_id)
                return
            except _NodeLost as lost:
                await self._recover(lost)

    async def _attempt(self, req_id: str) -> None:
        call, first, entry = await self._start(req_id)
        try:
            await self._relay_stream(call, first, entry)
        finally:
            call.cancel()  # no-op once the stream has ended

    # -- recovery -----------------------------------------------------------------------

    async def _recover(self, lost: _NodeLost) -> None:
        """Allow another attempt (a resume once tokens were streamed, else a retry) or raise."""
        await self._probe(lost.entry)
        decoding = bool(self._relay.streamed_token_ids)
        what = self._budget.allow(decoding, lost.error, self._remaining(), lost)
        log.warning("sample %s: %s on another colocated node after %d streamed tokens: %s", self._spec.node_req_id,
                    what, len(self._relay.streamed_token_ids), lost.error)

    def _lose(self, entry: NodeEntry, error: RouterError) -> _NodeLost:
        """`entry` is never asked again for this sample; `_probe` decides for the others."""
        self._lost[entry.node_id] = error
        return _NodeLost(error, entry)

    async def _probe(self, entry: NodeEntry) -> None:
        # A lost node that does not answer GetStats either is suspect for every request
        # (skipped until its next stats), not only for this sample.
        timeout = self._state.config.failure_probe_timeout_s
        remaining = self._remaining()
        await self._state.registry.probe(entry, timeout if remaining is None else min(timeout, remaining))

    # -- starting on a node -------------------------------------------------------------

    async def _start(self, req_id: str) -> tuple[grpc.aio.UnaryStreamCall, node_pb2.DecodeEvent, NodeEntry]:
        """The best ranked node that answers with its first event; a refusal or a lost node
        before that moves on to the next one."""
        state = self._state
        live = [e for e in state.registry.live(NodeKind.COLOCATED) if e.node_id not in self._lost]
        if not live:
            raise self._none_left()
        refused: list[str] = []
        for candidate in self._placement.rank([e.candidate() for e in live]):
            entry = state.registry.get(candidate.node_id)
            if entry is None:
                continue
            try:
                call, first = await self._ask(entry, candidate, req_id)
                return call, first, entry
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._placement.mark_exhausted(candidate)
                    refused.append(entry.address)
                    continue
                failure = from_node_error(ROLE, entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                self._lose(entry, failure)
                await self._probe(entry)
            except _StreamEnded as exc:
                self._lose(entry, NodeFailed(str(exc)))
                await self._probe(entry)
        if all(e.node_id in self._lost for e in live):
            raise self._none_left()
        # The rest refused, now or moments ago (placement skips those until their next stats).
        nodes = ", ".join(refused) or "every colocated node refused moments ago"
        raise Overloaded(f"no colocated node can take the request ({self._blocks_needed()} KV blocks): {nodes}")

    def _none_left(self) -> NoNodeAvailable:
        detail = f": {'; '.join(map(str, self._lost.values()))}" if self._lost else ""
        return NoNodeAvailable(f"no colocated node is available{detail}")

    async def _ask(self, entry: NodeEntry, candidate: Candidate,
                   req_id: str) -> tuple[grpc.aio.UnaryStreamCall, node_pb2.DecodeEvent]:
        """Call Generate and wait for its first event (a refusal comes at once, as an error)."""
        tokens, blocks = self._num_tokens_to_prefill(), self._blocks_needed()
        self._placement.assign(candidate, tokens, blocks)
        stub = node_pb2_grpc.ColocatedNodeStub(self._state.registry.channel(entry))
        call = stub.Generate(self._request(req_id), timeout=self._remaining())
        try:
            first = await call.read()
            if first is grpc.aio.EOF:
                raise _StreamEnded(f"colocated node {entry.address} ended the stream before its first token")
        except BaseException:
            call.cancel()
            self._placement.withdraw(candidate, tokens, blocks)
            raise
        self._placement.prefilled(candidate, tokens)
        return call, first

    def _request(self, req_id: str) -> node_pb2.DecodeRequest:
        request = self._spec.request
        params = params_to_proto(request.params)
        params.n = 1  # a node runs one sample; sample_index says which
        return node_pb2.DecodeRequest(
            request_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=params,
            seed=request.params.seed,
            sample_index=self._spec.index,
            resumed_token_ids=self._relay.streamed_token_ids,
        )

    # -- the stream ---------------------------------------------------------------------

    async def _relay_stream(self, call: grpc.aio.UnaryStreamCall, event: node_pb2.DecodeEvent,
                            entry: NodeEntry) -> None:
        """Relay until the sample ends; raises `_NodeLost` when the node goes away first."""
        while True:
            if event.WhichOneof("event") != "tokens":
                raise NodeFailed(f"colocated node {entry.address} sent {event.WhichOneof('event')}, not tokens")
            if self._relay.push_decoded(event.tokens):
                await self._await_end(call)
                return
            if self._relay.finished:
                return  # a stop string: the caller cancels the call
            try:
                event = await call.read()
            except grpc.aio.AioRpcError as exc:
                failure = from_node_error(ROLE, entry.address, exc)
                if exc.code() not in NODE_LOST_CODES:
                    raise failure from exc
                raise self._lose(entry, failure) from exc
            if event is grpc.aio.EOF:
                raise self._lose(entry, NodeFailed(f"colocated node {entry.address} ended the stream unfinished"))

    async def _await_end(self, call: grpc.aio.UnaryStreamCall) -> None:
        # The node's last event is in; let its stream close by itself rather than cancel it.
        try:
            await asyncio.wait_for(call.read(), self._state.config.stream_end_grace_s)
        except (TimeoutError, grpc.aio.AioRpcError):
            pass

    # -- helpers ------------------------------------------------------------------------

    def _num_tokens_to_prefill(self) -> int:
        return len(self._spec.request.prompt_token_ids) + len(self._relay.streamed_token_ids)

    def _blocks_needed(self) -> int:
        return self._spec.request.max_kv_blocks(self._state.config.block_size, self._state.model.max_model_len)

    def _remaining(self) -> float | None:
        if self._spec.deadline is None:
            return None
        return max(0.0, self._spec.deadline - self._state.clock())


class _StreamEnded(Exception):
    """A node closed its stream before its first event: it went away (the next node is asked)."""


class _NodeLost(Exception):
    """The attempt's node went away mid-stream; `error` is what the client gets if no recovery is left."""

    def __init__(self, error: RouterError, entry: NodeEntry) -> None:
        super().__init__(str(error))
        self.error = error
        self.entry = entry
