"""Where one request's KV hand-off from a prefill node to a decode node stands, on either side.

Every request a prefill node exports (pdserve/prefill_node/exporter.py) and every reservation a
decode node holds (pdserve/decode_node/reservations.py) is in one `HandoffState`, SGLang's
KVPoll being the model. Each side has its table of legal moves below and one method
that moves a request; it refuses any other move (`IllegalMove`: a bug, not an input):

    prefill:  BOOTSTRAPPING ─▶ WAITING_FOR_INPUT ─▶ TRANSFERRING ─▶ SUCCESS
                    └──────────────────┴─────────────────┴──────────▶ FAILED
    decode:   WAITING_FOR_INPUT ─▶ SUCCESS | FAILED

A decode node sees no BOOTSTRAPPING (its blocks are reserved before any prefill node is
asked) and no TRANSFERRING (a push lands without telling it; the done message behind
the pushes is its one event). SUCCESS and FAILED are final.

Not to be confused with kv_transfer's `TransferState`: the state of one push or done
message (a `TransferHandle`), of which one hand-off has several.

Must never: import torch (node modules the front loads may import this one).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class HandoffState(enum.Enum):
    # P: connecting to the decode node's KV cache (the prompt may be computing meanwhile).
    BOOTSTRAPPING = "bootstrapping"
    # P: connected; each block the prompt fills is pushed. D: blocks reserved, the KV on its way.
    WAITING_FOR_INPUT = "waiting_for_input"
    # P: token 1 sampled; the rest is pushed and the done message queued behind it, awaiting acks.
    TRANSFERRING = "transferring"
    # P: every push and the done message acknowledged. D: done{ok} arrived; the request is admitted.
    SUCCESS = "success"
    # P: aborted or failed; its blocks are freed once no push reads them.
    # D: cancelled, past its lease, or given up by the prefill node; its blocks are freed.
    FAILED = "failed"


class IllegalMove(RuntimeError):
    """A side tried a move its table does not allow: a bug in that side's state machine."""


OnMove = Callable[[str, HandoffState], None]
"""Told `(req_id, state)` for every state a request enters, its first included (tests, logs)."""


@dataclass(frozen=True)
class HandoffMoves:
    """One side's legal moves."""

    side: str
    first: HandoffState
    moves: Mapping[HandoffState, frozenset[HandoffState]]

    def check(self, req_id: str, old: HandoffState, new: HandoffState) -> None:
        if new not in self.moves.get(old, frozenset()):
            raise IllegalMove(f"{self.side} request {req_id!r}: {old.value} -> {new.value} is not a legal move")


_S = HandoffState

PREFILL_MOVES = HandoffMoves("prefill", _S.BOOTSTRAPPING, {
    _S.BOOTSTRAPPING: frozenset({_S.WAITING_FOR_INPUT, _S.FAILED}),
    _S.WAITING_FOR_INPUT: frozenset({_S.TRANSFERRING, _S.FAILED}),
    _S.TRANSFERRING: frozenset({_S.SUCCESS, _S.FAILED}),
})

DECODE_MOVES = HandoffMoves("decode", _S.WAITING_FOR_INPUT, {
    _S.WAITING_FOR_INPUT: frozenset({_S.SUCCESS, _S.FAILED}),
})
