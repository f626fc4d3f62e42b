"""Every chunk schedule computes the same tokens: greedy float32 output under fixed, staged and
target-step chunking equals transformers `generate`, on long prompts that cross several stages."""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.engine.chunk_schedule import FixedChunks, StagedChunks, TargetStepChunks

from .reference import assert_matches, greedy_references
from .test_exactness import random_prompts, run_greedy

PROMPT_LENS = [400, 7, 333, 129, 260]
NEW_TOKENS = [24, 24, 16, 24, 8]
SCHEDULES = {
    "fixed": (dict(chunk_schedule="fixed"), FixedChunks),
    # A stage every 64 prompt tokens: 256, 192, 96, 32 tokens a step.
    "staged": (dict(chunk_schedule="staged", low_chunk_size=32, chunk_schedule_stages=4,
                    chunk_schedule_max_tokens=256), StagedChunks),
    # A 1 ms target: whatever budget this machine's profile gives (32..256 tokens), never the tokens.
    "target-step": (dict(chunk_schedule="target-step", target_step_ms=1.0), TargetStepChunks),
}


@pytest.fixture(scope="module")
def case(model_dirs):
    model_dir = model_dirs["llama"]
    prompts = random_prompts(PROMPT_LENS, vocab=900, seed=7)
    return model_dir, prompts, greedy_references(model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_are_token_exact(case, name):
    model_dir, prompts, refs = case
    kwargs, schedule_type = SCHEDULES[name]
    llm = LLM(model_dir, dtype="float32", block_size=16, max_num_batched_tokens=256, max_num_seqs=8, **kwargs)
    assert type(llm.engine.scheduler.chunks) is schedule_type
    assert_matches(run_greedy(llm, prompts, NEW_TOKENS), refs)
    assert llm.engine.kv.num_used_blocks == 0
