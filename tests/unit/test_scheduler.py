"""Scheduler: the token budget, chunked prefill, max_num_seqs, running requests first,
first-come-first-served admission and prefix hits at admission, with exact block ids.

Preemption lives in test_scheduler_preemption.py, the policies' release paths and aborts
in test_scheduler_policies.py, random sequences in test_scheduler_properties.py. Every
step goes through SchedLoop, which checks the block and queue invariants after it.
"""

from __future__ import annotations

from tests.unit.test_scheduler_harness import SchedLoop, colocated, free_queue, ref_counts


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_long_prompt_is_chunked_by_the_budget():
    loop = SchedLoop(colocated(), budget=8)
    loop.add("a", tokens(0, 20))
    assert loop.step_ids() == [("a", 8)]
    assert loop.held("a") == [0, 1]
    assert loop.step_ids() == [("a", 8)]
    assert loop.held("a") == [0, 1, 2, 3]
    assert loop.step_ids() == [("a", 4)]  # the last chunk samples the first token
    assert loop.held("a") == [0, 1, 2, 3, 4]
    assert loop.step_ids() == [("a", 1)]  # then decodes; token 21 opens block 5
    assert loop.held("a") == [0, 1, 2, 3, 4, 5]


def test_running_decodes_go_first_and_prefill_fills_the_rest():
    loop = SchedLoop(colocated(), budget=8)
    loop.add("a", tokens(0, 3))
    loop.step()  # a's prompt done, a is now decoding
    loop.add("b", tokens(100, 30))
    assert loop.step_ids() == [("a", 1), ("b", 7)]


def test_max_num_seqs_bounds_running():
    loop = SchedLoop(colocated(), budget=16, max_seqs=2)
    for i in range(3):
        loop.add(f"r{i}", tokens(10 * i, 2))
    assert loop.step_ids() == [("r0", 2), ("r1", 2)]
    assert [r.req_id for r in loop.scheduler.waiting] == ["r2"]


def test_chunks_share_the_budget_in_arrival_order_and_max_num_seqs_caps_admission():
    loop = SchedLoop(colocated(), num_blocks=16, block_size=4, budget=8, max_seqs=2)
    loop.add("a", tokens(0, 10), max_tokens=2)
    loop.add("b", tokens(100, 3))
    loop.add("c", tokens(200, 2))
    assert loop.step_ids() == [("a", 8)]  # a's first chunk spends the whole budget
    # a's last chunk, then b's whole prompt; 3 tokens of budget are left but c would be
    # a third running request.
    assert loop.step_ids() == [("a", 2), ("b", 3)]
    assert (loop.held("a"), loop.held("b")) == ([0, 1, 2], [3])
    assert loop.step_ids() == [("a", 1), ("b", 1)]  # a samples its second token and ends
    assert free_queue(loop.kv) == tokens(4, 12) + [2, 1, 0]  # a's blocks, tail first, at the back
    assert loop.step_ids() == [("b", 1), ("c", 2)]
    assert (loop.held("b"), loop.held("c")) == ([3, 4], [5])  # never-used blocks go out first


def test_waiting_requests_are_admitted_first_come_first_served():
    loop = SchedLoop(colocated(), num_blocks=5, block_size=4, budget=32)
    loop.add("a", tokens(0, 12))
    loop.step()
    loop.add("b", tokens(100, 8))  # needs 2 blocks
    loop.add("c", tokens(200, 2))  # needs 1 block
    assert loop.step_ids() == [("a", 1)]  # a takes block 3; b does not fit in the one left
    assert free_queue(loop.kv) == [4]
    assert [r.req_id for r in loop.scheduler.waiting] == ["b", "c"]  # c fits but does not overtake b


def test_prefix_hit_skips_cached_tokens():
    loop = SchedLoop(colocated(), budget=32)
    a = loop.add("a", tokens(0, 12))
    loop.step()
    assert loop.held("a") == [0, 1, 2]
    b = loop.add("b", tokens(0, 12))  # same tokens as a
    # 12 tokens are 3 full blocks, but b's last token must be computed: it hits 2 blocks.
    # a's decode goes first and takes block 3.
    assert loop.step_ids() == [("a", 1), ("b", 4)]
    assert loop.held("a") == [0, 1, 2, 3] and loop.held("b") == [0, 1, 4]
    assert ref_counts(loop.kv, [0, 1, 2, 3, 4]) == [2, 2, 1, 1, 1]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0


def test_a_request_scoring_its_prompt_takes_no_prefix_hit():
    loop = SchedLoop(colocated(), budget=32)
    loop.add("a", tokens(0, 12))
    loop.step()
    b = loop.add("b", tokens(0, 12), prompt_logprobs=0)  # a's blocks would cover 8 of its tokens
    assert loop.step_ids() == [("a", 1), ("b", 12)]  # every position computed: its logits score the prompt
    assert loop.held("b") == [4, 5, 6] and b.num_cached_tokens == 0


def test_prefix_hit_lets_a_chunk_start_after_the_cached_blocks():
    loop = SchedLoop(colocated(), budget=8)
    loop.add("a", tokens(0, 16))
    loop.step()
    loop.step()  # a's 16 tokens are 4 cached blocks
    loop.add("b", tokens(0, 16) + tokens(50, 12))
    # b hits 16 tokens and spends the 7 tokens a's decode leaves on its own.
    assert loop.step_ids() == [("a", 1), ("b", 7)]
    assert loop.held("b") == [0, 1, 2, 3, 5, 6]
    assert loop.step_ids() == [("a", 1), ("b", 5)]
