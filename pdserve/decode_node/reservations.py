"""The decode node's reservation table: blocks held for prompts whose KV is on its way.

A request's life through it, in the hand-off states of pdserve/node/core/handoff.py (`_end` is the
one place a reservation leaves WAITING_FOR_INPUT, and its permit is revoked there first):

    reserve ─▶ WAITING_FOR_INPUT: the engine request exists (not scheduled) and holds
       │        ceil((prompt + resumed tokens) / block_size) blocks; their write permit
       │        is granted before their ids leave this node (Ready)
       ├─ done{ok, token 1} ─▶ SUCCESS: admitted (prompt computed, token 1 appended,
       │                       blocks published, scheduled: EngineCore.add_prefilled) ─▶ gone
       ├─ done{aborted} ─▶ FAILED: the prefill node gave up; blocks freed ─▶ gone
       ├─ cancel ─────────▶ FAILED: blocks freed at once ─▶ RETIRED
       └─ the lease runs out ─▶ the same, and the stream fails DEADLINE_EXCEEDED

The lease (pdserve/node/core/lease.py) bounds the wait for a prefill node that has stopped answering,
not the prefill itself: it runs `lease_s` from the reservation, and afresh from every renewal
its prefill node sends while it holds the request (queued, computing or pushing: each renewal
lands behind the pushes sent before it), so a deep prefill queue or a long prompt never
expires it; a prefill node never asked, dead or partitioned does, `lease_s` after it was last
heard from.

Why a cancelled reservation's blocks are freed at once although a prefill node may
still be pushing into them: a push reaches the cache only through the transport's
`WritePermits` (its bytes land in a staging buffer; each chunk is scattered into the
blocks under the permit's lock), so once the permit is revoked nothing more of that
request lands, whether its prefill node is slow, partitioned, dead, or was never asked.
Its later pushes are drained and dropped; its done message finds no reservation.

RETIRED: the id alone is remembered, and refused as a new reservation until
`retired_id_s` after the old one was made: a late push or done message for it must
never reach a new reservation under the same id (possibly on the same blocks). The old
prefill node stops writing once its caller aborts it (the router cancels the Prefill call
with the stream) or its own lease runs out on pushes nobody acknowledges; the router never
reuses an id anyway.

Why DEADLINE_EXCEEDED and not UNAVAILABLE for a reservation that outlives its lease:
the deadline is this node's own lease running out, not this node failing. UNAVAILABLE
would tell the router that the decode node is unreachable (and to steer traffic away
from a healthy node); DEADLINE_EXCEEDED says "this attempt timed out" — the router
learns why from the Prefill call (which fails UNAVAILABLE when the transfer did) and
may retry the request anywhere.

Must never: free a reserved block before revoking its permit, grant a permit after the
block ids were handed out, or let another request find a reserved block in the prefix
cache before its bytes arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.admission import RequestRejected
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import WritePermits
from pdserve.node.errors import ErrorCode, NodeError, rejection_error
from pdserve.node.core.handoff import DECODE_MOVES, HandoffState, OnMove
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.node.core.lease import LeaseClock


@dataclass(slots=True, eq=False)
class Reservation:
    request: Request
    block_ids: list[int]
    reserved_at: float
    lease: LeaseClock  # the stream fails once it runs out before the KV arrived
    state: HandoffState = DECODE_MOVES.first
    parts_arrived: int = 0  # done messages so far: one per rank pair of the two nodes (pdserve/ranks/kv_ranks.py)


class ReservationTable:
    def __init__(self, engine: EngineCore, lease_s: float, retired_id_s: float, on_move: OnMove | None = None) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self.retired_id_s = retired_id_s
        self.on_move = on_move
        self.permits = WritePermits()  # the decode core hands these to its transport
        self._reserved: dict[str, Reservation] = {}
        self._retired: dict[str, float] = {}  # req_id -> refused as a new reservation until then

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held for KV that has not arrived."""
        return sum(len(r.block_ids) for r in self._reserved.values())

    @property
    def num_reserved(self) -> int:
        """Reservations waiting for their KV."""
        return len(self._reserved)

    def has_pending(self) -> bool:
        return bool(self._reserved)

    def reserved_request(self, req_id: str) -> Request | None:
        reservation = self._reserved.get(req_id)
        return reservation.request if reservation is not None else None

    def reserve(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int,
                now: float, resumed_token_ids: Sequence[int] = ()) -> list[int]:
        """The reserved block ids, in prompt (+ resumed tokens) order. Raises NodeError
        (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)."""
        retired_until = self._retired.get(req_id)
        if retired_until is not None and now < retired_until:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"request_id {req_id!r} ended here before its KV arrived "
                                                        f"and cannot be reused within {self.retired_id_s:g}s")
        try:
            request = self.engine.new_request(req_id, prompt_token_ids, params, sample_index, resumed_token_ids)
        except RequestRejected as exc:
            raise rejection_error(exc) from exc
        # No prefix lookup: every block receives the prefill node's bytes (prompt and
        # resumed tokens alike: a resume's prefill computes both).
        block_ids = self.engine.kv.allocate_slots(request, request.num_tokens)
        if block_ids is None:
            self.engine.detach(req_id)
            needed = self.engine.kv.blocks_needed(request.num_tokens)
            raise NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"the prompt needs {needed} KV blocks; "
                                                          f"{self.engine.kv.num_free_blocks} are free")
        reservation = Reservation(request, block_ids, now, LeaseClock(self.lease_s, since=now))
        self._reserved[req_id] = reservation
        self._retired.pop(req_id, None)
        self.permits.grant(req_id, block_ids)
        if self.on_move is not None:
            self.on_move(req_id, reservation.state)
        return block_ids

    def arrive(self, req_id: str, done: KVDone) -> tuple[HandoffState | None, EngineCoreOutput | None]:
        """The prefill node's done message for `req_id`: every byte before it has landed.

        (SUCCESS, token 1's output: its finish_reason may be set), (FAILED, None: the prefill
        node gave up; the stream must fail), (WAITING_FOR_INPUT, None): another rank pair's copy
        is still to come (tensor-parallel nodes send one per pair, each behind its own bytes), or
        (None, None): no such reservation (cancelled, expired, or never made), nothing to do.
        """
        if done.status is DoneStatus.RENEW:
            raise ValueError("a renewal is not a done message: renew() it")
        reservation = self._reserved.get(req_id)
        if reservation is None:
            return None, None
        if done.status is DoneStatus.ABORTED:
            self._end(reservation, HandoffState.FAILED)
            return HandoffState.FAILED, None
        reservation.parts_arrived += 1
        if reservation.parts_arrived < done.parts:
            return HandoffState.WAITING_FOR_INPUT, None
        self._end(reservation, HandoffState.SUCCESS)
        return HandoffState.SUCCESS, self.engine.add_prefilled(reservation.request, done.token_id)

    def renew(self, req_id: str, now: float) -> bool:
        """Its prefill node still holds the request: the lease runs afresh. False if not reserved."""
        reservation = self._reserved.get(req_id)
        if reservation is None:
            return False
        reservation.lease.renew(now)
        return True

    def cancel(self, req_id: str) -> bool:
        """The stream went away before the KV arrived: free the blocks. False if not reserved."""
        reservation = self._reserved.get(req_id)
        if reservation is None:
            return False
        self._end(reservation, HandoffState.FAILED)
        self._retire(reservation)
        return True

    def expire(self, now: float) -> list[str]:
        """Free reservations past their lease (their ids: fail those streams); forget old retired ids."""
        expired = [r for r in self._reserved.values() if r.lease.expired(now)]
        for reservation in expired:
            self._end(reservation, HandoffState.FAILED)
            self._retire(reservation)
        for req_id in [k for k, until in self._retired.items() if now >= until]:
            del self._retired[req_id]
        return [r.request.req_id for r in expired]

    def _end(self, reservation: Reservation, state: HandoffState) -> None:
        """The one place a reservation changes state (it leaves the table): SUCCESS hands its
        blocks to the request it was made for, FAILED frees them."""
        req_id = reservation.request.req_id
        DECODE_MOVES.check(req_id, reservation.state, state)
        del self._reserved[req_id]
        # First: once it returns no push writes these blocks, whether they are freed now or
        # are the admitted request's own from now on (nothing may land after the done message).
        self.permits.revoke(req_id)
        reservation.state = state
        if self.on_move is not None:
            self.on_move(req_id, state)
        if state is HandoffState.FAILED:
            self.engine.kv.pool.free(reversed(self.engine.detach(req_id)))

    def _retire(self, reservation: Reservation) -> None:
        """A cancelled or expired reservation's sender may still be writing: its id waits out
        `retired_id_s` (a prefill node's aborted done message is its last word: no need)."""
        self._retired[reservation.request.req_id] = reservation.reserved_at + self.retired_id_s
