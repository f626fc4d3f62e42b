"""Preemption by swap: a victim's computed blocks go to the host swap space and come back,
unchanged, when the device pool has room; recompute when asked, or when the swap space is
full. Exact block ids and counts in both pools after every step, on tiny pools; SchedLoop
makes the swap copies as the model runner does and checks that every swapped request's
host blocks, and every running request's device blocks, hold exactly its own KV.
"""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.preemption import AutoPreemption, RecomputePreemption, SwapPreemption, preemption_policy_for
from pdserve.engine.request import RequestStatus
from pdserve.engine.swap_space import SwapSpace, swap_blocks_for
from tests.unit.test_scheduler_harness import SchedLoop, colocated, free_queue, ref_counts
from tests.unit.test_scheduler_properties import POLICIES, apply, scenarios


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def pools_used(loop: SchedLoop) -> tuple[int, int]:
    """(device blocks in use, host blocks in use)."""
    return loop.kv.num_used_blocks, loop.swap.num_used_blocks


def two_requests(preemption, num_blocks: int = 4, caching: bool = False, a_tokens: int = 3) -> SchedLoop:
    """4 device blocks of 4 tokens; a and b (8 prompt tokens) take 2 each: the pool is full after
    their prefill, and a's 9th token preempts b next step."""
    loop = SchedLoop(colocated(), num_blocks=num_blocks, block_size=4, budget=16, caching=caching,
                     preemption=preemption)
    loop.add("a", tokens(0, 8), max_tokens=a_tokens)
    loop.add("b", tokens(50, 8), max_tokens=4)
    loop.step()
    return loop


def test_swap_out_copies_the_victims_blocks_to_host_and_frees_them_tail_first():
    loop = two_requests(SwapPreemption(SwapSpace(4)))
    b = loop.live["b"]
    out = loop.step()
    assert [r.req_id for r in out.preempted] == ["b"]
    assert out.swap_out == [(2, 0), (3, 1)] and out.swap_in == []
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1)]
    # b keeps its work: 8 computed tokens, in host blocks 0 and 1.
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 8 and b.num_preemptions == 1
    assert loop.held("b") == [] and loop.swap.block_ids("b") == [0, 1]
    assert loop.held("a") == [0, 1, 3] and free_queue(loop.kv) == [2]
    assert pools_used(loop) == (3, 2)
    assert loop.scheduler.num_preemptions == 1 and loop.scheduler.num_swaps_out == 1
    assert list(loop.scheduler.waiting) == [] and loop.scheduler.swapped == [b]


def test_swapped_request_comes_back_when_blocks_free_and_runs_in_the_same_step():
    loop = two_requests(SwapPreemption(SwapSpace(4)))
    b = loop.live["b"]
    loop.step()  # b swapped out; a: 10 tokens
    assert loop.step_ids() == [("a", 1)]  # b needs 3 blocks, 1 is free: it stays out
    # a finished at its 3rd token: its blocks 0, 1, 3 went back tail first after the free 2.
    assert loop.finished[-1].req_id == "a" and pools_used(loop) == (0, 2)
    out = loop.step()
    assert out.swap_in == [(0, 2), (1, 3)] and out.swap_out == []
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("b", 1)]
    assert loop.held("b") == [2, 3, 1] and b.status is RequestStatus.RUNNING
    assert pools_used(loop) == (3, 0) and loop.scheduler.num_swaps_in == 1
    assert b.num_computed_tokens == 9  # nothing recomputed: 8 swapped back + this step's 1
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)
    assert [r.req_id for r in loop.finished] == ["a", "b"]


def test_recompute_leaves_the_swap_space_alone():
    loop = two_requests(RecomputePreemption(SwapSpace(4)))
    b = loop.live["b"]
    out = loop.step()
    assert out.preempted == [b] and out.swap_out == []
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert pools_used(loop) == (3, 0) and loop.scheduler.num_swaps_out == 0
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)


def test_auto_swaps_when_the_swap_space_holds_the_victim_and_recomputes_otherwise():
    swapping = two_requests(AutoPreemption(SwapSpace(2)))
    assert swapping.step().swap_out == [(2, 0), (3, 1)]
    assert pools_used(swapping) == (3, 2)
    swapping.run_to_completion()
    assert pools_used(swapping) == (0, 0)

    short = two_requests(AutoPreemption(SwapSpace(1)))  # b's 2 blocks do not fit
    out = short.step()
    assert out.swap_out == [] and short.live["b"].status is RequestStatus.WAITING
    assert pools_used(short) == (3, 0)
    short.run_to_completion()
    assert pools_used(short) == (0, 0)


def test_auto_without_swap_space_recomputes():
    loop = two_requests(preemption_policy_for("auto", SwapSpace(0)))
    out = loop.step()
    assert out.swap_out == [] and loop.live["b"].num_computed_tokens == 0


def test_swap_mode_recomputes_with_a_warning_when_the_swap_space_is_full(caplog):
    loop = two_requests(SwapPreemption(SwapSpace(1)))
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.preemption"):
        out = loop.step()
    assert out.swap_out == [] and loop.live["b"].status is RequestStatus.WAITING
    assert "request b: 2 blocks do not fit the swap space (1 of 1 free" in caplog.text
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)


def test_request_preempting_itself_swaps_out_and_the_step_runs_nothing():
    loop = SchedLoop(colocated(), num_blocks=2, block_size=4, budget=16, caching=False,
                     preemption=SwapPreemption(SwapSpace(2)))
    only = loop.add("a", tokens(0, 7), max_tokens=4)
    loop.step()  # 7 prompt tokens computed, token 8 sampled: both blocks full once it is computed
    loop.step()  # token 8 computed, token 9 sampled; its KV needs a third block
    loop.add("later", tokens(100, 1))
    out = loop.step()
    assert out.preempted == [only] and out.scheduled == [] and out.swap_out == [(0, 0), (1, 1)]
    assert pools_used(loop) == (0, 2)
    # a arrived first and cannot come back: "later" is not admitted ahead of it.
    assert loop.step_ids() == [] and loop.scheduler.waiting[0].req_id == "later"
    loop.abort("a")
    assert pools_used(loop) == (0, 0) and loop.step_ids() == [("later", 1)]


def test_swapping_out_a_request_that_shares_a_prefix_keeps_the_shared_block_for_the_other():
    # a and b share their first block (tokens 0-3) through the prefix cache.
    loop = SchedLoop(colocated(), num_blocks=4, block_size=4, budget=16, caching=True,
                     preemption=SwapPreemption(SwapSpace(4)))
    loop.add("a", tokens(0, 8), max_tokens=8)
    loop.step()
    loop.add("b", tokens(0, 4) + tokens(60, 4), max_tokens=3)
    loop.step()  # a opens block 2 for its 9th token; b hits block 0 and takes block 3
    assert (loop.held("a"), loop.held("b")) == ([0, 1, 2], [0, 3]) and ref_counts(loop.kv, [0]) == [2]
    out = loop.step()  # b's 9th token needs a block: b, the latest, preempts itself
    assert [r.req_id for r in out.preempted] == ["b"]
    # b's copy holds both of its blocks, the shared one included; block 0 stays a's, referenced once.
    assert out.swap_out == [(0, 0), (3, 1)] and ref_counts(loop.kv, [0, 1, 2, 3]) == [1, 1, 1, 0]
    assert pools_used(loop) == (3, 2)
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)


def test_aborting_a_swapped_request_frees_its_host_blocks():
    loop = two_requests(SwapPreemption(SwapSpace(4)), a_tokens=8)
    loop.step()
    assert pools_used(loop) == (3, 2)
    loop.abort("b")
    assert pools_used(loop) == (3, 0) and loop.scheduler.swapped == []
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)


def test_prefilled_waiting_holder_swaps_out_when_nothing_runs():
    # The decode-node case: both prefilled requests wait holding 2 blocks each; w1's token 1
    # needs a third block and nothing runs, so w2 gives its blocks up: swapped, not recomputed.
    loop = SchedLoop(colocated(), num_blocks=4, block_size=4, budget=16, preemption=SwapPreemption(SwapSpace(2)))
    loop.reserve("w1", tokens(0, 8), max_tokens=8)
    loop.reserve("w2", tokens(50, 8), max_tokens=8)
    loop.arrive("w1")
    w2 = loop.arrive("w2")
    out = loop.step()
    assert out.preempted == [w2] and out.swap_out == [(2, 0), (3, 1)] and not out.scheduled
    assert w2.num_computed_tokens == 8 and pools_used(loop) == (2, 2)
    assert loop.step_ids() == [("w1", 1)]
    loop.run_to_completion()
    assert pools_used(loop) == (0, 0)
    assert w2.num_preemptions == 1 and loop.scheduler.num_swaps_in == 1


def test_swap_blocks_for_counts_whole_device_blocks():
    assert swap_blocks_for(10_000, 4096) == 2 and swap_blocks_for(0, 4096) == 0


MODES = {"swap": SwapPreemption, "auto": AutoPreemption, "recompute": RecomputePreemption}


@settings(max_examples=200, deadline=None)
@given(scenario=scenarios(), mode=st.sampled_from(sorted(MODES)), num_swap_blocks=st.integers(0, 10))
def test_random_sequences_under_swap_drain_both_pools(scenario, mode, num_swap_blocks):
    policy, pool, ops = scenario
    setup = POLICIES[policy]()
    loop = SchedLoop(setup, **pool, preemption=MODES[mode](SwapSpace(num_swap_blocks)))
    num_added = 0
    for op in ops:
        num_added = apply(loop, setup, op, num_added)
    loop.run_to_completion()
    assert not loop.live and not loop.exports
    assert pools_used(loop) == (0, 0) and loop.swap.num_free_blocks == num_swap_blocks
    assert loop.scheduler.num_swaps_in <= loop.scheduler.num_swaps_out  # the rest were aborted while out
    assert len(loop.finished) + len(loop.aborted) == num_added
