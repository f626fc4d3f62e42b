"""Copying whole KV blocks inside the paged cache: the data half of copy-on-write.

The KV cache manager decides which blocks to copy (a fork about to write a block it shares,
engine/kv_cache_manager.py); this module only moves the bytes, every layer's keys and values.
It never allocates or frees blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_blocks(
    k_caches: Sequence[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, head_dim]
    v_caches: Sequence[torch.Tensor],
    copies: Sequence[tuple[int, int]],  # (src, dst) block ids; every dst distinct and no dst a src
) -> None:
    """Block dst := block src in every layer's K and V cache, in place."""
    if not copies:
        return
    device = k_caches[0].device
    src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=device)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=device)
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
