"""Block pool and KV cache manager: exact block ids, free-queue order, prefix hits, no leaks."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from pdserve.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int], arrival: int = 0) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), arrival, seed=0)


def compute(kv: KVCacheManager, request: Request, num_tokens: int, hit=None) -> list[int] | None:
    """Allocate for `num_tokens` more tokens and mark them computed, as a step would."""
    new = kv.allocate_slots(request, num_tokens, hit)
    if new is not None:
        request.num_computed_tokens += num_tokens + (hit.num_tokens if hit else 0)
        kv.cache_computed_blocks(request)
    return new


def test_allocate_takes_lru_order_and_free_returns_tail_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert pool.num_free_blocks == 2
    pool.free(reversed(a))
    # Freed in reverse: block 1 before block 0, behind the never-used 2 and 3.
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 1, 0]
    assert pool.allocate(1) is None


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError):
        pool.free([block])


def test_hash_chains_over_parents():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == h1
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_prefix_hit_stops_one_token_short_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(12)))
    assert compute(kv, first, 12) == [0, 1, 2]
    kv.free(first)
    assert kv.num_used_blocks == 0

    same = make_request("b", list(range(12)))
    hit = kv.find_prefix_hit(same)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit.
    assert [b.block_id for b in hit.blocks] == [0, 1] and hit.num_tokens == 8
    longer = make_request("c", list(range(13)))
    assert kv.find_prefix_hit(longer).num_tokens == 12
    other = make_request("d", [99] + list(range(1, 12)))
    assert kv.find_prefix_hit(other).num_tokens == 0
    # Looking counts nothing: only the lookup that admits a request does (one that waits is
    # looked up again every step).
    assert (kv.pool.stats.queries, kv.pool.stats.hits) == (0, 0)
    assert kv.allocate_slots(same, 4, hit) == [3]
    assert (kv.pool.stats.queries, kv.pool.stats.hits) == (2, 2)


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    compute(kv, a, 9)
    b = make_request("b", list(range(8)) + [50])
    hit = kv.find_prefix_hit(b)
    assert hit.num_tokens == 8
    new = compute(kv, b, 1, hit)
    assert kv.block_ids("b") == [0, 1] + new
    assert kv.pool.blocks[0].ref_count == 2
    kv.free(a)
    assert kv.pool.blocks[0].ref_count == 1
    kv.free(b)
    assert kv.num_used_blocks == 0
    assert kv.num_free_blocks == 8


def test_cached_free_blocks_are_evicted_lazily():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(kv, a, 5)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 2  # only full blocks are cached
    b = make_request("b", [7, 8, 9, 10, 11])
    assert compute(kv, b, 5) is not None  # takes all three, evicting the cache
    assert kv.pool.num_cached_blocks == 2  # b's own full blocks now
    assert kv.find_prefix_hit(make_request("c", [1, 2, 3, 4, 5])).num_tokens == 0


def test_allocation_refused_when_short_counts_hit_blocks_in_free_queue():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4])
    compute(kv, a, 4)
    kv.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hit = kv.find_prefix_hit(b)
    assert hit.num_tokens == 4
    # 2 hit blocks are free but would be taken; 2 more needed; only 1 other free.
    assert kv.allocate_slots(b, 4, hit) is None
    assert kv.num_used_blocks == 0


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=False)
    a = make_request("a", [1, 2, 3])
    compute(kv, a, 3)
    kv.free(a)
    assert kv.find_prefix_hit(make_request("b", [1, 2, 3])).num_tokens == 0


def test_blocks_are_published_only_once_computed():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)  # reserved, not computed: nothing to find yet
    assert kv.find_prefix_hit(make_request("b", [1, 2, 3, 4, 5])).num_tokens == 0
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    assert kv.find_prefix_hit(make_request("c", [1, 2, 3, 4, 5])).num_tokens == 4


def test_taken_blocks_stay_held_until_freed():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    compute(kv, a, 3)
    blocks = kv.take_blocks(a)
    assert kv.block_ids("a") == [] and kv.num_used_blocks == 2
    kv.pool.free(blocks)
    assert kv.num_used_blocks == 0


def test_blocks_are_made_on_first_use_and_hand_out_in_the_order_of_one_free_queue():
    """The pool makes a block when first taken, yet hands blocks out exactly as one queue of every
    id would: never-used ids in order, then freed blocks oldest first; a touch of a never-used
    block takes it out of turn."""
    rng = random.Random(3)
    pool = BlockPool(12, enable_caching=False)
    queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(12))  # the one-queue model
    held: list[KVBlock] = []
    for _ in range(300):
        op = rng.choice(("allocate", "free", "touch"))
        if op == "allocate":
            num = rng.randint(1, 3)
            got = pool.allocate(num)
            if num > len(queue):
                assert got is None
                continue
            expected = [queue.popitem(last=False)[0] for _ in range(num)]
            assert [b.block_id for b in got] == expected
            held += got
        elif op == "free" and held:
            block = held.pop(rng.randrange(len(held)))
            pool.free([block])
            if block.ref_count == 0:
                queue[block.block_id] = None
        elif op == "touch":
            block = pool.blocks[rng.randrange(12)]
            pool.touch([block])
            queue.pop(block.block_id, None)
            held.append(block)
        assert pool.free_order() == list(queue) and pool.num_free_blocks == len(queue)
    assert len(pool.blocks) == 12 and [b.block_id for b in pool.blocks] == list(range(12))
