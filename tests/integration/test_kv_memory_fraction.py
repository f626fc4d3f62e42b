"""--kv-cache-memory-fraction on a real model: the profiling pass sizes the cache from measured
memory (and the engine serves from it), explicit counts win, and a fraction that cannot hold the
weights and a step's activations is refused naming the flag."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine import memory_profile
from pdserve.engine.kv_budget import KVBudgetTooSmall, MemoryFacts, kv_cache_blocks
from pdserve.engine.model_runner import kv_block_bytes


def test_the_fraction_sizes_the_cache_from_measured_memory(model_dirs, monkeypatch):
    measured: list[MemoryFacts] = []
    profile = memory_profile.profile_memory

    def recording(*args):
        measured.append(profile(*args))
        return measured[-1]

    monkeypatch.setattr("pdserve.engine.kv_capacity.profile_memory", recording)
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory_fraction=0.5, max_num_batched_tokens=128)
    (facts,) = measured
    assert facts.held_bytes > facts.weight_bytes > 0 and facts.activation_bytes > 0
    block_bytes = kv_block_bytes(llm.engine.loaded, 16, llm.engine.config.torch_dtype)
    assert llm.engine.num_blocks == kv_cache_blocks(0.5, facts, block_bytes)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.kv.num_used_blocks == 0


def test_explicit_block_count_wins_and_a_tiny_fraction_is_refused(model_dirs):
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory_fraction=0.5, num_blocks=37)
    assert llm.engine.num_blocks == 37
    with pytest.raises(KVBudgetTooSmall, match=r"^--kv-cache-memory-fraction 1e-06: "):
        LLM(model_dirs["llama"], dtype="float32", kv_cache_memory_fraction=1e-6)
