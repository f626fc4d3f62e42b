"""The policies' release paths and aborts: a colocated request's blocks are freed when it
ends; a prefill request ends at token 1 and its blocks are handed over, still held, until
the exporter frees them; an aborted request, wherever it was, ends up holding nothing.
Exact block ids and free-queue order; SchedLoop checks the invariants after every step.
"""

from __future__ import annotations

from pdserve.engine.request import FinishReason, RequestStatus
from tests.unit.test_scheduler_harness import SchedLoop, colocated, free_queue, prefill, ref_counts


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_colocated_finish_frees_blocks_tail_first_and_keeps_them_cached():
    loop = SchedLoop(colocated(), num_blocks=16, block_size=4, budget=16)
    a = loop.add("a", tokens(0, 9), max_tokens=2)
    loop.step()
    loop.step()  # a's second token ends it
    assert a.finish_reason is FinishReason.LENGTH and not loop.scheduler.has_unfinished()
    assert loop.kv.num_used_blocks == 0
    assert free_queue(loop.kv) == tokens(3, 13) + [2, 1, 0]
    # Its two full blocks can still be found; the new request's own block is the queue's head.
    loop.add("b", tokens(0, 9))
    assert loop.step_ids() == [("b", 1)]
    assert loop.held("b") == [0, 1, 3]


def test_prefill_request_ends_at_token_1_and_hands_its_blocks_over_still_held():
    loop = SchedLoop(prefill(), num_blocks=16, block_size=4, budget=16)
    a = loop.add("a", tokens(0, 6))
    b = loop.add("b", tokens(50, 3))
    assert loop.step_ids() == [("a", 6), ("b", 3)]
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 1)
    assert a.status is RequestStatus.HANDED_OFF and a.finish_reason is None  # handed off, not finished
    assert not loop.scheduler.has_unfinished()
    # Handed over in the order they ended, with the ids the decode node's copy follows.
    assert [(req_id, [blk.block_id for blk in blocks]) for req_id, (_, blocks) in loop.exports.items()] == [
        ("a", [0, 1]), ("b", [2])]
    assert loop.held("a") == [] and loop.kv.num_used_blocks == 3
    assert ref_counts(loop.kv, [0, 1, 2]) == [1, 1, 1]
    assert free_queue(loop.kv) == tokens(3, 13)
    loop.free_exports(["b"])
    loop.free_exports(["a"])
    assert free_queue(loop.kv) == tokens(3, 13) + [2, 1, 0]


def test_prefill_request_hits_blocks_still_being_exported_and_keeps_them_after():
    loop = SchedLoop(prefill(), num_blocks=16, block_size=4, budget=16)
    loop.add("a", tokens(0, 9))
    loop.step()  # a's blocks [0, 1, 2] go to the exporter; 0 and 1 are full, hence cached
    loop.add("b", tokens(0, 9))
    assert loop.step_ids() == [("b", 1)]  # b hits 8 tokens held by the export
    assert [blk.block_id for blk in loop.exports["b"][1]] == [0, 1, 3]
    assert ref_counts(loop.kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    loop.free_exports(["a"])
    assert ref_counts(loop.kv, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert free_queue(loop.kv) == tokens(4, 12) + [2]
    loop.free_exports(["b"])
    assert free_queue(loop.kv) == tokens(4, 12) + [2, 3, 1, 0]


def test_prefill_abort_mid_prompt_hands_the_blocks_over_too():
    loop = SchedLoop(prefill(), num_blocks=8, block_size=4, budget=4)
    loop.add("a", tokens(0, 10))
    loop.step()
    loop.step()
    assert loop.held("a") == [0, 1]
    loop.abort("a")
    # A push may still read them: the exporter, not the scheduler, frees them.
    assert [blk.block_id for blk in loop.exports["a"][1]] == [0, 1] and loop.kv.num_used_blocks == 2
    loop.free_exports()
    assert loop.kv.num_used_blocks == 0 and free_queue(loop.kv) == tokens(2, 6) + [1, 0]


def test_colocated_aborts_of_running_preempted_and_waiting_requests_leave_no_block_held():
    # Blocks of 2 tokens. b shares a's first block; then b is preempted at its 5th token.
    loop = SchedLoop(colocated(), num_blocks=4, block_size=2, budget=16)
    loop.add("a", [1, 2, 3])
    loop.step()  # a: [0, 1]
    loop.add("b", [1, 2, 9])
    loop.add("c", [5, 6, 7, 8, 9, 10])  # 3 blocks: never fits beside a
    assert loop.step_ids() == [("a", 1), ("b", 1)]
    assert loop.held("b") == [0, 2] and ref_counts(loop.kv, [0]) == [2]
    loop.step()  # a opens block 3
    loop.step()  # b's 5th token needs a third block: b is the latest, so it preempts itself
    assert [r.req_id for r in loop.scheduler.waiting] == ["b", "c"]
    assert loop.held("a") == [0, 1, 3] and ref_counts(loop.kv, [0, 2]) == [1, 0]
    loop.abort("b")  # preempted: holds nothing, and a's shared block keeps its reference
    assert loop.kv.num_used_blocks == 3 and ref_counts(loop.kv, [0]) == [1]
    loop.abort("c")  # never admitted
    assert loop.kv.num_used_blocks == 3
    loop.abort("a")  # running
    assert loop.kv.num_used_blocks == 0 and not loop.scheduler.has_unfinished()
    assert free_queue(loop.kv) == [2, 3, 1, 0]


def test_prefill_aborts_while_exports_hold_the_pool_leave_no_block_held():
    loop = SchedLoop(prefill(), num_blocks=3, block_size=4, budget=4)
    loop.add("a", tokens(0, 4))
    loop.step()  # a's block 0 goes to the exporter
    loop.add("b", tokens(50, 12))
    loop.add("c", tokens(80, 2))
    loop.step()
    loop.step()  # b's first two chunks take blocks 1 and 2
    out = loop.step()  # b's third chunk needs a block the export still holds
    assert [r.req_id for r in out.preempted] == ["b"]
    assert [r.req_id for r in loop.scheduler.waiting] == ["b", "c"]
    loop.abort("b")
    loop.abort("c")
    assert list(loop.exports) == ["a", "b", "c"]  # the two aborted hand over no blocks
    assert [len(blocks) for _, blocks in loop.exports.values()] == [1, 0, 0]
    loop.free_exports()
    assert loop.kv.num_used_blocks == 0 and not loop.scheduler.has_unfinished()
