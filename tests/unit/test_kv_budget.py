"""KV cache sizing from a memory fraction: the arithmetic (exact block counts), the refusal
naming the flag, the /proc and cgroup readers on fake files, the dummy steps' shapes, and the
config's precedence (explicit counts win) and tensor-parallel refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.refusal import EXIT_USAGE
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_budget import KVBudgetTooSmall, MemoryFacts, kv_cache_blocks, max_concurrency
from pdserve.engine.memory_profile import (available_bytes, cgroup_headroom, dummy_steps, meminfo_available,
                                           peak_growth, status_bytes)

MiB, GiB = 1 << 20, 1 << 30


def test_blocks_are_the_fraction_of_held_plus_available_minus_held_and_activations():
    facts = MemoryFacts(available_bytes=6 * GiB, held_bytes=2 * GiB, weight_bytes=GiB, activation_bytes=512 * MiB)
    # 0.5 × 8 GiB = 4 GiB; − 2 GiB held − 0.5 GiB activations = 1.5 GiB of 1 MiB blocks.
    assert kv_cache_blocks(0.5, facts, MiB) == 1536
    assert kv_cache_blocks(0.5, facts, 3 * MiB) == 512
    assert kv_cache_blocks(0.9, facts, MiB) == int(0.9 * 8 * GiB) // MiB - 2048 - 512


def test_a_fraction_below_weights_and_activations_is_refused_naming_the_flag():
    facts = MemoryFacts(available_bytes=6 * GiB, held_bytes=2 * GiB, weight_bytes=GiB, activation_bytes=512 * MiB)
    with pytest.raises(KVBudgetTooSmall) as refused:
        kv_cache_blocks(0.3, facts, MiB)  # 2.4 GiB < 2.5 GiB + one block
    message = str(refused.value)
    assert message.startswith("--kv-cache-memory-fraction 0.3: 0.3 of 8192 MiB is 2458 MiB")
    assert "holds (2048 MiB, of which weights 1024 MiB) plus a step's activations (512 MiB)" in message
    assert refused.value.exit_code == EXIT_USAGE and isinstance(refused.value, ValueError)
    # Room for no block is refused; exactly one block's room is enough.
    tight = MemoryFacts(available_bytes=2 * GiB, held_bytes=2 * GiB, weight_bytes=GiB, activation_bytes=GiB)
    with pytest.raises(KVBudgetTooSmall):
        kv_cache_blocks(0.75, tight, MiB)
    assert kv_cache_blocks((3 * GiB + MiB) / (4 * GiB), tight, MiB) == 1


def test_max_concurrency_counts_full_length_requests():
    assert max_concurrency(1000, 16, 2048) == 1000 / 128
    assert max_concurrency(10, 16, 17) == 5.0  # 17 tokens take 2 blocks


def test_proc_readers():
    assert meminfo_available("MemTotal:  100 kB\nMemFree: 10 kB\nMemAvailable:   2048 kB\n") == 2 * MiB
    status = "Name:\tpython\nVmHWM:\t  300 kB\nVmRSS:\t  200 kB\n"
    assert (status_bytes(status, "VmRSS"), status_bytes(status, "VmHWM")) == (200 * 1024, 300 * 1024)


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_headroom_in_the_process_cgroup(tmp_path):
    _write(tmp_path / "user.slice" / "job", memory_max=str(4 * GiB), memory_current=str(GiB))
    assert cgroup_headroom("0::/user.slice/job\n", tmp_path) == 3 * GiB


def test_cgroup_v2_without_a_limit_and_v1_at_the_namespace_root(tmp_path):
    _write(tmp_path, memory_max="max\n", memory_current="123\n")
    assert cgroup_headroom("0::/\n", tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 * GiB))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(GiB // 2))
    # The process's path is not under the mount (a container sees its own cgroup as the root).
    assert cgroup_headroom("4:memory:/process_api/abc\n1:cpu:/\n0::/\n", v1) == GiB + GiB // 2
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert cgroup_headroom("4:memory:/process_api/abc\n", v1) is None


def test_available_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemAvailable: {8 * GiB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("0::/job\n")
    root = tmp_path / "cg"
    _write(root / "job", memory_max=str(3 * GiB), memory_current=str(GiB))
    assert available_bytes(proc, root) == 2 * GiB
    _write(root / "job", memory_max="max", memory_current="0")
    assert available_bytes(proc, root) == 8 * GiB


def test_peak_growth_sees_memory_freed_before_it_returns():
    def burst() -> None:
        block = bytearray(b"x") * (64 * MiB)
        del block

    assert peak_growth(burst) >= 60 * MiB


def test_dummy_steps_are_one_full_context_chunk_and_the_budget_over_max_num_seqs():
    config = EngineConfig(model="m", max_num_batched_tokens=100, max_num_seqs=8)
    long_context, spread = dummy_steps(config, max_model_len=1024)
    assert long_context == [(924, 100)]
    assert spread == [(0, 13)] * 4 + [(0, 12)] * 4 and sum(n for _, n in spread) == 100
    assert dummy_steps(config, max_model_len=64)[0] == [(0, 64)]


def test_explicit_counts_win_over_the_fraction():
    assert EngineConfig(model="m", kv_cache_memory_fraction=0.5).sizes_kv_by_profiling
    assert not EngineConfig(model="m", kv_cache_memory_fraction=0.5, num_blocks=10).sizes_kv_by_profiling
    assert not EngineConfig(model="m", kv_cache_memory_fraction=0.5, kv_cache_bytes=GiB).sizes_kv_by_profiling
    assert not EngineConfig(model="m").sizes_kv_by_profiling
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\], got 1.5"):
        EngineConfig(model="m", kv_cache_memory_fraction=1.5)


def test_the_fraction_is_refused_on_tensor_parallel_nodes_unless_a_count_is_given():
    with pytest.raises(ValueError, match="kv_cache_memory_fraction is not supported with tensor_parallel_size > 1"):
        EngineConfig(model="m", kv_cache_memory_fraction=0.5, tensor_parallel_size=2)
    EngineConfig(model="m", kv_cache_memory_fraction=0.5, tensor_parallel_size=2, num_blocks=64)
