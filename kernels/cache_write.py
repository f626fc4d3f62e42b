"""Writing new keys and values into the paged KV cache.

Owns the one store path into the cache: each token's key/value lands at its flat slot
`block_id * block_size + offset`. It never allocates, frees or reorders blocks (that is
the KV cache manager's job) and never reads the cache back.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store token t's key/value heads at slot_mapping[t], in place."""
    assert key.shape == value.shape and key.dim() == 3, (key.shape, value.shape)
    assert key.shape[0] == slot_mapping.shape[0], (key.shape, slot_mapping.shape)
    assert key.shape[1:] == (k_cache.shape[1], k_cache.shape[3]), (key.shape, k_cache.shape)
    block_size = k_cache.shape[2]
    block_idx = slot_mapping // block_size
    offset = slot_mapping % block_size
    # Two advanced indices around a slice: the indexed view is [num_tokens, num_kv_heads,
    # head_dim], matching key, and one index_put writes every token's heads at once.
    k_cache[block_idx, :, offset] = key
    v_cache[block_idx, :, offset] = value
