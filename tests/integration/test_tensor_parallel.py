"""Tensor parallelism is exact: `LLM(..., tensor_parallel_size=2)` — this process as rank 0 and a
real worker process as rank 1, joined by gloo — generates, in float32, greedy tokens identical
to transformers `generate` on the whole model, for each model path and head grouping:

- Llama with grouped KV heads (TP = the number of KV heads), and with one KV head per query head;
- Qwen2 (q/k/v biases) and Qwen3 (q/k norms);
- the native path and transformers' own tensor-parallel plan;
- more ranks than KV heads (one KV head, replicated on both ranks): native only — the
  transformers path refuses it at start, naming the flag and the head count.

The worker ranks are gone once the `LLM` is closed.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.model_folder import ModelRefused
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.model_factory import make_model
from tests.integration.reference import assert_matches, greedy_references

PROMPT_LENS = [1, 9, 33, 70]
NEW_TOKENS = [12, 8, 16, 10]

MODELS = {  # name: (architecture, KV heads of the 4 attention heads)
    "llama-gqa": ("llama", 2),
    "llama-mha": ("llama", 4),
    "llama-mqa": ("llama", 1),
    "qwen2": ("qwen2", 2),
    "qwen3": ("qwen3", 2),
}
CASES = [("llama-gqa", "native"), ("llama-gqa", "transformers"), ("llama-mha", "native"),
         ("llama-mha", "transformers"), ("qwen2", "native"), ("qwen3", "native"), ("qwen3", "transformers"),
         ("llama-mqa", "native")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: str(make_model(root / name, arch, "tiny", dtype=torch.float32, num_kv_heads=kv))
            for name, (arch, kv) in MODELS.items()}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("name,impl", CASES)
def test_two_ranks_generate_exactly_the_reference(models, prompts, name, impl):
    refs = greedy_references(models[name], prompts, NEW_TOKENS)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW_TOKENS]
    with LLM(models[name], dtype="float32", model_impl=impl, tensor_parallel_size=2, num_blocks=64,
             max_num_batched_tokens=32, max_num_seqs=8, block_size=8) as llm:
        assert llm.engine.loaded.shard.size == 2
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.kv.num_used_blocks == 0
        workers = llm._group.links()
    assert_matches([o.outputs[0].token_ids for o in outputs], refs)
    assert all(not w._process.is_alive() for w in workers)  # closed with the LLM


def test_more_ranks_than_kv_heads_on_the_transformers_path_is_refused_at_start(models):
    with pytest.raises(ModelRefused, match=r"tensor_parallel_size 2: the model has 1 KV heads, fewer than 2 ranks"):
        LLM(models["llama-mqa"], dtype="float32", model_impl="transformers", tensor_parallel_size=2)


def test_a_size_the_heads_do_not_divide_is_refused_naming_it(models):
    with pytest.raises(ModelRefused, match=r"tensor_parallel_size 3: the model's 4 attention heads do not split"):
        LLM(models["llama-gqa"], dtype="float32", tensor_parallel_size=3)


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_two_ranks_swap_preempted_requests_out_and_back_exactly(models, prompts, impl):
    # 14 blocks of 8 tokens hold the longest request (10 blocks), not all four (22): preemption.
    # Every rank must make the swap copies of its own KV heads, or the tokens would differ.
    refs = greedy_references(models["llama-gqa"], prompts, NEW_TOKENS)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NEW_TOKENS]
    with LLM(models["llama-gqa"], dtype="float32", model_impl=impl, tensor_parallel_size=2, num_blocks=14,
             max_num_batched_tokens=32, max_num_seqs=8, block_size=8, preemption_mode="swap",
             swap_space_bytes=16 << 20) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_matches([o.outputs[0].token_ids for o in outputs], refs)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0 and sched.num_swaps_out == sched.num_swaps_in == sched.num_preemptions
        assert llm.engine.kv.num_used_blocks == 0 and llm.engine.swap.num_used_blocks == 0
