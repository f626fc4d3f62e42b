"""Admission of new prompts: the watermark (blocks a new prompt must leave free while others
run) and the delay factor (vLLM v0's _passed_delay), with a fake clock and exact block counts.
SchedLoop checks the block and queue invariants after every step."""

from __future__ import annotations

from pdserve.engine.prompt_admission import PromptAdmission, watermark_blocks
from tests.unit.test_scheduler_harness import SchedLoop, colocated


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_watermark_blocks_round_down_like_vllm():
    assert watermark_blocks(0.01, 100) == 1
    assert watermark_blocks(0.01, 16) == 0  # a tiny pool keeps none
    assert watermark_blocks(0.1, 20) == 2
    assert watermark_blocks(0.0, 10_000) == 0


def _three_requests(keep: int) -> SchedLoop:
    """a (8 blocks) then b (9 blocks) run on a 20-block pool; c (1 block) arrives when a's
    and b's decodes leave 1 block free."""
    loop = SchedLoop(colocated(), num_blocks=20, block_size=4, budget=64, admission=PromptAdmission(keep))
    loop.add("a", tokens(0, 31), max_tokens=8)
    assert loop.step_ids() == [("a", 31)]
    loop.add("b", tokens(100, 36), max_tokens=8)
    assert loop.step_ids() == [("a", 1), ("b", 36)]  # 12 free - 9 = 3 >= 2: admitted
    assert loop.kv.num_free_blocks == 3
    loop.add("c", tokens(200, 4), max_tokens=8)
    return loop


def test_a_new_prompt_that_would_leave_fewer_than_the_watermark_free_waits():
    loop = _three_requests(keep=2)
    # a's 33rd token and b's 38th each open a block: 1 left, and c would leave 0 < 2.
    assert loop.step_ids() == [("a", 1), ("b", 1)]
    assert loop.kv.num_free_blocks == 1
    assert [r.req_id for r in loop.scheduler.waiting] == ["c"]


def test_without_a_watermark_the_same_prompt_takes_the_last_block():
    loop = _three_requests(keep=0)
    assert loop.step_ids() == [("a", 1), ("b", 1), ("c", 4)]
    assert loop.kv.num_free_blocks == 0


def test_the_watermark_does_not_hold_a_prompt_when_nothing_runs():
    loop = SchedLoop(colocated(), num_blocks=8, block_size=4, budget=64, admission=PromptAdmission(2))
    loop.add("a", tokens(0, 28), max_tokens=2)
    assert loop.step_ids() == [("a", 28)]  # 7 of 8 blocks: nothing runs to be preempted
    assert loop.kv.num_free_blocks == 1


def test_running_chunks_and_imported_requests_are_not_held_to_the_watermark():
    loop = SchedLoop(colocated(), num_blocks=16, block_size=4, budget=16, admission=PromptAdmission(6))
    loop.add("a", tokens(0, 40), max_tokens=8)
    assert [loop.step_ids() for _ in range(3)] == [[("a", 16)], [("a", 16)], [("a", 8)]]
    assert loop.kv.num_free_blocks == 6
    # A decode node's import joins with its KV computed: it takes its decode block past the watermark.
    loop.reserve("d", tokens(500, 12))  # 3 blocks
    loop.arrive("d")  # token 1 is its 13th: its decode opens a 4th block, as a's 41st token opens its 11th
    assert loop.step_ids() == [("a", 1), ("d", 1)]
    assert loop.kv.num_free_blocks == 1


def _delayed(clock: FakeClock) -> SchedLoop:
    return SchedLoop(colocated(), num_blocks=32, block_size=4, budget=64,
                     admission=PromptAdmission(delay_factor=2.0, clock=clock))


def test_delay_factor_holds_new_prompts_until_the_earliest_waited_its_factor_times_the_last_prompt_step():
    clock = FakeClock()
    loop = _delayed(clock)
    loop.add("a", tokens(0, 5), max_tokens=16)
    assert loop.step_ids() == [("a", 5)]  # nothing runs: no delay
    clock.t = 0.5
    loop.add("b", tokens(100, 5))
    # The step that admitted a took 0.5 s: b waits until it has waited more than 2 × 0.5 s.
    assert loop.step_ids() == [("a", 1)]
    assert loop.scheduler.admission.last_prompt_latency == 0.5
    for t in (1.0, 1.4, 1.5):  # 1.5 - 0.5 = 1.0 is not more than 1.0
        clock.t = t
        assert loop.step_ids() == [("a", 1)]
    clock.t = 1.6
    loop.add("c", tokens(200, 5))  # arrives now; b's wait admits both in one step
    assert loop.step_ids() == [("a", 1), ("b", 5), ("c", 5)]
    clock.t = 1.9
    loop.step()
    assert abs(loop.scheduler.admission.last_prompt_latency - 0.3) < 1e-12


def test_delay_factor_never_holds_a_prompt_when_nothing_runs():
    clock = FakeClock()
    loop = _delayed(clock)
    loop.add("a", tokens(0, 5), max_tokens=1)
    clock.t = 10.0
    assert loop.step_ids() == [("a", 5)]  # a ends at its first token
    clock.t = 10.1
    loop.add("b", tokens(100, 5))
    assert loop.step_ids() == [("b", 5)]  # last prompt step 0.1 s, b waited 0, yet nothing runs
