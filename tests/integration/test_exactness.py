"""Greedy float32 output is token-identical to transformers `generate`, under every engine setting.

12 prompts of 1..400 tokens, up to 64 new tokens, on Llama and Qwen2 tiny models, under
chunk sizes {16, 64, 512} x block sizes {8, 16}, under preemption, and with prefix-cache
hits; Mistral and Qwen3 (q/k norm) on fewer prompts. These run the default implementation
(`auto`: the native forward for all four); the transformers implementation runs the same
prompts on every architecture, and the native forward also from a bf16 checkpoint computed
in float32 (bf16-stored matrices). After every run no block is in use.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.model_factory import make_model

from .reference import assert_matches, greedy_references

PROMPT_LENS = [1, 2, 7, 15, 16, 17, 40, 64, 129, 200, 333, 400]
NEW_TOKENS = [64, 17, 64, 33, 64, 1, 64, 48, 64, 5, 64, 64]


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]


def shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(150)]
    return [prefix + [rng.randrange(1, vocab) for _ in range(n)] for n in (1, 9, 16, 30, 57, 100)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, model_dirs):
    model_dir = model_dirs[request.param]
    prompts = random_prompts(PROMPT_LENS, vocab=900, seed=1)
    return model_dir, prompts, greedy_references(model_dir, prompts, NEW_TOKENS)


def run_greedy(llm: LLM, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in new_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("chunk", [16, 64, 512])
def test_chunk_and_block_sizes(case, chunk, block_size):
    model_dir, prompts, refs = case
    llm = LLM(model_dir, dtype="float32", block_size=block_size, max_num_batched_tokens=chunk, max_num_seqs=16)
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.kv.num_used_blocks == 0


def test_preemption(case):
    model_dir, prompts, refs = case
    # 40 blocks of 16 tokens hold the longest request (464 tokens) but not all of them.
    llm = LLM(model_dir, dtype="float32", block_size=16, num_blocks=40, max_num_batched_tokens=128, max_num_seqs=12)
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.num_used_blocks == 0


def test_reference_attention_backend(case):
    model_dir, prompts, refs = case
    llm = LLM(model_dir, dtype="float32", attention_backend="reference", max_num_batched_tokens=64, max_num_seqs=16)
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_cache_hits(model_dirs, arch):
    prompts = shared_prefix_prompts(vocab=900, seed=2)
    new_tokens = [32] * len(prompts)
    refs = greedy_references(model_dirs[arch], prompts, new_tokens)
    llm = LLM(model_dirs[arch], dtype="float32", block_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    # One at a time, so every later prompt finds the shared prefix cached.
    outputs = [run_greedy(llm, [p], [32])[0] for p in prompts]
    assert_matches(outputs, refs)
    stats = llm.engine.kv.pool.stats
    assert stats.hits >= (len(prompts) - 1) * (150 // 16)
    assert llm.engine.kv.num_used_blocks == 0
    # And all at once: later prompts hit blocks the first computes in the same steps.
    assert_matches(run_greedy(llm, prompts, new_tokens), refs)
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_other_architectures(model_dirs, arch):
    prompts = random_prompts([3, 40, 130, 257], vocab=900, seed=3)
    new_tokens = [32, 32, 16, 32]
    refs = greedy_references(model_dirs[arch], prompts, new_tokens)
    llm = LLM(model_dirs[arch], dtype="float32", block_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    assert_matches(run_greedy(llm, prompts, new_tokens), refs)
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_both_implementations(model_dirs, arch):
    prompts = random_prompts([1, 17, 64, 200], vocab=900, seed=4)
    new_tokens = [24, 24, 16, 24]
    refs = greedy_references(model_dirs[arch], prompts, new_tokens)
    for impl in ("native", "transformers"):
        llm = LLM(model_dirs[arch], dtype="float32", model_impl=impl, block_size=8, max_num_batched_tokens=64)
        assert llm.engine.loaded.impl == impl
        assert_matches(run_greedy(llm, prompts, new_tokens), refs)
        assert llm.engine.kv.num_used_blocks == 0


def test_bf16_checkpoint_in_float32(tmp_path):
    """What `auto` runs on a CPU without native bf16: float32 math on bf16-stored matrices
    (the GEMV kernel for decode steps), token-identical to transformers on the upcast weights."""
    model_dir = make_model(tmp_path / "qwen2-bf16", "qwen2", "tiny", dtype=torch.bfloat16, seed=0)
    prompts = random_prompts([5, 40, 130], vocab=900, seed=5)
    new_tokens = [32, 32, 32]
    refs = greedy_references(model_dir, prompts, new_tokens)
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=64)
    assert_matches(run_greedy(llm, prompts, new_tokens), refs)
    assert llm.engine.kv.num_used_blocks == 0
