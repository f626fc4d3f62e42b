"""Tensor parallelism inside one node: which slice of the model a rank holds, and the sum that joins them.

A node of `size` ranks splits every layer Megatron-style: rank r holds a contiguous block of the
query heads, of the KV heads and of the MLP's intermediate rows (column-parallel q/k/v and
gate/up, row-parallel o_proj and down_proj), so a layer needs one all-reduce after attention and
one after the MLP. Each rank's KV cache holds only its KV heads, which the heads-major block
layout makes one contiguous slice of every block (what a KV push moves, pdserve/kv_transfer/layout.py).

More ranks than KV heads: each KV head is replicated on `size // num_kv_heads` consecutive ranks
(vLLM's rule), so a rank still holds one whole head and attends with its own query heads only.
A KV push sends a replicated head once, from the lowest rank holding it (pdserve/ranks/kv_ranks.py).

Must never: start processes or pick addresses (pdserve/ranks/tp_group.py does), or import a network library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from pdserve.engine.block_copies import BlockCopy
    from pdserve.engine.model_runner import PackedBatch


class StepFanout(Protocol):
    """Hands a step to the other ranks before rank 0 runs it (pdserve/ranks/tp_group.py): its block copies
    (pdserve/engine/block_copies.py; each rank copies its own KV heads) and then its packed batch, None for
    a step that only copies."""

    def __call__(self, batch: PackedBatch | None, copies: list[BlockCopy]) -> None: ...


@dataclass(frozen=True, slots=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.size})")

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def block(self, total: int) -> tuple[int, int]:
        """This rank's contiguous [start, end) of `total` items split evenly (heads, MLP rows)."""
        per_rank = total // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """The global KV heads this rank caches: its block, or the one head it replicates."""
        return kv_head_ranges(num_kv_heads, self.size)[self.rank]

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum `partial` over the ranks, in place (a no-op on one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(partial)
        return partial


def kv_head_ranges(num_kv_heads: int, size: int) -> list[tuple[int, int]]:
    """Every rank's global KV-head range, rank order (the node's KV layout)."""
    if size <= num_kv_heads:
        per_rank = num_kv_heads // size
        return [(r * per_rank, (r + 1) * per_rank) for r in range(size)]
    replicas = size // num_kv_heads
    return [(r // replicas, r // replicas + 1) for r in range(size)]


def split_reason(size: int, num_heads: int, num_kv_heads: int, intermediate: int | None,
                 replicates_kv: bool) -> str | None:
    """Why `size` ranks cannot split this model evenly, or None. `replicates_kv`: the model path
    can hold one KV head on several ranks (the native one); transformers' own plan cannot."""
    if size == 1:
        return None
    if num_heads % size:
        return f"the model's {num_heads} attention heads do not split evenly over {size} ranks"
    if intermediate is not None and intermediate % size:
        return f"the model's MLP width {intermediate} does not split evenly over {size} ranks"
    if size <= num_kv_heads:
        if num_kv_heads % size:
            return f"the model's {num_kv_heads} KV heads do not split evenly over {size} ranks"
        return None
    if not replicates_kv:
        return (f"the model has {num_kv_heads} KV heads, fewer than {size} ranks, and the transformers "
                f"path cannot replicate a KV head (use --model-impl native, or at most {num_kv_heads} ranks)")
    if size % num_kv_heads:
        return (f"{size} ranks over the model's {num_kv_heads} KV heads: more ranks than KV heads must be a "
                f"multiple of them, so each head is replicated on the same number of ranks")
    return None
