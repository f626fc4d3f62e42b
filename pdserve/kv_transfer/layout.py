"""Where a push's bytes come from and go to: plans, staging layout, gather and scatter.

Owns the one staging layout every transport puts on the wire,

    staging: [num_layers, 2 (K, V), num_blocks, num_heads, block_size, head_dim]

(contiguous, in the cache dtype), the validation of block ids / layers / head ranges on
both sides, and the byte count of a plan. A partial last block is moved whole: the
block is the unit.

Must never: touch the network, allocate per block, or write a cache block that is not
named in the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import HeadOverlap, KVCacheSpec, plan_head_overlap


@dataclass(frozen=True, slots=True)
class TransferPlan:
    req_id: str
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    layers: tuple[int, ...]
    overlap: HeadOverlap

    @property
    def num_blocks(self) -> int:
        return len(self.dst_block_ids)

    def nbytes(self, spec: KVCacheSpec) -> int:
        """Bytes on the wire: K and V of every planned block, layer and head."""
        return 2 * len(self.layers) * self.num_blocks * spec.block_nbytes(self.overlap.num_heads)


def validate_caches(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
                    spec: KVCacheSpec) -> int:
    """Check per-layer K/V caches against `spec`; returns num_blocks."""
    if len(k_caches) != spec.num_layers or len(v_caches) != spec.num_layers:
        raise ValueError(f"expected {spec.num_layers} K and V caches, got "
                         f"{len(k_caches)} and {len(v_caches)}")
    start, end = spec.local_heads
    num_blocks = k_caches[0].shape[0]
    expected = (num_blocks, end - start, spec.block_size, spec.head_dim)
    for layer, cache in enumerate([*k_caches, *v_caches]):
        if tuple(cache.shape) != expected:
            raise ValueError(f"cache {layer} has shape {tuple(cache.shape)}, "
                             f"expected {expected}")
        if cache.dtype != spec.torch_dtype or not cache.is_contiguous():
            raise ValueError(f"cache {layer} must be contiguous {spec.dtype}, "
                             f"got {cache.dtype} contiguous={cache.is_contiguous()}")
    return num_blocks


def check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str,
                    unique: bool) -> tuple[int, ...]:
    ids = tuple(int(b) for b in block_ids)
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{side} block ids out of range [0, {num_blocks}): {bad[:8]}")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{side} block ids repeat: a block can receive only once per push")
    return ids


def check_layers(layers: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    out = tuple(int(layer) for layer in layers)
    if not out or len(set(out)) != len(out) or not all(0 <= x < num_layers for x in out):
        raise ValueError(f"layers must be distinct indices in [0, {num_layers}): {out}")
    return out


def resolve_overlap(src_heads: tuple[int, int], dst_heads: tuple[int, int],
                    head_range: tuple[int, int] | None) -> HeadOverlap:
    """Heads to move: the ranks' overlap, narrowed to `head_range` when one is given."""
    overlap = plan_head_overlap(src_heads, dst_heads)
    if overlap is not None and head_range is not None:
        narrowed = plan_head_overlap(overlap.heads, head_range)
        overlap = None if narrowed is None else HeadOverlap(
            heads=narrowed.heads, src=_local(narrowed.heads, src_heads),
            dst=_local(narrowed.heads, dst_heads))
    if overlap is None:
        raise ValueError(f"no KV heads to move: sender holds {src_heads}, receiver holds "
                         f"{dst_heads}, requested {head_range}")
    return overlap


def _local(heads: tuple[int, int], held: tuple[int, int]) -> tuple[int, int]:
    """Global head range -> slice of a cache that holds global heads `held`."""
    return heads[0] - held[0], heads[1] - held[0]


def make_plan(req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              layers: Sequence[int] | None, head_range: tuple[int, int] | None,
              local: KVCacheSpec, local_num_blocks: int,
              remote: KVCacheSpec, remote_num_blocks: int) -> TransferPlan:
    """Validate a push against both sides' caches; raises ValueError on bad input."""
    if not req_id:
        raise ValueError("req_id must be non-empty")
    if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
        raise ValueError(f"need equally many (>0) src and dst block ids, got "
                         f"{len(src_block_ids)} and {len(dst_block_ids)}")
    return TransferPlan(
        req_id=req_id,
        src_block_ids=check_block_ids(src_block_ids, local_num_blocks, "src", unique=False),
        dst_block_ids=check_block_ids(dst_block_ids, remote_num_blocks, "dst", unique=True),
        layers=check_layers(layers, local.num_layers),
        overlap=resolve_overlap(local.local_heads, remote.local_heads, head_range))


def check_incoming(block_ids: Sequence[int], layers: Sequence[int], head_range: tuple[int, int],
                   spec: KVCacheSpec, num_blocks: int) -> str | None:
    """Why a received push's header cannot be placed in this rank's cache, or None."""
    try:
        check_block_ids(block_ids, num_blocks, "dst", unique=True)
        check_layers(layers, spec.num_layers)
    except ValueError as exc:
        return str(exc)
    held = spec.local_heads
    if not held[0] <= head_range[0] < head_range[1] <= held[1]:
        return f"heads {head_range} not held here ({held})"
    return None


def incoming_nbytes(num_blocks: int, num_layers: int, head_range: tuple[int, int], spec: KVCacheSpec) -> int:
    """The bytes a push header naming these blocks, layers and heads implies."""
    heads = max(0, head_range[1] - head_range[0])
    return 2 * num_layers * num_blocks * spec.block_nbytes(heads)


def cache_nbytes(spec: KVCacheSpec, num_blocks: int) -> int:
    """Bytes of this rank's whole cache: no push can be larger."""
    return incoming_nbytes(num_blocks, spec.num_layers, spec.local_heads, spec)


def incoming_staging_shape(num_blocks: int, num_layers: int, head_range: tuple[int, int],
                           spec: KVCacheSpec) -> tuple[int, ...]:
    """[layers, K/V, blocks, heads, block_size, head_dim], as the sender gathered it."""
    return (num_layers, 2, num_blocks, head_range[1] - head_range[0], spec.block_size, spec.head_dim)


def staging_shape(plan: TransferPlan, spec: KVCacheSpec) -> tuple[int, ...]:
    return (len(plan.layers), 2, plan.num_blocks, plan.overlap.num_heads,
            spec.block_size, spec.head_dim)


def typed_view(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View the first bytes of a flat uint8 buffer as a contiguous `dtype` tensor."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    return raw[:nbytes].view(dtype).view(shape)


def gather(plan: TransferPlan, k_caches: Sequence[torch.Tensor],
           v_caches: Sequence[torch.Tensor], out: torch.Tensor,
           start: int = 0, stop: int | None = None) -> None:
    """Copy the plan's source blocks of plan.layers[start:stop] into out[start:stop]."""
    idx = torch.tensor(plan.src_block_ids, dtype=torch.long, device=out.device)
    h0, h1 = plan.overlap.src
    stop = len(plan.layers) if stop is None else stop
    for i in range(start, stop):
        layer = plan.layers[i]
        # [num_blocks, heads, block_size, head_dim] -> out[i, kv]: [n, h, block_size, head_dim]
        torch.index_select(k_caches[layer][:, h0:h1], 0, idx, out=out[i, 0])
        torch.index_select(v_caches[layer][:, h0:h1], 0, idx, out=out[i, 1])


def layer_chunks(num_layers: int, chunk_layers: int) -> list[tuple[int, int]]:
    """[start, stop) layer index ranges of the data messages of one push."""
    return [(lo, min(num_layers, lo + chunk_layers)) for lo in range(0, num_layers, chunk_layers)]


def scatter(staging: torch.Tensor, dst_block_ids: Sequence[int], layers: Sequence[int],
            dst_heads: tuple[int, int], k_caches: Sequence[torch.Tensor],
            v_caches: Sequence[torch.Tensor]) -> None:
    """Write staging blocks into the named destination blocks (and nothing else)."""
    assert staging.shape[0] == len(layers) and staging.shape[2] == len(dst_block_ids)
    h0, h1 = dst_heads
    if staging.device.type == "cpu" and k_caches[0].device.type == "cpu":
        # numpy's fancy assignment copies whole rows; ~4x torch's index_copy_ on CPU.
        idx = np.asarray(dst_block_ids, dtype=np.int64)
        for i, layer in enumerate(layers):
            _byte_rows(k_caches[layer])[idx, h0:h1] = _byte_rows(staging[i, 0])
            _byte_rows(v_caches[layer])[idx, h0:h1] = _byte_rows(staging[i, 1])
        return
    index = torch.tensor(list(dst_block_ids), dtype=torch.long, device=staging.device)
    for i, layer in enumerate(layers):
        k_caches[layer][:, h0:h1].index_copy_(0, index, staging[i, 0])
        v_caches[layer][:, h0:h1].index_copy_(0, index, staging[i, 1])


def _byte_rows(blocks: torch.Tensor) -> np.ndarray:
    """[n, heads, block_size, head_dim] contiguous CPU tensor -> [n, heads, bytes] uint8."""
    return blocks.view(blocks.shape[0], blocks.shape[1], -1).view(torch.uint8).numpy()
