"""Attention kernels over the paged KV cache: cache writes and paged attention."""

from __future__ import annotations

from pdserve.kernels.cache_write import write_kv_cache
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kernels.paged_attention import paged_attention, paged_attention_reference

__all__ = ["AttentionMetadata", "paged_attention", "paged_attention_reference", "write_kv_cache"]
