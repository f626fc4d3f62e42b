"""The decode node's KV import stage: reserve, receive, hand to the node core to decode.

A stage of the node core (pdserve/node/core/node_core.py); `make_stage` builds it in the engine-core process
(the kind's row, pdserve/node_kinds.py, names it). A request whose KV a prefill node computes
(StreamSubmit with `imports_kv`: the `Decode` call) lives here until its KV is in (its hand-off
states: reservations.py):

    StreamSubmit ─▶ reserve blocks ─▶ Ready{layout id, block ids} | RequestFailed
        (RESOURCE_EXHAUSTED at once: too few free blocks, prompt + max_tokens need more
        blocks than this node has, or the queue bounds — reservations waiting for their
        KV plus preempted requests — are full)
    done message (transport.poll_done) ─▶ admit with token 1 (or end at once if token 1
        already stops it: Tokens{[], finish_reason}); an aborted one ─▶ RequestFailed(UNAVAILABLE);
        the transport's integrity refusal (a push's bytes did not match its sender's checksums,
        pdserve/kv_transfer/integrity.py) ─▶ freed at once, RequestFailed(UNAVAILABLE): the router resumes
        the sample elsewhere; never admitted
    then the node core streams it like any request, Tokens for tokens 2..n
    Abort ─▶ free a reservation (its write permit revoked first); a request already admitted
        is the node core's to abort
    a renewal from its prefill node ─▶ the reservation's lease runs afresh
    a reservation's lease ─▶ RequestFailed(DEADLINE_EXCEEDED) (why: reservations.py)

A beam search (StreamSubmit.beam set) reserves its prompt like any request, under its beams'
params (greedy, the top 2k logprobs). Its prefill node computes the whole prompt and samples it
with those params, so the done message carries the prompt's last position's top logprobs: the
search's first step. On arrival the node core's `BeamSearches` adopts it, forks the beams off
the imported prompt and runs them beside the ordinary requests.

The stage hands the table's `WritePermits` to the transport, so a push lands only in blocks its
request still holds: that is what lets a cancelled reservation free at once. The engine runs the
colocated policy: imported requests reach the scheduler with their prompt's KV present and
token 1 known, so it just decodes them (and, with --local-prefill, computes the node core's own
prompts beside them).

Must never: schedule a request before its done message, or stream token 1 (the prefill node
returns it to the router; a beam search's token 1 is only the first step's).
"""

from __future__ import annotations

import logging
import time

from pdserve.decode_node.reservations import ReservationTable
from pdserve.engine.admission import RequestRejected
from pdserve.engine.beam_search import BeamSearchParams, BeamTop
from pdserve.engine.engine_core import EngineCoreOutput
from pdserve.kv_transfer.integrity import INTEGRITY_REFUSAL
from pdserve.node.core.beam_searches import beam_params, beams_done
from pdserve.node.config import NodeConfig
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.node.core.handoff import HandoffState
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.ranks.kv_ranks import NodeKVDescriptor, RankedTransport
from pdserve.node.messages import Message, Ready, RequestFailed, StreamSubmit
from pdserve.node.core.node_core import NodeCore
from pdserve.node.core.stats import UNBOUNDED, QueueBounds

logger = logging.getLogger(__name__)


class KVImportStage:
    def __init__(self, core: NodeCore, transport: RankedTransport, table: ReservationTable, layout_id: str,
                 bounds: QueueBounds = UNBOUNDED) -> None:
        self.core = core
        self.engine = core.engine
        self.transport = transport
        self.table = table
        self.layout_id = layout_id  # the prefill node asks for the layout itself once (GetKVLayout)
        self.bounds = bounds
        self._waiting_searches: dict[str, BeamSearchParams] = {}  # reserved beam searches, by req_id
        transport.guard_writes(table.permits)

    def handle(self, msg: Message) -> bool:
        if not (isinstance(msg, StreamSubmit) and msg.imports_kv):
            return False
        try:
            # Only the waiting count: a decode node's tokens to compute are one per running request.
            self.bounds.check(self.table.num_reserved + len(self.engine.scheduler.waiting), 0, 0)
            block_ids = self._reserve(msg)
        except NodeError as exc:
            self.core.to_front(RequestFailed(msg.req_id, exc.code, exc.message))
            return True
        self.core.to_front(Ready(msg.req_id, self.layout_id, block_ids))
        return True

    def abort(self, req_id: str) -> bool:
        self._waiting_searches.pop(req_id, None)
        return self.table.cancel(req_id)  # False: not waiting for its KV (running, or over)

    def fail(self, req_id: str, message: str) -> bool:
        return False  # a reservation runs no step: what fails is an admitted request, the core's

    def _reserve(self, msg: StreamSubmit) -> list[int]:
        """The reserved block ids; a beam search's first request is reserved with its beams' params."""
        if msg.beam is None:
            return self.table.reserve(msg.req_id, msg.prompt_token_ids, msg.params, msg.sample_index,
                                      time.monotonic(), msg.resumed_token_ids)
        try:
            params = beam_params(msg.beam, msg)
            request_params = self.core.beams.request_params(msg.req_id, msg.prompt_token_ids, params)
        except RequestRejected as exc:
            raise rejection_error(exc) from exc
        block_ids = self.table.reserve(msg.req_id, msg.prompt_token_ids, request_params, 0, time.monotonic())
        self._waiting_searches[msg.req_id] = params
        return block_ids

    def take(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        return outputs  # imported requests stream as the node core's own

    def poll(self, now: float) -> None:
        for req_id, payload in self.transport.poll_done():
            self._arrive(req_id, payload, now)
        for req_id in self.table.expire(now):
            self._waiting_searches.pop(req_id, None)
            self.core.to_front(RequestFailed(req_id, ErrorCode.DEADLINE_EXCEEDED,
                                             f"the prompt's KV did not arrive: its prefill node was not heard "
                                             f"from for the {self.table.lease_s}s lease"))

    def wants_fast_poll(self) -> bool:
        # Done messages wake the loop (the transport's callback); leases are coarse.
        return False

    def num_held_blocks(self) -> int:
        return self.table.num_reserved_blocks

    def _arrive(self, req_id: str, payload: bytes, now: float) -> None:
        if payload == INTEGRITY_REFUSAL:
            self._refuse(req_id)
            return
        try:
            done = KVDone.from_bytes(payload)
        except ValueError as exc:
            logger.error("request %s: %s", req_id, exc)
            if self.table.cancel(req_id):  # the sender is broken: fail and free (nothing more of it lands)
                self.core.to_front(RequestFailed(req_id, ErrorCode.UNAVAILABLE, f"bad KV done message: {exc}"))
            return
        if done.status is DoneStatus.RENEW:
            self.table.renew(req_id, now)
            return
        state, out = self.table.arrive(req_id, done)
        if state is HandoffState.FAILED:
            self._waiting_searches.pop(req_id, None)
            self.core.to_front(RequestFailed(req_id, ErrorCode.UNAVAILABLE, "the prefill node gave up on this request"))
        elif state is HandoffState.SUCCESS and out is not None:
            search = self._waiting_searches.pop(req_id, None)
            if search is not None:
                self._start_search(out, search, done)
                return
            self.core.stream(out, [])  # token 1 is the router's already; only its finish matters here

    def _refuse(self, req_id: str) -> None:
        """Some of the request's KV is not what its prefill node sent: free it, fail its stream."""
        self._waiting_searches.pop(req_id, None)
        if self.table.cancel(req_id):  # later pushes of it are dropped; a tensor-parallel twin finds nothing
            logger.error("request %s: a KV push failed its checksum; refused", req_id)
            self.core.to_front(RequestFailed(req_id, ErrorCode.UNAVAILABLE,
                                             "a KV push of this request failed its checksum: refused"))

    def _start_search(self, first: EngineCoreOutput, params: BeamSearchParams, done: KVDone) -> None:
        """The prompt's KV is here, and the prefill node's top logprobs of its last position: the
        search's first step, taken at once."""
        top = BeamTop(done.logprobs.top_token_ids, done.logprobs.top_logprobs) if done.logprobs else BeamTop([], [])
        try:
            finished = self.core.beams.adopt(first.req_id, params, first, top)
        except ValueError as exc:
            self.engine.abort(first.req_id)
            self.core.to_front(RequestFailed(first.req_id, ErrorCode.INTERNAL, f"cannot start the beam search: {exc}"))
            return
        for search in finished:
            self.core.to_front(beams_done(search))


def make_stage(config: NodeConfig, core: NodeCore, transport: RankedTransport,
               descriptor: NodeKVDescriptor) -> KVImportStage:
    table = ReservationTable(core.engine, config.lease_s, config.retired_id_s)
    bounds = QueueBounds(config.max_waiting_requests, config.max_queued_tokens)
    return KVImportStage(core, transport, table, descriptor.layout_id, bounds)
