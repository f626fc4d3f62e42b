"""Scheduler: token budget, chunked prefill, decodes first, preemption of the latest arrival."""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler


def make_scheduler(num_blocks=16, block_size=4, budget=8, max_seqs=4, caching=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, budget, max_seqs)


def make_request(req_id: str, num_prompt: int, arrival: int, first_token: int = 0) -> Request:
    tokens = [first_token + i for i in range(num_prompt)]
    return Request(req_id, tokens, SamplingParams(max_tokens=8), arrival, seed=0)


def run_step(sched: Scheduler, sampled_token: int = 7) -> dict[str, int]:
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        if s.request.num_computed_tokens == s.request.num_tokens:
            s.request.append_output_token(sampled_token)
    return {s.request.req_id: s.num_scheduled_tokens for s in out.scheduled}


def test_long_prompt_is_chunked_by_the_budget():
    sched = make_scheduler(budget=8)
    sched.add(make_request("a", 20, 0))
    assert run_step(sched) == {"a": 8}
    assert run_step(sched) == {"a": 8}
    assert run_step(sched) == {"a": 4}  # last chunk samples the first token
    assert run_step(sched) == {"a": 1}  # then decodes


def test_running_decodes_go_first_and_prefill_fills_the_rest():
    sched = make_scheduler(budget=8)
    sched.add(make_request("a", 3, 0))
    run_step(sched)  # a's prompt done, a is now decoding
    sched.add(make_request("b", 30, 1, first_token=100))
    out = sched.schedule()
    assert [(s.request.req_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs_bounds_running():
    sched = make_scheduler(budget=16, max_seqs=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", 2, i, first_token=10 * i))
    assert set(run_step(sched)) == {"r0", "r1"}
    assert len(sched.waiting) == 1


def test_preemption_victim_is_the_latest_arrival_and_frees_its_blocks():
    # 4 blocks of 4 tokens; two requests of 8 prompt tokens take 2 blocks each.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16, caching=False)
    first, second = make_request("a", 8, 0), make_request("b", 8, 1, first_token=50)
    sched.add(first)
    sched.add(second)
    run_step(sched)  # both prefilled: 9 tokens each now, 2 blocks each, pool full
    out = sched.schedule()  # a needs a third block for token 9: b is preempted
    assert [r.req_id for r in out.preempted] == ["b"]
    assert [s.request.req_id for s in out.scheduled] == ["a"]
    assert second.status is RequestStatus.WAITING and second.num_computed_tokens == 0
    assert sched.kv.block_ids("b") == []
    assert sched.num_preemptions == 1
    assert sched.waiting[0] is second


def test_request_preempting_itself_waits_at_the_front():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=16, caching=False)
    only = make_request("a", 8, 0)
    sched.add(only)
    run_step(sched)  # 9 tokens now: needs a third block that does not exist
    out = sched.schedule()
    assert out.preempted == [only] and out.scheduled == []
    assert sched.waiting[0] is only and sched.kv.num_used_blocks == 0


def test_finish_frees_blocks():
    sched = make_scheduler(budget=16)
    req = make_request("a", 9, 0)
    sched.add(req)
    run_step(sched)
    assert sched.kv.num_used_blocks == 3
    sched.finish(req)
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished()


def test_prefix_hit_skips_cached_tokens():
    sched = make_scheduler(budget=32)
    sched.add(make_request("a", 12, 0))
    run_step(sched)
    sched.add(make_request("b", 12, 1))  # same tokens as a
    out = sched.schedule()
    (b,) = [s for s in out.scheduled if s.request.req_id == "b"]
    assert b.num_scheduled_tokens == 4 and b.request.num_cached_tokens == 8
