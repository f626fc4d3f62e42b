"""Preemption (recompute): who is the victim, which blocks go back to the free queue and
in what order, what the victim keeps of its work through the prefix cache, and that a step
which preempted admits nobody. Exact block ids on tiny pools; SchedLoop checks the block
and queue invariants after every step.
"""

from __future__ import annotations


from pdserve.engine.request import RequestStatus
from tests.unit.test_scheduler_harness import SchedLoop, colocated, free_queue, ref_counts


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def waiting_ids(loop: SchedLoop) -> list[str]:
    return [r.req_id for r in loop.scheduler.waiting]


def test_preemption_victim_is_the_latest_arrival_and_its_tail_block_is_reused_first():
    # 4 blocks of 4 tokens; two requests of 8 prompt tokens take 2 blocks each.
    loop = SchedLoop(colocated(), num_blocks=4, block_size=4, budget=16, caching=False)
    loop.add("a", tokens(0, 8))
    second = loop.add("b", tokens(50, 8))
    loop.step()  # both prefilled: 9 tokens each now, 2 blocks each, pool full
    out = loop.step()  # a needs a third block for token 9: b is preempted
    assert [r.req_id for r in out.preempted] == ["b"]
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1)]
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert second.num_preemptions == 1 and loop.scheduler.num_preemptions == 1
    # b's blocks went back tail first, so a took b's last block (3) and block 2 is next.
    assert loop.held("a") == [0, 1, 3] and loop.held("b") == []
    assert free_queue(loop.kv) == [2]
    assert waiting_ids(loop) == ["b"]


def test_request_preempting_itself_waits_at_the_front():
    loop = SchedLoop(colocated(), num_blocks=2, block_size=4, budget=16, caching=False)
    only = loop.add("a", tokens(0, 8))
    loop.add("later", tokens(100, 1))
    loop.step()  # a: 9 tokens now, needs a third block that does not exist
    out = loop.step()
    assert out.preempted == [only] and out.scheduled == []
    assert waiting_ids(loop) == ["a", "later"]
    assert loop.kv.num_used_blocks == 0 and free_queue(loop.kv) == [1, 0]


def test_each_request_short_of_a_block_preempts_the_latest_arrival_still_running():
    # Blocks of 2 tokens: a, b hold 2 blocks each, c, d one each; the pool is full.
    loop = SchedLoop(colocated(), num_blocks=6, block_size=2, budget=16, caching=False)
    loop.add("a", tokens(0, 3))
    loop.add("b", tokens(10, 3))
    c = loop.add("c", tokens(20, 1))
    d = loop.add("d", tokens(30, 1))
    loop.step()
    loop.step()
    assert [loop.held(r) for r in "abcd"] == [[0, 1], [2, 3], [4], [5]]
    out = loop.step()  # a and b each open a third block; c and d each fill their first
    # a goes first: d (latest) is preempted and a takes its block; then b: c is preempted.
    assert [r.req_id for r in out.preempted] == ["d", "c"]
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert loop.held("a") == [0, 1, 5] and loop.held("b") == [2, 3, 4]
    assert waiting_ids(loop) == ["c", "d"]  # back in arrival order, ahead of any newcomer
    assert (c.num_computed_tokens, d.num_computed_tokens) == (0, 0)
    assert loop.scheduler.num_preemptions == 2


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    loop = SchedLoop(colocated(), num_blocks=5, block_size=4, budget=9, caching=False)
    loop.add("a", tokens(0, 8))
    loop.add("b", tokens(50, 8))
    assert loop.step_ids() == [("a", 8), ("b", 1)]
    assert loop.step_ids() == [("a", 1), ("b", 7)]
    loop.add("c", tokens(100, 2))
    assert (loop.held("a"), loop.held("b")) == ([0, 1, 3], [2, 4]) and loop.kv.num_free_blocks == 0
    out = loop.step()  # b's 9th token needs a third block: b preempts itself
    assert [r.req_id for r in out.preempted] == ["b"]
    # What b gives back would take b's own first 8-token chunk (8 of the budget are left),
    # or c; neither is admitted in this step.
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1)]
    assert free_queue(loop.kv) == [4, 2]
    assert waiting_ids(loop) == ["b", "c"]
    assert loop.step_ids() == [("a", 1), ("b", 8)]  # the next step does admit b


def preempted_while_sharing_a_prefix() -> SchedLoop:
    """a (8-token prompt, 10 tokens to generate) and b (a's prompt + 4 tokens) share a's
    two prompt blocks; on 6 blocks of 4 tokens b runs out of room at its 17th token."""
    loop = SchedLoop(colocated(), num_blocks=6, block_size=4, budget=16)
    loop.add("a", tokens(0, 8), max_tokens=10)
    loop.step()
    loop.add("b", tokens(0, 8) + tokens(100, 4))
    assert loop.step_ids() == [("a", 1), ("b", 4)]  # b hits a's blocks 0 and 1
    assert loop.held("b") == [0, 1, 3] and ref_counts(loop.kv, [0, 1]) == [2, 2]
    for _ in range(4):
        loop.step()
    assert loop.held("a") == [0, 1, 2, 5] and loop.held("b") == [0, 1, 3, 4]
    assert loop.kv.num_free_blocks == 0
    return loop


def test_preempting_a_request_that_shares_a_prefix_frees_only_its_own_blocks_tail_first():
    loop = preempted_while_sharing_a_prefix()
    b = loop.live["b"]
    out = loop.step()  # b's 17th token needs a fifth block: b is the latest, so it goes
    assert [r.req_id for r in out.preempted] == ["b"]
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1)]
    assert loop.held("b") == [] and b.num_computed_tokens == 0 and b.num_tokens == 17
    assert ref_counts(loop.kv, [0, 1, 3, 4]) == [1, 1, 0, 0]  # a still holds the shared blocks
    assert free_queue(loop.kv) == [4, 3]  # b's private blocks, tail first
    assert waiting_ids(loop) == ["b"]


def test_preempted_request_resumes_after_what_the_prefix_cache_still_holds_of_it():
    loop = preempted_while_sharing_a_prefix()
    loop.step()  # b preempted; its blocks 3 and 4 are free but still cached
    # All 16 of b's full-block tokens are cached, but taking blocks 3 and 4 out of the free
    # queue and one more for token 17 needs 3 free blocks: there are 2. b waits.
    assert loop.step_ids() == [("a", 1)]
    assert loop.step_ids() == [("a", 1)]
    # a's 17th token takes block 4 (the free queue's head), evicting b's fourth block;
    # a samples its 10th token and ends, its blocks going back tail first.
    assert loop.step_ids() == [("a", 1)]
    assert "a" not in loop.live
    assert free_queue(loop.kv) == [3, 4, 5, 2, 1, 0]
    # b hits blocks 0, 1 and 3 (12 tokens) and recomputes only tokens 13..17.
    assert loop.step_ids() == [("b", 5)]
    assert loop.held("b") == [0, 1, 3, 4, 5]
    assert free_queue(loop.kv) == [2]


def test_decode_node_running_order_is_arrival_order_whenever_the_kv_arrives():
    # A decode node's request arrives at reservation; its KV may land after later ones'.
    loop = SchedLoop(colocated(), num_blocks=8, block_size=4, budget=16, caching=False)
    loop.reserve("x", tokens(0, 6))
    loop.reserve("y", tokens(10, 2))
    loop.reserve("z", tokens(20, 2))
    loop.arrive("y")
    loop.arrive("z")
    assert loop.step_ids() == [("y", 1), ("z", 1)]
    loop.arrive("x")
    assert loop.step_ids() == [("y", 1), ("z", 1), ("x", 1)]  # running first, then admissions
    assert loop.step_ids() == [("x", 1), ("y", 1), ("z", 1)]  # then x in its arrival place


def test_victim_is_never_a_request_already_scheduled_in_the_step():
    # x (earliest) runs first; y then needs a block and the latest, z, is the victim.
    loop = SchedLoop(colocated(), num_blocks=5, block_size=4, budget=16, caching=False)
    loop.reserve("x", tokens(0, 7))
    loop.reserve("y", tokens(10, 3))
    loop.reserve("z", tokens(20, 3))
    for req_id in "xyz":
        loop.arrive(req_id)
    assert loop.step_ids() == [("x", 1), ("y", 1), ("z", 1)]  # each fills its last prompt block
    assert loop.held("x") == [0, 1] and free_queue(loop.kv) == [4]
    out = loop.step()  # x opens block 4, the last free one; y must take z's
    assert [r.req_id for r in out.preempted] == ["z"]
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("x", 1), ("y", 1)]
    assert loop.held("x") == [0, 1, 4] and loop.held("y") == [2, 3]


# A decode node's prefilled requests wait holding their prompt blocks: when the waiting head
# cannot get its blocks and nothing runs, the latest waiting holder gives its blocks up.


def test_prefilled_requests_that_fill_the_pool_still_run():
    # Each prompt is 2 full blocks and each request fits the 4-block pool on its own
    # (8 + 8 tokens); together their reservations fill it, and token 1 needs a third block.
    loop = SchedLoop(colocated(), num_blocks=4, block_size=4, budget=16)
    loop.reserve("w1", tokens(0, 8), max_tokens=8)
    loop.reserve("w2", tokens(50, 8), max_tokens=8)
    loop.arrive("w1")
    loop.arrive("w2")
    out = loop.step()  # w1 needs a third block and nothing runs: w2 gives its two up
    assert [r.req_id for r in out.preempted] == ["w2"] and not out.scheduled
    assert loop.held("w2") == [] and loop.kv.num_free_blocks == 2
    assert loop.step_ids() == [("w1", 1)]  # admitted, no other block taken from anyone
    loop.run_to_completion()


def test_request_preempted_ahead_of_a_prefilled_one_still_runs():
    loop = SchedLoop(colocated(), num_blocks=4, block_size=4, budget=16)
    loop.reserve("r", tokens(0, 4), max_tokens=12)
    loop.arrive("r")
    loop.step()  # r decodes in blocks 0 and 1
    loop.reserve("w", tokens(50, 8), max_tokens=8)  # blocks 2 and 3: the pool is full
    loop.arrive("w")  # w's token 1 needs a third block: w waits, holding two
    loop.run_to_completion()  # r preempts itself at its 9th token and queues ahead of w
