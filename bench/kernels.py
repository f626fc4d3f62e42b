"""Benchmark: the fast paged attention against the reference, as time ratios.

Run `python -m pdserve.bench.kernels` (or `python bench/kernels.py`). Each case builds one
packed batch over a cache with shuffled block ids, times both implementations
interleaved (best of several rounds) and prints reference time / fast time. Absolute
times depend on the machine and its load; only the ratios are printed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kernels import AttentionMetadata, paged_attention, paged_attention_reference


@dataclass(frozen=True)
class Case:
    name: str
    decode_lens: tuple[int, int, int]  # (count, min context, max context)
    prefills: tuple[tuple[int, int], ...]  # (context, query_len) per chunk
    dtype: torch.dtype = torch.bfloat16
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16


CASES = (
    Case("decode 64 seqs, ctx 300-400, bf16", (64, 300, 400), ()),
    Case("decode 64 seqs, ctx 300-400, fp32", (64, 300, 400), (), dtype=torch.float32),
    Case("decode 256 seqs, ctx 64-1000, bf16", (256, 64, 1000), ()),
    Case("mixed 128 decodes ctx 64-1000 + chunks 512/512, 1200/256, 96/16, bf16", (128, 64, 1000),
         ((512, 512), (1200, 256), (96, 16))),
    Case("mixed, same, fp32", (128, 64, 1000), ((512, 512), (1200, 256), (96, 16)), dtype=torch.float32),
)


def build_inputs(
    case: Case, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    count, low, high = case.decode_lens
    seqs = [(int(n), 1) for n in torch.randint(low, high + 1, (count,), generator=gen)] + list(case.prefills)
    bs = case.block_size
    blocks_needed = [-(-seq_len // bs) for seq_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 64
    pool = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(blocks_needed), dtype=torch.int32)
    slots, used = [], 0
    for i, ((seq_len, query_len), n) in enumerate(zip(seqs, blocks_needed)):
        tables[i, :n] = pool[used : used + n]
        used += n
        slots += [int(tables[i, p // bs]) * bs + p % bs for p in range(seq_len - query_len, seq_len)]
    query_lens = [q for _, q in seqs]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        block_tables=tables,
        num_decodes=count,
        block_size=bs,
        query_lens_cpu=query_lens,
        seq_lens_cpu=[s for s, _ in seqs],
    )
    cache_shape = (num_blocks, case.num_kv_heads, bs, case.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(case.dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(case.dtype)
    query = torch.randn(len(slots), case.num_heads, case.head_dim, generator=gen).to(case.dtype)
    return query, k_cache, v_cache, metadata


def best_times(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Best wall time of each function over interleaved rounds (robust to a shared machine)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()  # warm-up
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for case in CASES:
        query, k_cache, v_cache, metadata = build_inputs(case, gen)
        scale = case.head_dim**-0.5
        reference = paged_attention_reference(query, k_cache, v_cache, metadata, scale)
        fast = paged_attention(query, k_cache, v_cache, metadata, scale)
        max_err = (fast.float() - reference.float()).abs().max().item()
        ref_s, fast_s = best_times(
            [
                lambda: paged_attention_reference(query, k_cache, v_cache, metadata, scale),
                lambda: paged_attention(query, k_cache, v_cache, metadata, scale),
            ],
            args.rounds,
        )
        print(f"{case.name:<75} reference/fast = {ref_s / fast_s:6.2f}x   (max |diff| {max_err:.1e})")


if __name__ == "__main__":
    main()
