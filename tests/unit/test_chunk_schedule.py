"""Chunk schedules: Sarathi-Serve's staged sizes and the chunks a long prompt gets under them,
the target-step budget from a fitted step-time model, and the config's checks."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.chunk_schedule import FixedChunks, StagedChunks, TargetStepChunks, staged_chunk_sizes
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.step_profile import StepTimeModel, profile_step_times
from tests.unit.test_scheduler_harness import SchedLoop, colocated


def sarathi_chunk_sizes(low: int, high: int, stages: int) -> list[int]:
    """Sarathi-Serve's `_compute_chunk_size_schedule`, in numpy as it is written there."""
    sizes = np.linspace(low, high, stages, dtype=np.int32)[::-1]
    align = min(32, low)
    return (np.round(sizes / align) * align).astype(np.int64).tolist()


@pytest.mark.parametrize("low, high, stages", [
    (128, 2048, 16), (128, 2048, 4), (32, 128, 4), (64, 512, 5), (32, 544, 7), (256, 256, 1), (32, 4096, 33),
    (16, 100, 3),
])
def test_stage_sizes_equal_sarathi_serves_formula(low, high, stages):
    assert staged_chunk_sizes(low, high, stages) == sarathi_chunk_sizes(low, high, stages)


def test_named_stage_sizes():
    assert staged_chunk_sizes(32, 128, 4) == [128, 96, 64, 32]
    assert staged_chunk_sizes(128, 512, 4) == [512, 384, 256, 128]


def _chunks(loop: SchedLoop, req_id: str) -> list[int]:
    sizes = []
    while not loop.live[req_id].output_token_ids:
        sizes.extend(n for r, n in loop.step_ids() if r == req_id)
    return sizes


def test_a_long_prompt_moves_one_stage_down_every_max_tokens_over_stages_computed_tokens():
    schedule = StagedChunks(low=32, high=128, stages=4, max_tokens=512)  # a stage every 128 tokens
    loop = SchedLoop(colocated(), num_blocks=128, block_size=4, budget=128)
    loop.scheduler.chunks = schedule
    loop.add("a", list(range(400)), max_tokens=2)
    expected, done = [], 0
    while done < 400:  # Sarathi-Serve's _get_seq_next_num_prefill_tokens, one request alone
        size = sarathi_chunk_sizes(32, 128, 4)[min(done // 128, 3)]
        expected.append(min(400 - done, size))
        done += expected[-1]
    assert _chunks(loop, "a") == expected == [128, 96, 96, 64, 16]


def test_a_staged_budget_caps_the_whole_step_and_never_holds_a_decode():
    loop = SchedLoop(colocated(), num_blocks=256, block_size=4, budget=256)
    loop.scheduler.chunks = StagedChunks(low=32, high=128, stages=4, max_tokens=512)  # 128 tokens a stage
    loop.add("a", [1, 2, 3], max_tokens=50)
    loop.step()
    loop.add("b", list(range(500, 1000)), max_tokens=2)
    assert loop.step_ids() == [("a", 1), ("b", 127)]  # stage 0: 128 tokens in the step, a's decode among them
    assert loop.step_ids() == [("a", 1), ("b", 127)]  # 127 computed: still stage 0
    loop.add("c", [7, 8], max_tokens=50)
    # b in stage 1 (96 a step); c's own prompt is in its stage 0, so 128 - 96 tokens are its.
    assert loop.step_ids() == [("a", 1), ("b", 95), ("c", 2)]
    # b (349 computed) in stage 2 (64): a and b spend it; c's decode behind them still runs.
    assert loop.step_ids() == [("a", 1), ("b", 63), ("c", 1)]
def test_fixed_chunks_spend_whatever_budget_is_left():
    fixed = FixedChunks(64)
    loop = SchedLoop(colocated(), num_blocks=64, block_size=4, budget=64)
    loop.scheduler.chunks = fixed
    loop.add("a", list(range(150)), max_tokens=2)
    assert _chunks(loop, "a") == [64, 64, 22]


def test_step_time_model_fits_a_line_and_picks_the_tokens_within_the_target():
    model = StepTimeModel.fit([(64, 0.002 + 64e-5), (128, 0.002 + 128e-5), (256, 0.002 + 256e-5)])
    assert model.base_s == pytest.approx(0.002) and model.per_token_s == pytest.approx(1e-5)
    assert model.tokens_within(0.004, 32, 512) == 200
    assert model.tokens_within(0.001, 32, 512) == 32  # below the floor: a step must progress
    assert model.tokens_within(1.0, 32, 512) == 512


class StepClock:
    """A fake clock that a fake step advances by 5 ms + 0.02 ms per token."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def run(self, out) -> None:
        self.t += 0.005 + 2e-5 * out.num_batched_tokens


def test_profile_times_dummy_steps_and_frees_their_blocks():
    kv, clock = KVCacheManager(64, 16, True), StepClock()
    samples = profile_step_times(clock.run, kv, 512, clock)
    assert [n for n, _ in samples] == [128, 256, 512]
    model = StepTimeModel.fit(samples)
    assert model.base_s == pytest.approx(0.005) and model.per_token_s == pytest.approx(2e-5)
    assert kv.num_free_blocks == 64
    assert all(block.block_hash is None for block in kv.pool.blocks)  # nothing published
    assert TargetStepChunks(model.tokens_within(0.010, 32, 512)).step_tokens(0) == 250


def test_staged_sizes_are_checked_against_the_step_budget():
    EngineConfig(model="m", chunk_schedule="staged", max_num_batched_tokens=512)  # high = 512
    with pytest.raises(ValueError, match="low_chunk_size must be a positive multiple of 32"):
        EngineConfig(model="m", chunk_schedule="staged", low_chunk_size=100)
    with pytest.raises(ValueError, match="high_chunk_size must be a multiple of 32"):
        EngineConfig(model="m", chunk_schedule="staged", high_chunk_size=1024, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="chunk_schedule must be one of"):
        EngineConfig(model="m", chunk_schedule="dynamic")
    EngineConfig(model="m", low_chunk_size=100)  # only the staged schedule reads it
