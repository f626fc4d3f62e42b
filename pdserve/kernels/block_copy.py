"""Copying whole KV blocks: inside the paged cache (copy-on-write) and between it and the host
swap space (preemption by swap).

The KV cache manager and the scheduler decide which blocks to copy (a fork about to write a block
it shares, pdserve/engine/kv_cache_manager.py; a preempted request swapped out or back in,
pdserve/engine/scheduler.py); this module only moves the bytes, every layer's keys and values.
It never allocates or frees blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_blocks(
    sources: Sequence[torch.Tensor],  # per layer and K/V [num_blocks, num_kv_heads, block_size, head_dim]
    targets: Sequence[torch.Tensor],  # the same layers, in the same order (may be `sources` themselves)
    copies: Sequence[tuple[int, int]],  # (src, dst) block ids; every dst distinct and no dst a src
) -> None:
    """Block dst of each target := block src of its source, in place."""
    if not copies:
        return
    src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=sources[0].device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=targets[0].device)
    for source, target in zip(sources, targets, strict=True):
        target.index_copy_(0, dst, source.index_select(0, src).to(target.device))
