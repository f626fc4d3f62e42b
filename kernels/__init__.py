"""Attention kernels over the paged KV cache: cache writes and paged attention.

`paged_attention` and `write_kv_cache` use the C++ CPU kernels when they are built
(`cpu_ext.available()`), else their torch paths; the `_torch` / `_cpp` variants pick one.
"""

from __future__ import annotations

from pdserve.kernels import cpu_ext
from pdserve.kernels.cache_write import write_kv_cache, write_kv_cache_torch
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.paged_attention import (
    paged_attention,
    paged_attention_cpp,
    paged_attention_reference,
    paged_attention_torch,
)

__all__ = [
    "AttentionMetadata",
    "cpu_ext",
    "paged_attention",
    "paged_attention_cpp",
    "paged_attention_reference",
    "paged_attention_torch",
    "write_kv_cache",
    "write_kv_cache_torch",
]
