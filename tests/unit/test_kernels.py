"""Paged attention kernels against dense causal attention on contiguous K/V, and the cache write.

Every implementation runs every case: the torch path, the C++ CPU kernel (skipped cleanly
when it cannot be built; the first run compiles it, later runs load it from disk) and the
reference.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import (
    AttentionMetadata,
    cpu_ext,
    paged_attention,
    paged_attention_cpp,
    paged_attention_reference,
    paged_attention_torch,
    write_kv_cache,
    write_kv_cache_torch,
)
from pdserve.kernels.paged_attention import (
    NEVER,
    AVX2_SPLIT,
    PORTABLE_SPLIT,
    VECTOR_SPLIT,
    VECTOR_SPLIT_AMX_BF16,
    SdpaSplit,
    leaves_chunks_to_sdpa,
)

HEAD_DIM = 16
IMPLS = {"torch": paged_attention_torch, "cpp": paged_attention_cpp, "reference": paged_attention_reference}
CALLABLES = {**IMPLS, "fast": paged_attention}  # fast: whichever paged_attention picks
FAST_IMPLS = ["torch", "cpp"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def cpp_ops() -> cpu_ext.CpuOps | None:
    return cpu_ext.ops()  # builds once per machine (~1 min), then loads from the cache dir


def test_cpp_kernels_build_wherever_there_is_a_compiler():
    # The engine falls back to torch when the build fails, and the C++ tests skip without it:
    # without this test a broken kernel source would pass the suite on the fallback.
    if os.environ.get(cpu_ext.DISABLE_ENV) == "0" or shutil.which("c++") is None:
        pytest.skip("C++ kernels disabled, or no compiler on this machine")
    assert cpu_ext.available(), "the C++ CPU kernels failed to build (see the warning logged above)"


def skip_without_cpp(request: pytest.FixtureRequest, impl: str) -> str:
    if impl == "cpp" and request.getfixturevalue("cpp_ops") is None:
        pytest.skip("C++ CPU kernels unavailable (no compiler, or PDSERVE_CPU_EXT=0)")
    return impl


@pytest.fixture(params=list(IMPLS))
def impl(request: pytest.FixtureRequest) -> str:
    return skip_without_cpp(request, request.param)


@pytest.fixture(params=FAST_IMPLS)
def fast_impl(request: pytest.FixtureRequest) -> str:
    return skip_without_cpp(request, request.param)


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    expected: torch.Tensor  # [num_tokens, num_heads, head_dim], float64


def make_metadata(
    seqs: list[tuple[int, int]], block_ids: list[list[int]], block_size: int, num_decodes: int | None = None
) -> AttentionMetadata:
    """seqs: (seq_len, query_len) per sequence; decodes (query_len 1) come first."""
    if num_decodes is None:
        num_decodes = next((i for i, (_, query_len) in enumerate(seqs) if query_len != 1), len(seqs))
    query_lens = [query_len for _, query_len in seqs]
    seq_lens = [seq_len for seq_len, _ in seqs]
    slots = []
    for (seq_len, query_len), ids in zip(seqs, block_ids):
        positions = range(seq_len - query_len, seq_len)
        slots += [ids[pos // block_size] * block_size + pos % block_size for pos in positions]
    width = max(len(ids) for ids in block_ids) + 2  # extra zero padding the kernels must ignore
    tables = [ids + [0] * (width - len(ids)) for ids in block_ids]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        num_decodes=num_decodes,
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [query_len, heads, d], k/v [seq_len, kv_heads, d] -> [query_len, heads, d] in float64."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    q, k, v = (x.double().transpose(0, 1) for x in (q, k, v))
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    positions = torch.arange(seq_len)
    visible = positions[None, :] <= positions[seq_len - query_len :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale).transpose(0, 1)


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_decodes: int | None = None,
    head_dim: int = HEAD_DIM,
    query_scale: float = 2.0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = 2 * sum(blocks_needed) + 3
    # Random, non-contiguous block ids; block 0 stays unused so padding never aliases data.
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_ids = []
    for n in blocks_needed:
        block_ids.append(pool[:n])
        pool = pool[n:]
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    scale = head_dim**-0.5
    queries, expected = [], []
    for (seq_len, query_len), ids in zip(seqs, block_ids):
        positions = torch.arange(seq_len)
        blocks, offsets = torch.tensor(ids)[positions // block_size], positions % block_size
        k = k_cache[blocks, :, offsets]  # [seq_len, num_kv_heads, head_dim], contiguous copy
        v = v_cache[blocks, :, offsets]
        q = (query_scale * torch.randn(query_len, num_heads, head_dim, generator=gen)).to(dtype)
        queries.append(q)
        expected.append(dense_causal(q, k, v, scale))
    metadata = make_metadata(seqs, block_ids, block_size, num_decodes)
    return Batch(torch.cat(queries), k_cache, v_cache, metadata, torch.cat(expected))


def run(impl: str, batch: Batch, **kwargs) -> torch.Tensor:
    scale = batch.query.shape[-1] ** -0.5
    out = CALLABLES[impl](batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, **kwargs)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    return out


def assert_matches(out: torch.Tensor, batch: Batch) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), batch.expected, atol=tol, rtol=tol)


# Decodes (partial and exactly full last blocks), a whole prompt (context == query), a chunk
# reading earlier chunks (context > query), and a one-block chunk.
MIXED = [(37, 1), (1, 1), (64, 1), (50, 1), (40, 40), (70, 23), (33, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (9, 3), (4, 4)])
def test_mixed_batch_matches_dense(impl, dtype, block_size, num_heads, num_kv_heads):
    batch = make_batch(MIXED, num_heads, num_kv_heads, block_size, dtype)
    assert_matches(run(impl, batch), batch)


@pytest.mark.parametrize(
    "seqs",
    [
        [(17, 1), (200, 1), (3, 1)],  # decodes only
        [(48, 48)],  # one prompt, context == query
        [(96, 32), (20, 20)],  # prefill chunks only
        [(100, 1), (31, 31), (80, 16)],
    ],
)
def test_batch_shapes_match_dense(impl, seqs):
    batch = make_batch(seqs, 9, 3, 16, seed=1)
    assert_matches(run(impl, batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_after_long_context_match_dense(fast_impl, dtype):
    # Chunks after context are attended in two parts merged by log-sum-exp on the CPU; these
    # span many of the flash kernel's key blocks in each part, beside a whole prompt and decodes.
    seqs = [(900, 1), (1500, 300), (700, 200), (400, 400), (1100, 64)]
    batch = make_batch(seqs, 9, 3, 16, dtype, seed=4)
    assert_matches(run(fast_impl, batch), batch)


@pytest.mark.parametrize("chunk_blocks", [1, 3, 8, 10_000])
def test_decode_chunking_does_not_change_result(chunk_blocks):
    # Some sequences span more blocks than a chunk; each then gets a chunk of its own.
    seqs = [(length, 1) for length in (5, 70, 16, 33, 1, 128, 9, 64)] + [(40, 12)]
    batch = make_batch(seqs, 4, 2, 8, seed=2)
    assert_matches(run("torch", batch, decode_chunk_blocks=chunk_blocks), batch)


def test_single_token_prefill_chunk_after_decodes(impl):
    # A one-token chunk that the runner did not count as a decode still attends causally.
    batch = make_batch([(20, 1), (45, 1), (30, 1)], 4, 2, 8, seed=3, num_decodes=1)
    assert_matches(run(impl, batch), batch)


def test_token_major_view_of_head_major_query(impl):
    # The transformers glue hands query[0].transpose(0, 1): a non-contiguous view.
    batch = make_batch(MIXED, 9, 3, 16, seed=4)
    batch.query = batch.query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not batch.query.is_contiguous()
    assert_matches(run(impl, batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_stay_finite_and_accurate(fast_impl, dtype):
    # Logits in the hundreds: exp overflows without the running max. float32 rounds such a
    # logit by ~300 * 6e-8, so every float32 path (the reference too) is ~4e-5 off float64.
    batch = make_batch([(300, 1)] * 6 + [(300, 40), (300, 70)], 8, 2, 16, dtype, seed=5, query_scale=80.0)
    out = run(fast_impl, batch)
    assert torch.isfinite(out.float()).all()
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), batch.expected, atol=tol, rtol=tol)


def test_slots_outside_every_context_are_ignored(impl):
    # Large values in block tails, padding block 0 and unused blocks must not leak in.
    batch = make_batch([(37, 1), (64, 1), (5, 1), (70, 23)], 4, 2, 16, seed=8)
    used = torch.zeros(batch.k_cache.shape[0], batch.k_cache.shape[2], dtype=torch.bool)
    for seq_idx, seq_len in enumerate(batch.metadata.seq_lens_cpu):
        positions = torch.arange(seq_len)
        used[batch.metadata.block_tables[seq_idx].long()[positions // 16], positions % 16] = True
    unused = (~used)[:, None, :, None].expand_as(batch.k_cache)
    batch.k_cache[unused] = 1e4
    batch.v_cache[unused] = -1e4
    assert_matches(run(impl, batch), batch)


WRITE_IMPLS = {"torch": write_kv_cache_torch, "cpp": write_kv_cache}


@pytest.fixture(params=list(WRITE_IMPLS))
def write_impl(request: pytest.FixtureRequest) -> str:
    return skip_without_cpp(request, request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_cache_writes_exact_slots_only(write_impl, block_size, dtype):
    num_blocks, num_kv_heads = 6, 3
    gen = torch.Generator().manual_seed(6)
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, HEAD_DIM, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: max(1, num_blocks * block_size // 3)]
    # Token-major views of head-major tensors, as the transformers glue hands them.
    key = torch.randn(num_kv_heads, len(slots), HEAD_DIM, generator=gen).to(dtype).transpose(0, 1)
    value = torch.randn(num_kv_heads, len(slots), HEAD_DIM, generator=gen).to(dtype).transpose(0, 1)

    WRITE_IMPLS[write_impl](key, value, k_cache, v_cache, slots)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, :, offset], key[t])
        assert torch.equal(v_cache[block, :, offset], value[t])
        written[block, offset] = True
    untouched = (~written)[:, None, :].expand(num_blocks, num_kv_heads, block_size)
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


def test_write_then_attend_round_trip(write_impl, fast_impl):
    # The cache write and the fast kernels agree on where a token lives.
    batch = make_batch(MIXED, 4, 2, 8, seed=7)
    k_new = torch.randn(batch.metadata.num_tokens, 2, HEAD_DIM)
    v_new = torch.randn(batch.metadata.num_tokens, 2, HEAD_DIM)
    WRITE_IMPLS[write_impl](k_new, v_new, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    fast, reference = run(fast_impl, batch), run("reference", batch)
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-5)


# The C++ kernel on its own: every block size (partial last blocks, runs of positions crossing
# blocks), head_dims of its vector and portable paths, row tiles, and the SDPA split.


@pytest.mark.parametrize("block_size", range(1, 33))
def test_cpp_every_block_size(request, block_size):
    skip_without_cpp(request, "cpp")
    batch = make_batch(MIXED + [(131, 1)], 9, 3, block_size, seed=block_size)
    assert_matches(run("cpp", batch), batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 16, 24, 32, 64, 80, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 2), (4, 4), (8, 1)])
def test_cpp_head_dims_and_groups(request, dtype, head_dim, num_heads, num_kv_heads):
    skip_without_cpp(request, "cpp")
    batch = make_batch(MIXED, num_heads, num_kv_heads, 16, dtype, seed=head_dim, head_dim=head_dim)
    assert_matches(run("cpp", batch), batch)


@pytest.mark.parametrize("split", [SdpaSplit(2, NEVER), SdpaSplit(17, NEVER), VECTOR_SPLIT, SdpaSplit(NEVER, NEVER),
                                   PORTABLE_SPLIT, SdpaSplit(NEVER, 2), SdpaSplit(4, 100)])
def test_cpp_sdpa_split_does_not_change_result(request, split):
    # Chunks longer than a row tile (16), split across tiles, or handed to SDPA; whole prompts
    # (48 and 100 tokens) too where the split says so.
    skip_without_cpp(request, "cpp")
    seqs = [(40, 1), (300, 1), (200, 63), (48, 48), (70, 17), (90, 2), (130, 100), (100, 100)]
    batch = make_batch(seqs, 9, 3, 16, seed=9)
    assert_matches(run("cpp", batch, split=split), batch)


def test_sdpa_split_rule():
    split = SdpaSplit(min_chunk=4, min_prompt=64)
    assert [split.takes(n, 100 + n) for n in (1, 3, 4, 50)] == [False, False, True, True]  # after context
    assert [split.takes(n, n) for n in (4, 63, 64, 500)] == [False, False, True, True]  # whole prompts
    with pytest.raises(AssertionError):
        SdpaSplit(min_chunk=1, min_prompt=64)  # a decode would leave the kernel


def test_the_split_follows_the_kernels_vector_loops(request):
    skip_without_cpp(request, "cpp")
    flags = Path("/proc/cpuinfo").read_text().split()
    avx512, avx2 = "avx512f" in flags, "avx2" in flags and "fma" in flags
    lanes = 16 if avx512 else 8 if avx2 else 0  # built with -march=native
    assert cpu_ext.ops().attention_lanes(64) == lanes
    assert cpu_ext.ops().attention_lanes(24) == 0  # no vector loops for this head_dim anywhere
    assert cpu_ext.ops().amx_bf16 is ("amx_bf16" in flags)
    bf16_vector = VECTOR_SPLIT_AMX_BF16 if cpu_ext.ops().amx_bf16 else VECTOR_SPLIT
    by_lanes = {16: (VECTOR_SPLIT, bf16_vector), 8: (AVX2_SPLIT, AVX2_SPLIT), 0: (PORTABLE_SPLIT, PORTABLE_SPLIT)}
    assert (SdpaSplit.for_kernel(64, torch.float32), SdpaSplit.for_kernel(64, torch.bfloat16)) == by_lanes[lanes]
    assert SdpaSplit.for_kernel(24, torch.bfloat16) == PORTABLE_SPLIT
    prompt = make_batch([(100, 100)], 4, 2, 16, seed=1).metadata
    long_prompt = make_batch([(512, 512)], 4, 2, 16, seed=1).metadata
    short_chunk = make_batch([(100, 8)], 4, 2, 16, seed=1).metadata
    assert leaves_chunks_to_sdpa(prompt, VECTOR_SPLIT) is False
    assert leaves_chunks_to_sdpa(long_prompt, VECTOR_SPLIT) is True
    assert leaves_chunks_to_sdpa(prompt, PORTABLE_SPLIT) is True
    assert leaves_chunks_to_sdpa(short_chunk, VECTOR_SPLIT) is False
    assert leaves_chunks_to_sdpa(short_chunk, PORTABLE_SPLIT) is True


def test_paged_attention_uses_cpp_unless_disabled(request, monkeypatch):
    skip_without_cpp(request, "cpp")
    batch = make_batch(MIXED, 9, 3, 16, torch.bfloat16, seed=10)
    scale = HEAD_DIM**-0.5
    args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    assert torch.equal(paged_attention(*args), paged_attention_cpp(*args))
    monkeypatch.setenv(cpu_ext.DISABLE_ENV, "0")
    assert not cpu_ext.available()
    assert torch.equal(paged_attention(*args), paged_attention_torch(*args))


def test_build_failure_falls_back_to_torch_with_one_warning(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.delenv(cpu_ext.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.setattr(cpu_ext, "_build_dir", lambda: tmp_path)  # no finished build there: it must compile
    monkeypatch.setattr(cpp_extension, "load", fail)
    batch = make_batch(MIXED, 4, 2, 8, seed=11)
    with caplog.at_level("WARNING", logger=cpu_ext.__name__):
        out = run("fast", batch)
        new_kv = batch.query[:, :2]
        write_kv_cache(new_kv, new_kv, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
        assert not cpu_ext.available()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    assert_matches(out, batch)


def test_cpp_rejects_metadata_outside_the_cache(request):
    # The kernel reads the cache through raw pointers: bad lengths or ids must raise, not read.
    skip_without_cpp(request, "cpp")
    batch = make_batch([(37, 1), (20, 1)], 4, 2, 8, seed=12)
    batch.metadata.block_tables[1, 0] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id"):
        run("cpp", batch)
    batch = make_batch([(37, 1), (20, 1)], 4, 2, 8, seed=12)
    batch.metadata.seq_lens[0] = 8 * batch.metadata.block_tables.shape[1] + 1
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        run("cpp", batch)
