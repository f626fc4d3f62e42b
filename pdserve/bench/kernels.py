"""Benchmark: the C++ CPU kernels, the torch fast path and the reference, as time ratios.

Run `python -m pdserve.bench.kernels` (or `python pdserve/bench/kernels.py`). Each attention case
builds one packed batch over a cache with shuffled block ids, times the implementations
interleaved in one process (best of several rounds) and prints torch time / C++ time and
reference time / C++ time; the cache-write case prints torch time / C++ time. Absolute
times depend on the machine and its load; only the ratios are printed. Without the C++
kernels (no compiler, or PDSERVE_CPU_EXT=0) it prints reference time / torch time only.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.config import DEFAULT_BLOCK_SIZE
from pdserve.kernels import (
    AttentionMetadata,
    cpu_ext,
    paged_attention_cpp,
    paged_attention_reference,
    paged_attention_torch,
    write_kv_cache,
    write_kv_cache_torch,
)
from pdserve.kernels.layer_ops import LayerOps


@dataclass(frozen=True)
class Case:
    name: str
    decode_lens: tuple[int, int, int]  # (count, min context, max context)
    prefills: tuple[tuple[int, int], ...]  # (context, query_len) per chunk
    dtype: torch.dtype = torch.bfloat16
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = DEFAULT_BLOCK_SIZE


CASES = (
    Case("decode 16 seqs, ctx 300-400, bf16", (16, 300, 400), ()),
    Case("decode 64 seqs, ctx 300-400, bf16", (64, 300, 400), ()),
    Case("decode 64 seqs, ctx 300-400, fp32", (64, 300, 400), (), dtype=torch.float32),
    Case("decode 256 seqs, ctx 64-1000, bf16", (256, 64, 1000), ()),
    Case("mixed 128 decodes ctx 64-1000 + chunks 512/512, 1200/256, 96/16, bf16", (128, 64, 1000),
         ((512, 512), (1200, 256), (96, 16))),
    Case("mixed, same, fp32", (128, 64, 1000), ((512, 512), (1200, 256), (96, 16)), dtype=torch.float32),
    Case("mixed 48 decodes ctx 300-400 + prompt 300 + chunks 40/8, 700/64, bf16", (48, 300, 400),
         ((300, 300), (40, 8), (700, 64))),
)
# The cache write: tokens of one step, into a bf16 cache shaped like the decode cases'.
WRITE_TOKENS = 64
WRITE_CACHE_BLOCKS = 4096


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


def bench_attention(case: Case, gen: torch.Generator, rounds: int, with_cpp: bool) -> str:
    query, k_cache, v_cache, metadata = build_inputs(case, gen)
    scale = case.head_dim**-0.5
    impls = [paged_attention_reference, paged_attention_torch] + ([paged_attention_cpp] if with_cpp else [])
    outs = [impl(query, k_cache, v_cache, metadata, scale).float() for impl in impls]
    max_err = max((out - outs[0]).abs().max().item() for out in outs[1:])
    times = best_times([lambda impl=impl: impl(query, k_cache, v_cache, metadata, scale) for impl in impls], rounds)
    if not with_cpp:
        return f"reference/torch = {times[0] / times[1]:6.2f}x   (max |diff| {max_err:.1e})"
    ref_s, torch_s, cpp_s = times
    return (
        f"torch/C++ = {torch_s / cpp_s:6.2f}x   reference/C++ = {ref_s / cpp_s:7.2f}x   "
        f"(max |diff| vs reference {max_err:.1e})"
    )


def bench_cache_write(gen: torch.Generator, rounds: int) -> str:
    num_kv_heads, block_size, head_dim = 3, 16, 64
    shape = (WRITE_CACHE_BLOCKS, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    slots = torch.randperm(WRITE_CACHE_BLOCKS * block_size, generator=gen)[:WRITE_TOKENS]
    # Token-major views of head-major tensors, as the transformers glue hands them over.
    key = torch.randn(num_kv_heads, WRITE_TOKENS, head_dim, generator=gen).to(torch.bfloat16).transpose(0, 1)
    value = torch.randn(num_kv_heads, WRITE_TOKENS, head_dim, generator=gen).to(torch.bfloat16).transpose(0, 1)
    torch_s, cpp_s = best_times(
        [
            lambda: write_kv_cache_torch(key, value, k_cache, v_cache, slots),
            lambda: write_kv_cache(key, value, k_cache, v_cache, slots),
        ],
        rounds,
    )
    return f"torch/C++ = {torch_s / cpp_s:6.2f}x"


# smol135m's projections (qkv, o, gate_up, down), 30 layers' worth: far more than the caches,
# so the weights stream from memory as in a decode step.
LINEAR_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LINEAR_LAYERS = 30


def bench_linear(rows: int, x_dtype: torch.dtype, w_dtype: torch.dtype, gen: torch.Generator, rounds: int) -> str:
    """The GEMV kernel against torch's GEMM on the same layers. torch gets weights in x's dtype
    (for bf16 weights under float32 x: a float32 copy, what the engine would otherwise hold)."""
    weights = [torch.randn(n, k, generator=gen).to(w_dtype) for _ in range(LINEAR_LAYERS) for n, k in LINEAR_SHAPES]
    torch_weights = [w.to(x_dtype) for w in weights]
    xs = {k: torch.randn(rows, k, generator=gen).to(x_dtype) for k in {k for _, k in LINEAR_SHAPES}}
    kernel, baseline = LayerOps(cpu_ext.ops(), gemv=True), LayerOps(None, gemv=False)
    kernel_s, torch_s = best_times(
        [
            lambda: [kernel.linear(xs[w.shape[1]], w) for w in weights],
            lambda: [baseline.linear(xs[w.shape[1]], w) for w in torch_weights],
        ],
        rounds,
    )
    gb_s = sum(w.numel() * w.element_size() for w in weights) / kernel_s / 1e9
    return f"torch/GEMV = {torch_s / kernel_s:6.2f}x   (GEMV streams the weights at {gb_s:.1f} GB/s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--linear", action="store_true", help="only the linear layers: GEMV kernel vs torch by rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with_cpp = cpu_ext.available()
    print(f"C++ CPU kernels: {'active' if with_cpp else 'unavailable, torch path only'}; threads {args.threads}")
    gen = torch.Generator().manual_seed(0)
    if args.linear:
        if not with_cpp:
            raise SystemExit("the GEMV kernel needs the C++ CPU kernels")
        pairs = ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32))
        for rows in (1, 2, 4, 8, 16, 32):
            for x_dtype, w_dtype in pairs:
                name = f"linear, {rows} rows, x {str(x_dtype)[6:]}, weights {str(w_dtype)[6:]} (smol135m's layers)"
                print(f"{name:<75} {bench_linear(rows, x_dtype, w_dtype, gen, args.rounds)}", flush=True)
        return
    for case in CASES:
        print(f"{case.name:<75} {bench_attention(case, gen, args.rounds, with_cpp)}", flush=True)
    if with_cpp:
        name = f"cache write, {WRITE_TOKENS} tokens, 3 kv heads, head_dim 64, bf16"
        print(f"{name:<75} {bench_cache_write(gen, args.rounds * 5)}")


if __name__ == "__main__":
    main()
