"""Placement policies as pure objects: decode by free blocks after reservations, prefill by
queued tokens with prefix affinity."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import hash_block_tokens
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.cluster.placement import (
    MAX_UPDATES_UNSHOWN, Candidate, ColocatedPlacement, DecodePlacement, PlacementStamps, PrefillPlacement,
)
from pdserve.router.cluster.prefix_affinity import PrefixAffinity, prefix_hashes

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def node(node_id: str, seq: int = 1, free: int = 0, queued: int = 0, placed: int | None = None) -> Candidate:
    """`placed`: the highest placement stamp the stats show; None: stats that show all sent before them."""
    return Candidate(node_id, seq, free, queued, placed)


def ids_of(ranked: list[Candidate]) -> list[str]:
    return [c.node_id for c in ranked]


# -- decode ---------------------------------------------------------------------------


def test_decode_ranks_by_free_blocks_then_id():
    placement = DecodePlacement(exhausted_cooldown_s=1.0)
    ranked = placement.rank([node("a", free=10), node("b", free=30), node("c", free=30)])
    assert ids_of(ranked) == ["b", "c", "a"]


def test_decode_counts_its_own_reservations_until_fresh_stats():
    placement = DecodePlacement(exhausted_cooldown_s=1.0)
    a, b = node("a", free=30), node("b", free=20)
    placement.reserve(a, 1, 15)
    assert placement.free_after_reservations(a) == 15
    assert ids_of(placement.rank([a, b])) == ["b", "a"]
    placement.reserve(a, 1, -15)  # given back (refused or failed)
    assert ids_of(placement.rank([a, b])) == ["a", "b"]
    placement.reserve(a, 2, 15)
    fresh_a = node("a", seq=2, free=15)  # the node's stats now include the reservation
    assert placement.free_after_reservations(fresh_a) == 15
    assert ids_of(placement.rank([fresh_a, b])) == ["b", "a"]


def test_decode_counts_a_reservation_until_stats_show_its_stamp_not_merely_newer_stats():
    """A heartbeat can carry a snapshot the core took before the request reached it: newer stats
    that do not name the request's stamp leave the router's count in place."""
    placement = DecodePlacement(exhausted_cooldown_s=1.0)
    placement.reserve(node("a", seq=1, free=30, placed=0), 500, 15)
    older_snapshot = node("a", seq=2, free=30, placed=499)
    assert placement.free_after_reservations(older_snapshot) == 15
    assert placement.free_after_reservations(node("a", seq=3, free=15, placed=500)) == 15  # shown: counted once
    assert placement.free_after_reservations(node("a", seq=4, free=30, placed=499)) == 30  # and never again


def test_a_reservation_no_stats_ever_show_counts_no_longer_than_its_bound():
    placement = DecodePlacement(exhausted_cooldown_s=1.0)
    placement.reserve(node("a", seq=1, free=30, placed=0), 500, 15)
    assert placement.free_after_reservations(node("a", seq=1 + MAX_UPDATES_UNSHOWN, free=30, placed=0)) == 15
    assert placement.free_after_reservations(node("a", seq=2 + MAX_UPDATES_UNSHOWN, free=30, placed=0)) == 30


def test_placement_stamps_increase_and_start_from_the_clock():
    clock = iter([1000, 1000, 999, 5000])
    stamps = PlacementStamps(clock=lambda: next(clock))
    assert [stamps.next() for _ in range(4)] == [1000, 1001, 1002, 5000]


def test_decode_skips_a_refusing_node_until_new_stats_or_cooldown():
    clock = Clock()
    placement = DecodePlacement(exhausted_cooldown_s=1.0, clock=clock)
    a, b = node("a", free=50), node("b", free=10)
    placement.mark_exhausted(a)
    assert ids_of(placement.rank([a, b])) == ["b"]
    assert ids_of(placement.rank([node("a", seq=2, free=50), b])) == ["a", "b"]  # fresh stats
    placement.mark_exhausted(a)
    clock.now += 0.5
    assert ids_of(placement.rank([a, b])) == ["b"]
    clock.now += 0.5
    assert ids_of(placement.rank([a, b])) == ["a", "b"]  # cooldown over


def test_decode_with_every_node_refusing_ranks_none():
    placement = DecodePlacement(exhausted_cooldown_s=1.0, clock=Clock())
    a = node("a", free=50)
    placement.mark_exhausted(a)
    assert placement.rank([a]) == []


# -- prefill --------------------------------------------------------------------------


def prefill(slack: int = 10, max_entries: int = 1000) -> PrefillPlacement:
    return PrefillPlacement(block_size=BLOCK, affinity_slack_tokens=slack, max_affinity_entries=max_entries)


def test_prefix_hashes_match_the_engines_prefix_cache():
    prompt = list(range(1, 12))  # 2 full blocks of 4 and a partial one
    hashes = prefill().prefix_hashes(prompt)
    first = hash_block_tokens(None, prompt[:4])
    assert hashes == (first, hash_block_tokens(first, prompt[4:8]))
    # A node that computed this prompt finds exactly these keys in its prefix cache.
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True)
    request = Request("r", prompt, SamplingParams(), arrival_index=0, seed=0)
    kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(request)
    assert [b.block_id for b in kv.pool.lookup(hashes)] == kv.block_ids("r")[:2]


def test_prefix_hashes_continue_from_the_known_leading_blocks():
    tokens = list(range(1, 19))
    known = prefix_hashes(tokens[:9], BLOCK)  # 2 full blocks; the 9th token starts the third
    assert prefix_hashes(tokens, BLOCK, known) == prefix_hashes(tokens, BLOCK)
    assert len(prefix_hashes(tokens, BLOCK, known)) == 4


def test_prefill_picks_the_shortest_queue_and_counts_what_it_sent():
    placement = prefill(slack=0)
    a, b = node("a", queued=100), node("b", queued=40)
    assert placement.choose([a, b], [1] * 50, 1).node_id == "b"  # b: 40 + 50 = 90 now
    assert placement.load(b) == 90
    assert placement.choose([a, b], [2] * 20, 2).node_id == "b"  # 90 < 100
    assert placement.choose([a, b], [3] * 20, 3).node_id == "a"  # 110 > 100
    fresh_b = node("b", seq=2, queued=0)  # new stats: what was sent is now the node's own count
    assert placement.load(fresh_b) == 0


def test_prefill_finished_prompts_leave_the_queue():
    placement = prefill(slack=0)
    a = node("a")
    placement.choose([a], [1] * 30, 1)
    placement.finished(a, 1, 30)
    assert placement.load(a) == 0


def test_prefill_affinity_wins_within_the_slack():
    placement = prefill(slack=10)
    prompt = list(range(1, 17))  # 4 full blocks
    a, b = node("a"), node("b")
    assert placement.choose([a, b], prompt, 1).node_id == "a"
    placement.finished(a, 1, len(prompt))
    loaded_a = node("a", seq=2, queued=8)  # busier than b, but within the slack
    assert placement.choose([loaded_a, b], prompt + [99], 2).node_id == "a"
    busy_a = node("a", seq=3, queued=50)  # beyond the slack: the shortest queue wins
    assert placement.choose([busy_a, b], prompt + [98], 3).node_id == "b"


def test_prefill_affinity_prefers_the_longest_known_prefix():
    placement = prefill(slack=1000)
    a, b = node("a", queued=1), node("b")
    short = list(range(1, 9))  # 2 blocks
    long = list(range(1, 17))  # the same 2 blocks + 2 more
    placement.choose([a], long, 1)  # a has all 4 blocks
    placement.choose([b], short, 2)  # b got the first 2 blocks last
    assert placement.choose([a, b], long + [5], 3).node_id == "a"


def test_prefill_affinity_ignores_nodes_that_left():
    placement = prefill(slack=1000)
    a, b = node("a"), node("b")
    prompt = list(range(1, 17))
    placement.choose([a], prompt, 1)
    assert placement.choose([b], prompt, 2).node_id == "b"  # a is gone: b is the only candidate
    with pytest.raises(ValueError):
        placement.choose([], prompt, 3)


@pytest.mark.parametrize("shared_blocks, expected", [(2, "b"), (4, "a")])
def test_prefill_affinity_memory_is_bounded_lru(shared_blocks, expected):
    placement = prefill(slack=1000, max_entries=3)
    a, b = node("a", queued=5), node("b")  # a is busier: only affinity can pick it
    prompt = list(range(1, 21))  # 5 full blocks: only the hashes of blocks 3-5 are kept
    placement.choose([a], prompt, 1)
    placement.finished(a, 1, len(prompt))
    probe = prompt[: shared_blocks * BLOCK] + [0] * BLOCK
    assert placement.choose([a, b], probe, 2).node_id == expected


# -- colocated (and decode nodes that prefill) -----------------------------------------


def colocated(slack: int = 10) -> ColocatedPlacement:
    return ColocatedPlacement(1.0, Clock(), affinity=PrefixAffinity(BLOCK, slack, max_entries=1000))


def test_colocated_ranks_the_node_holding_the_prefix_first_within_the_slack():
    placement = colocated(slack=10)
    conversation = list(range(1, 17))  # 4 full blocks
    a, b = node("a", free=100), node("b", free=100)
    hashes = placement.affinity.hashes(conversation)
    first = placement.rank([a, b], hashes)[0]
    placement.assign(first, 1, len(conversation), 5, hashes)
    placement.prefilled(first, 1, len(conversation))
    assert first.node_id == "a"
    turn_2 = conversation + [7, 8, 9, 10, 11]
    later_a, later_b = node("a", seq=2, free=95, queued=8), node("b", seq=2, free=100)
    assert placement.cached_tokens(later_a, placement.affinity.hashes(turn_2)) == 16
    assert placement.cached_tokens(later_b, placement.affinity.hashes(turn_2)) == 0
    # a is 8 tokens busier, within the slack: it computes 5 tokens where b would compute 21
    assert ids_of(placement.rank([later_a, later_b], placement.affinity.hashes(turn_2))) == ["a", "b"]
    busy_a = node("a", seq=3, free=95, queued=50)  # beyond the slack: the shortest queue first
    assert ids_of(placement.rank([busy_a, later_b], placement.affinity.hashes(turn_2))) == ["b", "a"]
    assert ids_of(placement.rank([later_a, later_b])) == ["b", "a"]  # no prompt given: by load alone


def test_colocated_without_an_affinity_ranks_by_load_and_holds_nothing():
    placement = ColocatedPlacement(1.0, Clock())
    a, b = node("a", free=10, queued=5), node("b", free=10)
    placement.assign(a, 1, 16, 4, PrefixAffinity(BLOCK, 0, 10).hashes(list(range(16))))
    assert ids_of(placement.rank([a, b])) == ["b", "a"]
    assert placement.cached_tokens(a, ()) == 0
