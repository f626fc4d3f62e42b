"""Writing new keys and values into the paged KV cache.

Owns the one store path into the cache: each token's key/value lands at its flat slot
`block_id * block_size + offset`. It never allocates, frees or reorders blocks (that is
the KV cache manager's job) and never reads the cache back.

`write_kv_cache` uses the C++ loop of row copies (pdserve/kernels/csrc, see cpu_ext) when it is
built and the inputs are on the CPU with the cache's dtype, else one torch index_put;
both store exactly the same bytes.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store token t's key/value heads at slot_mapping[t], in place."""
    _check_shapes(key, value, k_cache, slot_mapping)
    ops = cpu_ext.ops() if _cpp_applies(key, value, k_cache, v_cache, slot_mapping) else None
    if ops is None:
        write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)
        return
    # The C++ loop wants rows of head_dim contiguous elements; the transformers glue hands
    # token-major views of head-major tensors, which have them.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.contiguous())


def write_kv_cache_torch(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Torch ops only; same effect as write_kv_cache."""
    _check_shapes(key, value, k_cache, slot_mapping)
    block_size = k_cache.shape[2]
    block_idx = slot_mapping // block_size
    offset = slot_mapping % block_size
    # Two advanced indices around a slice: the indexed view is [num_tokens, num_kv_heads,
    # head_dim], matching key, and one index_put writes every token's heads at once.
    k_cache[block_idx, :, offset] = key
    v_cache[block_idx, :, offset] = value


def _cpp_applies(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    # Mixed devices fail in either path; the cache's device decides.
    return (
        k_cache.device.type == "cpu"
        and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
    )


def _check_shapes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    assert key.shape == value.shape and key.dim() == 3, (key.shape, value.shape)
    assert key.shape[0] == slot_mapping.shape[0], (key.shape, slot_mapping.shape)
    assert key.shape[1:] == (k_cache.shape[1], k_cache.shape[3]), (key.shape, k_cache.shape)
