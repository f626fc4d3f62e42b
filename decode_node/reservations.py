"""The decode node's reservation table: blocks held for prompts whose KV is on its way.

A request's life through it:

    reserve ─▶ RESERVED: the engine request exists (not scheduled) and holds
       │        ceil((prompt + resumed tokens) / block_size) blocks that a prefill node writes into
       ├─ done{ok, token 1} ─▶ admitted: prompt computed, token 1 appended, blocks
       │                       published, scheduled (EngineCore.add_prefilled) ─▶ gone
       ├─ done{aborted} ─▶ the prefill node gave up; nothing more lands: freed ─▶ gone
       ├─ cancel ─────────▶ QUARANTINED (see below)
       └─ lease_s passes ─▶ QUARANTINED, and the stream fails DEADLINE_EXCEEDED

    QUARANTINED: the prefill node may still be writing into the blocks, so they stay
    held until its done message (either kind) arrives — pushes and the done message
    share one ordered connection, so after it nothing more lands — or until
    `quarantine_s` after the reservation, by which time the prefill node's own lease
    (`lease_s` from its Prefill call, plus the transfer timeout of its last push, also
    `lease_s`) has stopped every write, provided the router called Prefill within
    `lease_s` of READY.

Why DEADLINE_EXCEEDED and not UNAVAILABLE for a reservation that outlives its lease:
the deadline is this node's own lease running out, not this node failing. UNAVAILABLE
would tell the router that the decode node is unreachable (and to steer traffic away
from a healthy node); DEADLINE_EXCEEDED says "this attempt timed out" — the router
learns why from the Prefill call (which fails UNAVAILABLE when the transfer did) and
may retry the request anywhere.

Must never: free a block a prefill node may still write, or let another request find
a reserved block in the prefix cache before its bytes arrived.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput, RequestRejected
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.kv_done import DoneStatus, KVDone


@dataclass(slots=True, eq=False)
class Reservation:
    request: Request
    block_ids: list[int]
    reserved_at: float
    deadline: float  # the stream fails here if the KV has not arrived


@dataclass(slots=True, eq=False)
class Quarantined:
    blocks: list[KVBlock]
    until: float  # freed then at the latest


class Arrival(enum.Enum):
    ADMITTED = "admitted"  # scheduled; `output` is token 1 (its finish_reason may be set)
    ABORTED = "aborted"  # the prefill node gave up: the blocks are free, the stream must fail
    RELEASED = "released"  # a quarantined (cancelled or expired) reservation freed
    UNKNOWN = "unknown"  # no such reservation (freed long ago): nothing to do


class ReservationTable:
    def __init__(self, engine: EngineCore, lease_s: float, quarantine_s: float) -> None:
        self.engine = engine
        self.lease_s = lease_s
        self.quarantine_s = quarantine_s
        self._reserved: dict[str, Reservation] = {}
        self._quarantined: dict[str, Quarantined] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks held for KV that has not arrived (reserved and quarantined)."""
        return (sum(len(r.block_ids) for r in self._reserved.values())
                + sum(len(q.blocks) for q in self._quarantined.values()))

    @property
    def num_reserved(self) -> int:
        """Reservations still waiting for their KV (quarantined ones wait for nothing)."""
        return len(self._reserved)

    def has_pending(self) -> bool:
        return bool(self._reserved or self._quarantined)

    def reserved_request(self, req_id: str) -> Request | None:
        reservation = self._reserved.get(req_id)
        return reservation.request if reservation is not None else None

    def reserve(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int,
                now: float, resumed_token_ids: Sequence[int] = ()) -> list[int]:
        """The reserved block ids, in prompt (+ resumed tokens) order. Raises NodeError
        (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)."""
        if req_id in self._quarantined:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"request_id {req_id!r} was cancelled here and is "
                                                        "still quarantined")
        try:
            request = self.engine.new_request(req_id, prompt_token_ids, params, sample_index, resumed_token_ids)
        except RequestRejected as exc:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        # No prefix lookup: every block receives the prefill node's bytes (prompt and
        # resumed tokens alike: a resume's prefill computes both).
        block_ids = self.engine.kv.allocate_slots(request, request.num_tokens)
        if block_ids is None:
            self.engine.detach(req_id)
            needed = self.engine.kv.blocks_needed(request.num_tokens)
            raise NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"the prompt needs {needed} KV blocks; "
                                                          f"{self.engine.kv.num_free_blocks} are free")
        self._reserved[req_id] = Reservation(request, block_ids, now, now + self.lease_s)
        return block_ids

    def arrive(self, req_id: str, done: KVDone) -> tuple[Arrival, EngineCoreOutput | None]:
        """The prefill node's done message for `req_id`: every byte before it has landed."""
        quarantined = self._quarantined.pop(req_id, None)
        if quarantined is not None:
            self.engine.kv.pool.free(reversed(quarantined.blocks))
            return Arrival.RELEASED, None
        reservation = self._reserved.pop(req_id, None)
        if reservation is None:
            return Arrival.UNKNOWN, None
        if done.status is DoneStatus.ABORTED:
            self.engine.kv.pool.free(reversed(self.engine.detach(req_id)))
            return Arrival.ABORTED, None
        return Arrival.ADMITTED, self.engine.add_prefilled(reservation.request, done.token_id)

    def cancel(self, req_id: str) -> bool:
        """The stream went away before the KV arrived: quarantine. False if not reserved."""
        reservation = self._reserved.pop(req_id, None)
        if reservation is None:
            return False
        self._quarantine(reservation)
        return True

    def expire(self, now: float) -> list[str]:
        """Quarantine reservations past their lease (their ids: fail those streams); free old quarantines."""
        expired = [r for r in self._reserved.values() if now >= r.deadline]
        for reservation in expired:
            del self._reserved[reservation.request.req_id]
            self._quarantine(reservation)
        for req_id in [k for k, q in self._quarantined.items() if now >= q.until]:
            self.engine.kv.pool.free(reversed(self._quarantined.pop(req_id).blocks))
        return [r.request.req_id for r in expired]

    def _quarantine(self, reservation: Reservation) -> None:
        req_id = reservation.request.req_id
        blocks = self.engine.detach(req_id)
        self._quarantined[req_id] = Quarantined(blocks, reservation.reserved_at + self.quarantine_s)
