"""Forks share blocks by reference; a shared block is copied only when written (copy-on-write).

Exact block ids, reference counts, copy pairs and the copy counter; every test ends with
zero blocks in use.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.kernels import copy_blocks


def make_request(req_id: str, tokens: list[int], arrival: int = 0) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8), arrival, seed=0)


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> list[int] | None:
    new = kv.allocate_slots(request, num_tokens)
    if new is not None:
        request.num_computed_tokens += num_tokens
        kv.cache_computed_blocks(request)
    return new


def fork_of(parent: Request, req_id: str, token: int) -> Request:
    """What EngineCore.fork builds: the parent's computed tokens, then `token`."""
    computed = parent.token_ids[: parent.num_computed_tokens]
    child = make_request(req_id, parent.prompt_token_ids)
    child.token_ids = [*computed, token]
    child.num_computed_tokens = parent.num_computed_tokens
    return child


def refs(kv: KVCacheManager, req_id: str) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in kv.block_ids(req_id)]


@pytest.mark.parametrize("caching", [True, False])
def test_fork_shares_every_block_and_copies_the_partial_one_on_write(caching):
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=caching)
    parent = make_request("p", list(range(10)))  # 2 full blocks + 2 tokens
    assert compute(kv, parent, 10) == [0, 1, 2]
    child = fork_of(parent, "c", 99)
    kv.fork(parent, child)
    assert kv.block_ids("c") == [0, 1, 2]
    assert refs(kv, "c") == [2, 2, 2]
    assert kv.num_used_blocks == 3 and kv.num_cow_copies == 0
    parent.token_ids.append(42)
    # The parent writes token 10 into block 2, which the child shares: it gets a copy.
    assert compute(kv, parent, 1) == []
    assert kv.block_ids("p") == [0, 1, 3]
    assert kv.take_block_copies() == [(2, 3)]
    assert kv.num_cow_copies == 1
    # Block 2 is the child's alone now: it writes in place.
    assert compute(kv, child, 1) == []
    assert kv.block_ids("c") == [0, 1, 2] and refs(kv, "c") == [2, 2, 1]
    assert kv.take_block_copies() == [] and kv.num_cow_copies == 1
    assert kv.num_used_blocks == 4
    kv.free(child)
    assert kv.num_used_blocks == 3  # the child held block 2 alone
    kv.free(parent)
    assert kv.num_used_blocks == 0


def test_fork_at_a_block_boundary_copies_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(8)))
    compute(kv, parent, 8)
    children = [fork_of(parent, f"c{i}", 50 + i) for i in range(3)]
    for child in children:
        kv.fork(parent, child)
    assert refs(kv, "p") == [4, 4]
    for i, child in enumerate(children):
        assert compute(kv, child, 1) == [2 + i]  # each starts a block of its own
    assert kv.num_cow_copies == 0 and kv.take_block_copies() == []
    assert kv.num_used_blocks == 5
    for child in children:
        kv.free(child)
    assert refs(kv, "p") == [1, 1]
    kv.free(parent)
    assert kv.num_used_blocks == 0


def test_n_forks_of_a_partial_block_copy_all_but_the_last_writer():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    parent.token_ids.append(7)
    children = [fork_of(parent, f"c{i}", 60 + i) for i in range(2)]
    for child in children:
        kv.fork(parent, child)
    assert refs(kv, "p") == [3, 3]
    compute(kv, parent, 1)
    compute(kv, children[0], 1)
    compute(kv, children[1], 1)  # the last one holding block 1 writes it in place
    assert kv.take_block_copies() == [(1, 2), (1, 3)]
    assert [kv.block_ids(r) for r in ("p", "c0", "c1")] == [[0, 2], [0, 3], [0, 1]]
    assert kv.num_cow_copies == 2 and kv.num_used_blocks == 4
    for r in (parent, *children):
        kv.free(r)
    assert kv.num_used_blocks == 0


def test_copy_on_write_needs_a_free_block_and_says_none_without_one():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent = make_request("p", list(range(10)))
    compute(kv, parent, 10)
    child = fork_of(parent, "c", 1)
    kv.fork(parent, child)
    parent.token_ids.append(5)
    assert kv.allocate_slots(parent, 1) is None  # the copy would need a 4th block
    assert kv.num_cow_copies == 0 and kv.block_ids("p") == [0, 1, 2]
    kv.free(child)
    kv.free(parent)
    assert kv.num_used_blocks == 0


def test_a_copy_for_a_request_freed_in_the_same_step_is_dropped():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", list(range(6)))
    compute(kv, parent, 6)
    child = fork_of(parent, "c", 1)
    kv.fork(parent, child)
    kv.allocate_slots(child, 1)
    kv.free(child)  # preempted before the step ran
    assert kv.take_block_copies() == []
    kv.free(parent)
    assert kv.num_used_blocks == 0


def test_scheduler_hands_the_step_its_copies():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=4)
    parent = make_request("p", list(range(6)))
    sched.add(parent)
    out = sched.schedule()
    assert out.block_copies == []
    sched.update_after_step(out)
    parent.token_ids.append(9)
    child = fork_of(parent, "c", 8)
    child.arrival_index = 1
    kv.fork(parent, child)
    sched.add(child)
    out = sched.schedule()
    assert [s.request.req_id for s in out.scheduled] == ["p", "c"]
    assert out.block_copies == [(1, 2)]
    sched.update_after_step(out)
    sched.finish(parent)
    sched.finish(child)
    assert kv.num_used_blocks == 0


def test_copy_blocks_copies_every_layer_keys_and_values():
    k = [torch.arange(4 * 2 * 3 * 1, dtype=torch.float32).view(4, 2, 3, 1) + 100 * layer for layer in range(2)]
    v = [t.neg() for t in k]
    before_k = [t.clone() for t in k]
    copy_blocks((*k, *v), (*k, *v), [(1, 3), (0, 2)])
    for layer in range(2):
        assert torch.equal(k[layer][3], before_k[layer][1]) and torch.equal(k[layer][2], before_k[layer][0])
        assert torch.equal(v[layer][3], -before_k[layer][1])
        assert torch.equal(k[layer][:2], before_k[layer][:2])
