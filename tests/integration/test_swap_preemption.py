"""Preemption by swap on a real model: greedy float32 tokens equal transformers `generate`
whether preempted requests are swapped out and back in, recomputed, or either (auto), and
after every run no block is in use in the device pool or the swap space.

The pool (40 blocks of 16 tokens, as test_exactness.py's preemption test) holds the longest
request but not all of them, so requests are preempted; under `swap` every preemption swaps.
"""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.node.front.convert import stats_to_proto
from pdserve.node.core.stats import build_stats

from .reference import assert_matches, greedy_references
from .test_exactness import NEW_TOKENS, PROMPT_LENS, random_prompts, run_greedy

SMALL_POOL = dict(dtype="float32", block_size=16, num_blocks=40, max_num_batched_tokens=128, max_num_seqs=12)
SWAP_SPACE_BYTES = 64 << 20  # far more than 40 blocks of the tiny models (mapped only as it fills)


@pytest.fixture(scope="module")
def llama_case(model_dirs):
    prompts = random_prompts(PROMPT_LENS, vocab=900, seed=1)
    return model_dirs["llama"], prompts, greedy_references(model_dirs["llama"], prompts, NEW_TOKENS)


def assert_drained(llm: LLM) -> None:
    assert llm.engine.kv.num_used_blocks == 0
    assert llm.engine.swap.num_used_blocks == 0
    assert not llm.engine.scheduler.swapped


@pytest.mark.parametrize("model_impl", ["native", "transformers"])
def test_swap_is_exact_and_swaps_every_preemption(llama_case, model_impl):
    model_dir, prompts, refs = llama_case
    llm = LLM(model_dir, model_impl=model_impl, preemption_mode="swap", swap_space_bytes=SWAP_SPACE_BYTES,
              **SMALL_POOL)
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.num_swaps_out == sched.num_swaps_in == sched.num_preemptions
    assert_drained(llm)
    stats = stats_to_proto(build_stats("colocated", llm.engine, None, 0))  # what GetStats answers
    assert (stats.swaps_out, stats.swaps_in) == (sched.num_swaps_out, sched.num_swaps_in)
    assert (stats.swap_blocks, stats.used_swap_blocks, stats.num_swapped) == (llm.engine.swap.num_blocks, 0, 0)


def test_recompute_is_exact_and_never_swaps(llama_case):
    model_dir, prompts, refs = llama_case
    llm = LLM(model_dir, preemption_mode="recompute", swap_space_bytes=SWAP_SPACE_BYTES, **SMALL_POOL)
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_swaps_out == 0
    assert_drained(llm)


def test_auto_with_a_small_swap_space_swaps_some_and_recomputes_the_rest(llama_case):
    model_dir, prompts, refs = llama_case
    probe = LLM(model_dir, swap_space_bytes=SWAP_SPACE_BYTES, **SMALL_POOL)
    block_bytes = SWAP_SPACE_BYTES // probe.engine.swap.num_blocks
    # 12 host blocks: the short victims fit, the long ones (up to 29 blocks) are recomputed.
    llm = LLM(model_dir, preemption_mode="auto", swap_space_bytes=12 * block_bytes, **SMALL_POOL)
    assert llm.engine.swap.num_blocks == 12
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    sched = llm.engine.scheduler
    assert sched.num_swaps_out == sched.num_swaps_in
    assert 0 < sched.num_swaps_out < sched.num_preemptions
    assert_drained(llm)


def test_auto_without_swap_space_recomputes(llama_case):
    model_dir, prompts, refs = llama_case
    llm = LLM(model_dir, **SMALL_POOL)  # the defaults: auto, no swap space
    assert llm.engine.swap.num_blocks == 0
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_swaps_out == 0
    assert_drained(llm)


def test_swap_mode_refuses_a_swap_space_smaller_than_one_block(model_dirs):
    with pytest.raises(ValueError, match="swap-space-bytes 100 holds no block"):
        LLM(model_dirs["llama"], preemption_mode="swap", swap_space_bytes=100, **SMALL_POOL)
    with pytest.raises(ValueError, match="swap_space_bytes must be > 0 with --preemption-mode swap"):
        LLM(model_dirs["llama"], preemption_mode="swap", **SMALL_POOL)
