"""Attention over the paged KV cache: an obviously correct reference and fast CPU paths.

Owns the attention math for one packed batch (decodes first, then prefill chunks; see
AttentionMetadata) over caches shaped [num_blocks, num_kv_heads, block_size, head_dim].
It only reads the cache; storing new keys and values is cache_write's job, and it never
syncs on device values: every length it needs on the host comes from the metadata.

`paged_attention` is the engine's fast path: the C++ kernel (pdserve/kernels/csrc, see cpu_ext) when
it is built and the inputs are float32/bfloat16 on the CPU, else the torch formulation.
Both compute the same thing; `paged_attention_torch` and `paged_attention_cpp` pick one.

Semantics shared by all paths: a sequence with query_len q and context seq_len L owns
the last q positions of its context, and its query token j sees context positions
<= L - q + j (causal, bottom-right aligned). Query head h reads kv head h // group,
group = num_heads // num_kv_heads. Scores and softmax are float32 whatever the input dtype.

The torch path copies whole blocks, so it also reads slots past a sequence's end (the
tail of its last block, table padding) and masks them out of the softmax. Those slots
must hold finite values (0 * NaN is NaN); they do in caches allocated with torch.zeros
and written only by write_kv_cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext
from pdserve.kernels.metadata import AttentionMetadata

# Decodes are attended in chunks of at most this many (padded) cache blocks, so that a
# chunk's gathered keys/values stay in the CPU cache between the gather and the matmuls.
DEFAULT_DECODE_CHUNK_BLOCKS = 256


@dataclass(frozen=True, slots=True)
class SdpaSplit:
    """Which prefill chunks the C++ path hands to SDPA (one call per chunk): a chunk of at least
    `min_chunk` tokens that also reads earlier context, a whole prompt (no earlier context) of
    at least `min_prompt`. Decodes and shorter chunks stay in the kernel. The rule
    `left_to_caller` in pdserve/kernels/csrc/paged_attention.cpp is the same."""

    min_chunk: int
    min_prompt: int

    def __post_init__(self) -> None:
        assert min(self.min_chunk, self.min_prompt) >= 2, "decodes always stay in the kernel"

    def takes(self, query_len: int, seq_len: int) -> bool:
        return query_len >= (self.min_chunk if seq_len > query_len else self.min_prompt)

    @classmethod
    def for_kernel(cls, head_dim: int, dtype: torch.dtype) -> SdpaSplit:
        """The split for this build of the kernel: it runs AVX-512 or AVX2 loops for some head
        dims and portable loops for the rest (`attention_lanes`); with AMX, SDPA's bf16 matmuls
        run on its tiles and take whole prompts sooner."""
        ops = cpu_ext.ops()
        lanes = ops.attention_lanes(head_dim) if ops is not None else 0
        if lanes == 0:
            return PORTABLE_SPLIT
        if lanes == 8:
            return AVX2_SPLIT
        return VECTOR_SPLIT_AMX_BF16 if ops.amx_bf16 and dtype == torch.bfloat16 else VECTOR_SPLIT


NEVER = 1 << 62
# With its AVX-512 loops the kernel wins on chunks up to 64 tokens after earlier context; past
# that SDPA's matmuls beat it by ~20%. On whole prompts (causal: it skips masked tiles) it wins up
# to a few hundred tokens, then its cost grows faster than SDPA's. Measured on AVX-512 with AMX,
# the demo model's prefill step, kernel / SDPA (docs/benchmarks.md, "Whole prompts on AVX-512"):
# float32, 2 threads: 11.7 / 14.0 ms at 256 tokens, 30.6 / 31.5 at 512, 88.9 / 64.8 at 1024;
# bfloat16, 1 thread: 10.2–19.3 / 8.8–9.0 at 256, 35–49 / 18 at 512, 100–114 / 42–43 at 1024.
VECTOR_SPLIT = SdpaSplit(min_chunk=64, min_prompt=512)
VECTOR_SPLIT_AMX_BF16 = SdpaSplit(min_chunk=64, min_prompt=256)
# With its portable loops (AVX2) it wins only on the shortest. Measured on AVX2, one thread, the
# demo model's prefill step (head_dim 64, float32), kernel / SDPA: a chunk after 1024 tokens of
# context 9.3 / 8.3 ms at 4 tokens, 29.5 / 13.5 at 16, 56.1 / 21.1 at 32; a whole prompt 12.5 /
# 14.9 ms at 48 tokens, 103.9 / 58.5 at 256, 4166 / 824 at 2048 (docs/benchmarks.md).
PORTABLE_SPLIT = SdpaSplit(min_chunk=4, min_prompt=64)
# With its AVX2 loops (8 lanes) it wins on chunks of up to 4–8 tokens after context and on whole
# prompts of up to 96–128. Measured on AVX2 (AMD EPYC), one thread, one attention call, kernel /
# SDPA in ms, float32, the demo model's heads (8/4, head_dim 32) and smol135m's (9/3, head_dim 64):
# a chunk after 1024 tokens of context 0.48 / 0.70 and 0.39 / 0.67 at 4 tokens, 0.95 / 0.64 and
# 0.73 / 0.81 at 8, 1.79 / 0.93 and 1.44 / 1.11 at 16; a whole prompt 0.65 / 0.60 and 0.50 / 0.62 at
# 96 tokens, 1.06 / 0.83 and 0.86 / 0.89 at 128, 3.9 / 2.0 and 3.1 / 2.7 at 256; bfloat16 the same
# within 20% (docs/benchmarks.md, "Attention's AVX2 loops").
AVX2_SPLIT = SdpaSplit(min_chunk=8, min_prompt=128)

# The C++ kernel splits a chunk's query rows into tiles of this many rows (parallel work items).
CPP_ROW_TILE = 16
CPP_DTYPES = (torch.float32, torch.bfloat16)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """One sequence at a time, token by token gather, float32 math. Slow; for tests."""
    _check_shapes(query, k_cache, v_cache, metadata)
    out = torch.empty_like(query)
    start = 0
    for seq_idx, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu)):
        end = start + query_len
        out[start:end] = _reference_one_seq(
            query[start:end], k_cache, v_cache, metadata.block_tables[seq_idx], seq_len, scale
        )
        start = end
    return out


def _reference_one_seq(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, _ = query.shape
    block_size = k_cache.shape[2]
    group = num_heads // k_cache.shape[1]
    positions = torch.arange(seq_len, device=query.device)
    block_ids = block_table.long()[positions // block_size]
    offsets = positions % block_size
    # [seq_len, num_heads, head_dim]: token p's kv heads, repeated for each query head.
    k = k_cache[block_ids, :, offsets].float().repeat_interleave(group, dim=1)
    v = v_cache[block_ids, :, offsets].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale  # [num_heads, query_len, seq_len]
    query_positions = positions[seq_len - query_len :]
    visible = positions[None, :] <= query_positions[:, None]  # [query_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The fastest available path: C++ when built and applicable, else torch."""
    if _cpp_applies(query, k_cache, v_cache) and cpu_ext.available():
        return paged_attention_cpp(query, k_cache, v_cache, metadata, scale)
    return paged_attention_torch(query, k_cache, v_cache, metadata, scale)


def _cpp_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in CPP_DTYPES
        and k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
    )


def leaves_chunks_to_sdpa(metadata: AttentionMetadata, split: SdpaSplit) -> bool:
    """Whether paged_attention_cpp hands some prefill chunk of this step to SDPA (`split`):
    steps where it does not can run their attention wholly in the C++ kernel."""
    first = metadata.num_decodes
    lens = zip(metadata.query_lens_cpu[first:], metadata.seq_lens_cpu[first:])
    return any(split.takes(query_len, seq_len) for query_len, seq_len in lens)


def paged_attention_cpp(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    split: SdpaSplit | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """C++ kernel reading K/V in place through the block tables, for decodes and short chunks;
    one SDPA call per chunk `split` hands to it (None: this build's split for the head_dim)."""
    ops = cpu_ext.ops()
    if ops is None:
        raise RuntimeError("the C++ CPU kernels are not available (see pdserve.kernels.cpu_ext)")
    _check_shapes(query, k_cache, v_cache, metadata)
    assert _cpp_applies(query, k_cache, v_cache), (query.device, query.dtype, k_cache.dtype, v_cache.dtype)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if split is None:
        split = SdpaSplit.for_kernel(query.shape[-1], query.dtype)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ops.paged_attention(
        query, k_cache, v_cache, metadata.block_tables.contiguous(), metadata.seq_lens.contiguous(),
        metadata.query_start_loc.contiguous(), out, scale, split.min_chunk, split.min_prompt, CPP_ROW_TILE,
    )  # fmt: skip
    # Decodes (one query token each, first in the batch) are never left to SDPA: skip them here,
    # where a Python loop over a large decode batch would cost more than their attention.
    start = metadata.num_decodes
    for seq_idx in range(metadata.num_decodes, metadata.num_seqs):
        query_len, seq_len = metadata.query_lens_cpu[seq_idx], metadata.seq_lens_cpu[seq_idx]
        end = start + query_len
        if split.takes(query_len, seq_len):
            block_table = metadata.block_tables[seq_idx]
            out[start:end] = _prefill_attention(query[start:end], k_cache, v_cache, block_table, seq_len, scale)
        start = end
    return out


def paged_attention_torch(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    decode_chunk_blocks: int = DEFAULT_DECODE_CHUNK_BLOCKS,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Torch ops only: decodes batched in chunks of similar length, one SDPA call per prefill chunk."""
    _check_shapes(query, k_cache, v_cache, metadata)
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        # Decode sequence i owns exactly query token i.
        out[:num_decodes] = _batched_decode(
            query[:num_decodes], k_cache, v_cache, metadata, scale, decode_chunk_blocks
        )
    start = num_decodes
    for seq_idx in range(num_decodes, metadata.num_seqs):
        end = start + metadata.query_lens_cpu[seq_idx]
        block_table, seq_len = metadata.block_tables[seq_idx], metadata.seq_lens_cpu[seq_idx]
        out[start:end] = _prefill_attention(query[start:end], k_cache, v_cache, block_table, seq_len, scale)
        start = end
    return out


def _batched_decode(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    chunk_blocks: int,
) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
    """Sort decodes by context length and attend in chunks of similar length, so padding to
    the longest context of a chunk wastes little and a chunk's gathered K/V stay in cache."""
    num_decodes = query.shape[0]
    seq_lens_cpu = metadata.seq_lens_cpu[:num_decodes]
    order = sorted(range(num_decodes), key=seq_lens_cpu.__getitem__)
    sorted_lens = [seq_lens_cpu[i] for i in order]
    order_t = torch.tensor(order, device=query.device)
    query = query.index_select(0, order_t)
    block_tables = metadata.block_tables[:num_decodes].index_select(0, order_t)
    seq_lens = metadata.seq_lens[:num_decodes].index_select(0, order_t)
    sorted_out = torch.empty_like(query)
    for first, last in _decode_chunks(sorted_lens, metadata.block_size, chunk_blocks):
        tables, lens = block_tables[first:last], seq_lens[first:last]
        max_len = sorted_lens[last - 1]
        sorted_out[first:last] = _decode_attention(query[first:last], k_cache, v_cache, tables, lens, max_len, scale)
    return torch.empty_like(sorted_out).index_copy_(0, order_t, sorted_out)


def _decode_chunks(sorted_lens: list[int], block_size: int, max_blocks: int) -> list[tuple[int, int]]:
    """Split length-sorted sequences into runs [first, last) whose padded size, run length
    times the blocks of its longest (last) member, stays within max_blocks (or is one sequence)."""
    chunks: list[tuple[int, int]] = []
    first = 0
    for seq_idx, seq_len in enumerate(sorted_lens):
        padded_blocks = (seq_idx + 1 - first) * -(-seq_len // block_size)
        if seq_idx > first and padded_blocks > max_blocks:
            chunks.append((first, seq_idx))
            first = seq_idx
    if sorted_lens:
        chunks.append((first, len(sorted_lens)))
    return chunks


def _decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one token per sequence
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs]
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """All sequences padded to max_seq_len: one matmul per side for the whole chunk."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-max_seq_len // block_size)
    # Shorter sequences read their table's padding blocks too; those positions are masked.
    block_ids = block_tables[:, :num_blocks].reshape(-1)  # [num_seqs * num_blocks]
    # Keys in float32 so bf16 logits keep their precision; softmax is float32 too.
    # [num_seqs, num_kv_heads, padded_len, head_dim]
    k = _gather_head_major(k_cache, block_ids, num_seqs, torch.float32)
    v = _gather_head_major(v_cache, block_ids, num_seqs, v_cache.dtype)
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim).float() * scale
    scores = torch.matmul(q, k.transpose(-1, -2))  # [num_seqs, num_kv_heads, group, padded_len]
    beyond_context = torch.arange(num_blocks * block_size, device=query.device) >= seq_lens[:, None]
    scores.masked_fill_(beyond_context[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)  # [num_seqs, num_kv_heads, group, head_dim]
    return out.to(query.dtype).reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len = query.shape[0]
    block_ids = block_table[: -(-seq_len // k_cache.shape[2])]
    # [1, num_kv_heads, seq_len, head_dim]
    k = _gather_head_major(k_cache, block_ids, 1, k_cache.dtype)[:, :, :seq_len]
    v = _gather_head_major(v_cache, block_ids, 1, v_cache.dtype)[:, :, :seq_len]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, head_dim]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    elif query.device.type == "cpu":
        out = _attention_after_context_cpu(q, k, v, seq_len - query_len, scale)
    else:
        # Earlier chunks are fully visible; is_causal would align top-left, so build the mask.
        positions = torch.arange(seq_len, device=query.device)
        visible = positions[None, :] <= positions[seq_len - query_len :, None]  # [query_len, seq_len]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _attention_after_context_cpu(
    q: torch.Tensor,  # [1, num_heads, query_len, head_dim]
    k: torch.Tensor,  # [1, num_kv_heads, context + query_len, head_dim]
    v: torch.Tensor,
    context: int,
    scale: float,
) -> torch.Tensor:  # [1, num_heads, query_len, head_dim]
    """A chunk after `context` earlier tokens sees all of those and its own keys causally: one
    flash-attention call over each part, merged by their log-sum-exps. SDPA with the bottom-right
    mask instead runs its masked path over every pair, up to 1.7x slower here (docs/benchmarks.md,
    "Chunks after context")."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel, with its LSE
    out_context, lse_context = flash(q, k[:, :, :context], v[:, :, :context], 0.0, False, scale=scale)
    out_own, lse_own = flash(q, k[:, :, context:], v[:, :, context:], 0.0, True, scale=scale)
    # Each part's share of the softmax: e^lse_context / (e^lse_context + e^lse_own).
    context_share = torch.sigmoid(lse_context - lse_own).unsqueeze(-1)  # [1, num_heads, query_len, 1]
    own = out_own.float()
    return (own + context_share * (out_context.float() - own)).to(q.dtype)


def _gather_head_major(
    cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_ids: torch.Tensor,  # [num_seqs * blocks_per_seq], each sequence's blocks in order
    num_seqs: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, blocks_per_seq * block_size, head_dim]
    """One gather that also makes each kv head's tokens contiguous per sequence: a block's
    head slice is contiguous (heads-major layout), so copy (block, head) rows in the order
    (sequence, head, block)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    blocks_per_seq = block_ids.shape[0] // num_seqs
    heads = torch.arange(num_kv_heads, device=cache.device, dtype=block_ids.dtype)
    rows = block_ids.view(num_seqs, 1, blocks_per_seq) * num_kv_heads + heads.view(1, num_kv_heads, 1)
    head_rows = cache.view(num_blocks * num_kv_heads, block_size * head_dim)
    # [num_seqs * num_kv_heads * blocks_per_seq, block_size * head_dim]
    gathered = head_rows.index_select(0, rows.reshape(-1))
    return gathered.view(num_seqs, num_kv_heads, blocks_per_seq * block_size, head_dim).to(dtype)


def _check_shapes(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    assert query.dim() == 3 and k_cache.dim() == 4, (query.shape, k_cache.shape)
    assert k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2] == metadata.block_size, (k_cache.shape, metadata.block_size)
    assert query.shape[2] == k_cache.shape[3], (query.shape, k_cache.shape)
    assert query.shape[1] % k_cache.shape[1] == 0, (query.shape, k_cache.shape)
    assert query.shape[0] == metadata.num_tokens, (query.shape, metadata.num_tokens)
