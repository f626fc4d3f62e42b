"""The engine's kernels: cache writes and paged attention over the paged KV cache, and the
native model's layer ops (`LayerOps`: linear layers, RMSNorm, RoPE + KV write).

Each uses the C++ CPU kernels when they are built (`cpu_ext.available()`), else its torch
formulation; the `_torch` / `_cpp` variants of the attention pick one.
"""

from __future__ import annotations

from pdserve.kernels import cpu_ext
from pdserve.kernels.block_copy import copy_blocks
from pdserve.kernels.cache_write import write_kv_cache, write_kv_cache_torch
from pdserve.kernels.layer_ops import LayerOps
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpp,
    paged_attention_reference,
    paged_attention_torch,
)

__all__ = [
    "AttentionMetadata",
    "LayerOps",
    "copy_blocks",
    "cpu_ext",
    "paged_attention",
    "paged_attention_cpp",
    "paged_attention_reference",
    "paged_attention_torch",
    "write_kv_cache",
    "write_kv_cache_torch",
]
