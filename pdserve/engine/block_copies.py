"""A step's block copies: one ordered list, which every rank makes before the step's forward.

Three kinds of copy move whole KV blocks (every layer's K and V of the rank's KV heads):

    COW        device → device   a fork about to write a block it shares (pdserve/engine/kv_cache_manager.py)
    SWAP_OUT   device → host     a preempted request's KV into the swap space (pdserve/engine/swap_space.py)
    SWAP_IN    host → device     a swapped request's KV back into fresh device blocks

The scheduler appends them in the order it decides them, and that order is the order they are
made in, on every rank: swap-outs as the running pass preempts, swap-ins as the queued pass
admits (that pass runs only in a step that preempted nothing, so a step never has both), then
the copy-on-write copies the step's allocations marked (taken last, at the end of `schedule`).
So a device block a swap-out frees is read before a copy-on-write copy or the forward can write
it, and a block a swap-in fills is whole before a fork's copy reads it. A single-rank engine
and rank 0 make them in `ModelRunner.copy_blocks`; a worker rank gets the same list in its
step message (pdserve/ranks/tp_wire.py).

Must never: decide which blocks to copy, or reorder the list (consecutive copies of one kind
run as one batched copy, which is the same thing: their destinations are distinct).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockPairs = list[tuple[int, int]]  # (source block, destination block)


class CopyKind(enum.Enum):
    COW = "cow"  # device → device
    SWAP_OUT = "swap_out"  # device → host swap space
    SWAP_IN = "swap_in"  # host swap space → device


@dataclass(frozen=True, slots=True)
class BlockCopy:
    kind: CopyKind
    src: int
    dst: int


def copies_of(kind: CopyKind, pairs: Iterable[tuple[int, int]]) -> list[BlockCopy]:
    return [BlockCopy(kind, src, dst) for src, dst in pairs]


def pairs_of(copies: Sequence[BlockCopy], kind: CopyKind) -> BlockPairs:
    """The (src, dst) pairs of one kind, in order."""
    return [(c.src, c.dst) for c in copies if c.kind is kind]


def runs(copies: Sequence[BlockCopy]) -> list[tuple[CopyKind, BlockPairs]]:
    """Consecutive copies of one kind as one run of (src, dst) pairs, in the list's order: each run
    is one batched copy per layer."""
    grouped: list[tuple[CopyKind, BlockPairs]] = []
    for copy in copies:
        if not grouped or grouped[-1][0] is not copy.kind:
            grouped.append((copy.kind, []))
        grouped[-1][1].append((copy.src, copy.dst))
    return grouped
