"""The cluster simulator against cases computed by hand: one request alone, chunked prefill, the
hand-off's transfer, a single-server queue, preemption, a request no node can hold, and the
hybrid's choice between a decode node that prefills and the prefill pool."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.serve.metrics import request_metrics
from pdserve.engine.config import EngineConfig
from pdserve.planner.profile import ClientCost, FrontCost, RouterCost, ServingCosts, TransferCost
from pdserve.planner.cluster_spec import ClusterSpec, Pool
from pdserve.planner.simulator import EXHAUSTED, ClusterSim, SimRequest
from pdserve.planner.stack_load import UTILISATION_WINDOW_S, WINDOW_S
from pdserve.router.dispatch.hybrid import Disaggregation, PrefillChoice
from tests.unit.planner_profiles import BLOCK_BYTES, synthetic_profile


def config(**kw) -> EngineConfig:
    return EngineConfig(model="synthetic", dtype="float32", num_blocks=kw.pop("num_blocks", 1000), **kw)


def prompt(k: int, length: int) -> tuple[int, ...]:
    """Request k's own tokens: no two prompts share a block, so no prefix-cache hit."""
    return tuple(range(k * length + 1, (k + 1) * length + 1))


def run_one(spec: ClusterSpec, prompt_len: int, output_len: int):
    sim = ClusterSim(spec, 4096)
    (trace,) = sim.run([SimRequest(0.0, tuple(range(1, prompt_len + 1)), output_len)])
    return sim, request_metrics(trace)


def test_one_request_alone_ttft_is_its_prefill_step_and_tpot_its_decode_step():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001, per_seq_s=0.002)
    sim, m = run_one(ClusterSpec(colocated=Pool(1, config(), profile)), 100, 5)
    assert m.status == "OK" and m.output_len == 5
    assert m.ttft_s == pytest.approx(0.01 + 100 * 0.001 + 0.002)
    assert m.tpot_s == pytest.approx(0.01 + 0.001 + 0.002)
    assert m.e2e_s == pytest.approx(0.112 + 4 * 0.013)
    assert sim.colocated[0].kv.num_used_blocks == 0


def test_a_long_prompt_is_chunked_by_the_engines_budget_and_priced_by_its_attention():
    a = 1e-6
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001, per_attended_s=a)
    _, m = run_one(ClusterSpec(colocated=Pool(1, config(max_num_batched_tokens=64), profile)), 100, 1)
    first = 0.01 + 64 * 0.001 + a * (64 * 65 // 2)
    second = 0.01 + 36 * 0.001 + a * (36 * 64 + 36 * 37 // 2)
    assert m.ttft_s == pytest.approx(first + second)


def test_decode_steps_price_the_kv_they_read():
    profile = synthetic_profile(base_s=0.01, per_decode_context_s=1e-4)
    _, m = run_one(ClusterSpec(colocated=Pool(1, config(), profile)), 10, 3)
    # Token 2 reads 11 KV tokens (the prompt and token 1), token 3 reads 12.
    assert m.itl_s == pytest.approx((0.01 + 11e-4, 0.01 + 12e-4))


def test_disaggregated_token_one_comes_from_the_prefill_node_and_the_kv_tail_delays_token_two():
    transfer = TransferCost(0.005, 1e-6, "synthetic")
    prefill = synthetic_profile(base_s=0.01, per_token_s=0.001, transfer=transfer)
    decode = synthetic_profile(base_s=0.02)
    spec = ClusterSpec(prefill=Pool(1, config(max_num_batched_tokens=64), prefill), decode=Pool(1, config(), decode))
    sim, m = run_one(spec, 100, 3)
    first_chunk, second_chunk = 0.01 + 0.064, 0.01 + 0.036
    assert m.ttft_s == pytest.approx(first_chunk + second_chunk)
    # The first chunk filled 4 blocks, pushed while the second computed; the other 3 follow token 1.
    tail = 0.005 + 3 * BLOCK_BYTES * 1e-6
    assert m.itl_s == pytest.approx((tail + 0.02, 0.02))
    assert sim.prefill[0].kv.num_used_blocks == 0 and sim.decode[0].kv.num_used_blocks == 0


def test_one_server_queue_of_identical_requests_waits_as_computed_by_hand():
    """D/D/1: service S every a < S apart, one at a time: request k waits k·(S − a) before its own S."""
    service, gap = 0.11, 0.05
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    sim = ClusterSim(ClusterSpec(colocated=Pool(1, config(max_num_seqs=1), profile)), 4096)
    traces = sim.run([SimRequest(k * gap, prompt(k, 100), 1) for k in range(6)])
    ttfts = [request_metrics(t).ttft_s for t in traces]
    assert ttfts == pytest.approx([service + k * (service - gap) for k in range(6)])


def test_a_repeated_prompt_computes_only_what_the_prefix_cache_lacks():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    sim = ClusterSim(ClusterSpec(colocated=Pool(1, config(), profile)), 4096)
    traces = sim.run([SimRequest(0.0, prompt(0, 100), 1), SimRequest(1.0, prompt(0, 100), 1)])
    # The engine's prefix cache holds the first prompt's 6 full blocks: the second computes 4 tokens.
    assert [request_metrics(t).ttft_s for t in traces] == pytest.approx([0.11, 0.014])


def test_two_colocated_nodes_share_the_queue_through_the_routers_placement():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    sim = ClusterSim(ClusterSpec(colocated=Pool(2, config(max_num_seqs=1), profile)), 4096)
    traces = sim.run([SimRequest(0.0, prompt(k, 100), 1) for k in range(4)])
    # Fewest queued prompt tokens first: the four go two to each node, two rounds of one prefill.
    assert sorted(request_metrics(t).ttft_s for t in traces) == pytest.approx([0.11, 0.11, 0.22, 0.22])


def test_a_pool_too_small_preempts_and_every_request_still_gets_every_token():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    # 8 blocks of 16: two requests of 40 + 40 tokens need 10 between them.
    sim = ClusterSim(ClusterSpec(colocated=Pool(1, config(num_blocks=8, watermark=0.0), profile)), 4096)
    traces = sim.run([SimRequest(0.0, tuple(range(1, 41)), 40), SimRequest(0.0, tuple(range(41, 81)), 40)])
    assert [request_metrics(t).output_len for t in traces] == [40, 40]
    assert all(t.status == "OK" for t in traces)
    assert sim.colocated[0].scheduler.num_preemptions > 0
    assert sim.colocated[0].kv.num_used_blocks == 0


def test_a_request_no_node_can_ever_hold_is_refused():
    profile = synthetic_profile(base_s=0.01)
    spec = ClusterSpec(prefill=Pool(1, config(), profile), decode=Pool(1, config(num_blocks=4), profile))
    sim, m = run_one(spec, 100, 10)
    assert m.status == EXHAUSTED
    assert sim.prefill[0].kv.num_used_blocks == 0 and sim.decode[0].kv.num_used_blocks == 0


def stretch_after(charged_s: float, elapsed_s: float, cores: int = 1) -> float:
    """A step's stretch `elapsed_s` after the stack was charged `charged_s` of CPU (nothing before)."""
    return 1 / (1 - charged_s / WINDOW_S * math.exp(-elapsed_s / WINDOW_S) / cores)


def test_the_router_costs_each_request_and_each_token_once_on_its_way():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    router = RouterCost(0.003, 0.0005, "synthetic")
    _, m = run_one(ClusterSpec(colocated=Pool(1, config(), profile), costs=ServingCosts(router)), 100, 5)
    # The prefill starts once the router placed the request, stretched by that request's 3 ms of CPU.
    # Token 1's relay then shares the core with an engine busy for that step of the last 5 s.
    prefill_s = 0.11 * stretch_after(0.003, 0.003)
    assert m.ttft_s == pytest.approx(0.003 + prefill_s + 0.0005 * (1 + prefill_s / UTILISATION_WINDOW_S))
    # Every token waits the same relay; the decode steps are stretched under 1% by the stack's CPU.
    assert m.tpot_s == pytest.approx(0.011, rel=0.01)


def test_a_router_slower_than_the_steps_paces_every_stream():
    """Tokens leave the node every 11–18 ms (stretched by the router's CPU on its core) but the
    router relays one per 50 ms of CPU, a little more while the engine keeps its core busy: they
    queue there."""
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    _, m = run_one(ClusterSpec(colocated=Pool(1, config(), profile),
                               costs=ServingCosts(RouterCost(0.0, 0.05, "slow"))), 100, 5)
    # Nothing was charged before the prefill; its relay shares the core with that one step's 0.11 s.
    assert m.ttft_s == pytest.approx(0.11 + 0.05 * (1 + 0.11 / UTILISATION_WINDOW_S))
    assert all(0.05 < itl < 0.05 * (1 + 0.3 / UTILISATION_WINDOW_S) for itl in m.itl_s)  # 0.3 s of steps at most


def test_the_stacks_cpu_stretches_the_steps_that_follow_it_on_the_same_cores():
    """Two requests a second apart, each 50 ms of router work on the node's one core: each
    prefill is stretched by what the stack was charged, decayed over the time since."""
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    spec = ClusterSpec(colocated=Pool(1, config(num_threads=1), profile),
                       costs=ServingCosts(RouterCost(0.05, 0.0, "synthetic")))
    traces = ClusterSim(spec, 4096).run([SimRequest(0.0, prompt(0, 100), 1), SimRequest(1.0, prompt(1, 100), 1)])
    first_prefill_s = 0.11 * stretch_after(0.05, 0.05)
    # The second request's router work shares the core with the first prefill's utilisation, decayed.
    idle_since_s = 1.0 - 0.05 - first_prefill_s
    engine_busy = first_prefill_s / UTILISATION_WINDOW_S * math.exp(-idle_since_s / UTILISATION_WINDOW_S)
    routed_s = 0.05 * (1 + engine_busy)
    # The second prefill also carries what is left of the first request's charge, a second older.
    second = 1 / (1 - 0.05 / WINDOW_S * (math.exp(-(1 + routed_s) / WINDOW_S) + math.exp(-routed_s / WINDOW_S)))
    assert [request_metrics(t).ttft_s for t in traces] == pytest.approx([0.05 + first_prefill_s,
                                                                         routed_s + 0.11 * second])


def test_a_front_loads_its_own_nodes_cores_alone():
    """A pair, one core each: a front's CPU lands on its node's core alone. Its per-request
    50 ms on each leg: the prefill step is stretched by the prefill front's alone. Its per-token
    10 ms: token 1 is the prefill node's, so the decode node's first step is not stretched, and
    its second is, by the decode front's relay of token 2."""
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    one_core = Pool(1, config(num_threads=1), profile)
    spec = ClusterSpec(prefill=one_core, decode=one_core, costs=ServingCosts(fronts=FrontCost(0.05, 0.0, "synthetic")))
    _, m = run_one(spec, 100, 1)
    assert m.ttft_s == pytest.approx(0.11 * stretch_after(0.05, 0.0, cores=1))

    spec = ClusterSpec(prefill=one_core, decode=one_core, costs=ServingCosts(fronts=FrontCost(0.0, 0.01, "synthetic")))
    _, m = run_one(spec, 100, 3)
    assert m.ttft_s == pytest.approx(0.11)
    assert m.itl_s == pytest.approx((0.011, 0.011 * stretch_after(0.01, 0.0, cores=1)))


def test_the_router_and_client_cpu_goes_to_the_idler_node():
    """A pair, one core each. The first request's decode keeps the decode node's core busy for
    half a minute; the second request's 50 ms of router work, charged as it arrives 20 s in, then
    lands nearly all on the idle prefill node's core and stretches its prefill as if that core
    alone had taken it (an even split over both cores would stretch it half as much)."""
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    one_core = Pool(1, config(num_threads=1), profile)
    spec = ClusterSpec(prefill=one_core, decode=one_core, costs=ServingCosts(RouterCost(0.05, 0.0, "synthetic")))
    first, second = ClusterSim(spec, 4096).run([SimRequest(0.0, prompt(0, 100), 3000),
                                                SimRequest(20.0, prompt(1, 100), 1)])
    assert first.status == second.status == "OK"
    # After the router's own 50 ms (barely more: it waits only while both cores are busy), the
    # decode node reserves at the end of the step it is in, the first request's next token after
    # the router is done, and the prefill starts.
    routed_s = router_done_s(first) - 20.0
    assert 0.05 < routed_s < 0.05 * 1.001
    reserved_s = min(t for t, _ in first.chunks if t > 20.0 + routed_s)
    prefill_s = second.chunks[0][0] - reserved_s
    even = 0.11 * stretch_after(0.05, 0.05, cores=2)
    all_on_prefill_core = 0.11 * stretch_after(0.05, 0.05, cores=1)
    assert prefill_s == pytest.approx(all_on_prefill_core, rel=0.01)  # the decode core was ~98% busy
    assert prefill_s > even


def router_done_s(trace) -> float:
    """When the router finished the work it had while `trace`'s tokens came (per-token cost 0):
    the tokens of the steps that ended meanwhile reach the client together, at that moment."""
    return next(t for (t, _), (later, _) in zip(trace.chunks, trace.chunks[1:]) if t == later)


def test_a_router_pinned_to_a_pool_loads_that_pools_cores_alone():
    """The case above with the router pinned (`stack_on`): on the busy decode core, the second
    request's 50 ms of router work (charged as it arrives, 20 s in) stretches no prefill step, and
    takes nearly twice as long, the core shared with an engine busy nearly all the time; on the
    idle prefill core it takes its 50 ms, and stretches the prefill by all of it, decayed over the
    time until the prefill starts."""
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    one_core = Pool(1, config(num_threads=1), profile)
    for stack_on, on_prefill_core, slowdown in (("decode", 0.0, (1.95, 2.0)), ("prefill", 0.05, (1.0, 1.001))):
        spec = ClusterSpec(prefill=one_core, decode=one_core, stack_on=stack_on,
                           costs=ServingCosts(RouterCost(0.05, 0.0, "synthetic")))
        first, second = ClusterSim(spec, 4096).run([SimRequest(0.0, prompt(0, 100), 3000),
                                                    SimRequest(20.0, prompt(1, 100), 1)])
        routed_s = router_done_s(first) - 20.0
        assert 0.05 * slowdown[0] < routed_s < 0.05 * slowdown[1], stack_on
        reserved_s = min(t for t, _ in first.chunks if t > 20.0 + routed_s)
        stretched = stretch_after(on_prefill_core, reserved_s - 20.0)
        assert second.chunks[0][0] - reserved_s == pytest.approx(0.11 * stretched, rel=1e-9), stack_on


def test_a_router_is_pinned_to_a_pool_the_cluster_has():
    one_core = Pool(1, config(num_threads=1), synthetic_profile(base_s=0.01))
    with pytest.raises(ValueError, match="stack_on: 'prefill' is not a pool"):
        ClusterSpec(colocated=one_core, stack_on="prefill")


def test_the_client_is_charged_only_when_its_costs_are_given():
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    client = ClientCost(0.05, 0.0, "synthetic")
    _, here = run_one(ClusterSpec(colocated=Pool(1, config(), profile), costs=ServingCosts(client=client)), 100, 1)
    _, elsewhere = run_one(ClusterSpec(colocated=Pool(1, config(), profile)), 100, 1)
    assert here.ttft_s == pytest.approx(0.11 * stretch_after(0.05, 0.0))
    assert elsewhere.ttft_s == pytest.approx(0.11)



def hybrid_pair(bound: int = 256) -> tuple[ClusterSpec, float]:
    """A prefill node and a decode node that also prefills, on different step times, with a KV
    transfer that costs: which node computed a prompt, and whether KV moved, show in the times."""
    transfer = TransferCost(0.005, 1e-6, "synthetic")
    prefill = synthetic_profile(base_s=0.01, per_token_s=0.001, transfer=transfer)
    decode = synthetic_profile(base_s=0.02, per_token_s=0.002)
    spec = ClusterSpec(prefill=Pool(1, config(), prefill), decode=Pool(1, config(), decode),
                       local_prefill=PrefillChoice(Disaggregation.AUTO, bound))
    return spec, 0.005 + 7 * BLOCK_BYTES * 1e-6  # the tail of a 100-token prompt: its 7 blocks


def test_hybrid_a_short_prompt_alone_is_prefilled_on_the_decode_node_and_no_kv_moves():
    spec, _ = hybrid_pair()
    assert spec.mode == "hybrid"
    sim, m = run_one(spec, 100, 3)  # 100 tokens, nothing queued: within the bound of 256
    assert m.ttft_s == pytest.approx(0.02 + 100 * 0.002)  # the decode node's prefill step
    assert m.itl_s == pytest.approx((0.022, 0.022))  # its decode steps, no transfer before token 2
    assert sim.decode[0].kv.num_used_blocks == 0 and sim.prefill[0].kv.num_used_blocks == 0


def test_hybrid_a_prompt_over_the_bound_goes_through_the_prefill_pool():
    spec, tail = hybrid_pair(bound=99)
    sim, m = run_one(spec, 100, 3)
    assert m.ttft_s == pytest.approx(0.01 + 100 * 0.001)  # the prefill node's step
    assert m.itl_s == pytest.approx((tail + 0.022, 0.022))  # its KV moved before token 2
    assert sim.decode[0].kv.num_used_blocks == 0 and sim.prefill[0].kv.num_used_blocks == 0


def test_hybrid_the_decode_nodes_queue_counts_against_the_bound():
    """Two 100-token prompts at once: the first is local (100 <= 150); the second would wait
    behind it (100 + 100 > 150) and the prefill pool is empty, so it goes there, but only once
    the decode node, in the step that computes the first, has reserved its blocks."""
    spec, _ = hybrid_pair(bound=150)
    sim = ClusterSim(spec, 4096)
    traces = sim.run([SimRequest(0.0, prompt(0, 100), 1), SimRequest(0.0, prompt(1, 100), 1)])
    assert [request_metrics(t).ttft_s for t in traces] == pytest.approx([0.22, 0.22 + 0.11])


def test_a_decode_node_reserves_between_its_steps_so_the_prefill_waits_for_the_step_in_progress():
    """A second request arrives 5 ms into the first one's decode step (20 ms): its prefill starts
    only when that step ends and the decode node has read the reservation."""
    prefill = synthetic_profile(base_s=0.01, per_token_s=0.001, transfer=TransferCost(0.0, 0.0, "synthetic"))
    decode = synthetic_profile(base_s=0.02)
    spec = ClusterSpec(prefill=Pool(1, config(), prefill), decode=Pool(1, config(), decode))
    sim = ClusterSim(spec, 4096)
    first_decode_starts = 0.01 + 0.1  # the first request's token 1; its KV follows at no cost
    traces = sim.run([SimRequest(0.0, prompt(0, 100), 3), SimRequest(first_decode_starts + 0.005, prompt(1, 100), 1)])
    second = request_metrics(traces[1])
    assert second.ttft_s == pytest.approx(0.015 + 0.11)  # the 15 ms left of the step, then its prefill
    assert sim.decode[0].kv.num_used_blocks == 0 and sim.prefill[0].kv.num_used_blocks == 0


def test_local_prefill_is_for_a_pair_of_pools():
    profile = synthetic_profile(base_s=0.01)
    with pytest.raises(ValueError, match="local_prefill"):
        ClusterSpec(colocated=Pool(1, config(), profile), local_prefill=PrefillChoice(Disaggregation.AUTO, 256))


def test_a_serve_prefill_pool_computes_a_prompt_where_it_is_soonest_and_decodes_it_where_there_is_room():
    """Two decode nodes of 10 blocks of 16 tokens that are the prefill pool too. The first request
    is computed and decoded on decode-0. The second (2 blocks at most) arrives 300 ms in: decode-0
    is still the place to compute it (both queues are empty; the tie goes to decode-0), but the
    first request's 7 blocks leave it 3, short of twice 2, where decode-1 has 10. So decode-1
    decodes it: its prompt joins decode-0's next step beside the first request's decode, is handed
    off at token 1, and its KV moves to decode-1."""
    transfer = TransferCost(0.005, 1e-6, "synthetic")
    profile = synthetic_profile(base_s=0.02, per_token_s=0.002, transfer=transfer)
    spec = ClusterSpec(decode=Pool(2, config(num_blocks=10), profile), serve_prefill=True,
                       local_prefill=PrefillChoice(Disaggregation.AUTO, 256))
    assert spec.mode == "hybrid"
    sim = ClusterSim(spec, 4096)
    first, second = sim.run([SimRequest(0.0, prompt(0, 100), 50), SimRequest(0.3, prompt(1, 20), 3)])
    first_m, second_m = request_metrics(first), request_metrics(second)
    assert first_m.ttft_s == pytest.approx(0.02 + 100 * 0.002)  # decode-0's prefill step
    step_in_progress_ends = 0.22 + 4 * 0.022  # decode-0's 4th decode step of the first request
    assert second_m.ttft_s == pytest.approx(step_in_progress_ends + 0.02 + 21 * 0.002 - 0.3)
    tail = 0.005 + sim.decode[1].kv.blocks_needed(20) * BLOCK_BYTES * 1e-6
    assert second_m.itl_s == pytest.approx((tail + 0.022, 0.022))  # decode-1 alone, after the KV
    assert [n.kv.num_used_blocks for n in sim.decode] == [0, 0]
    roomy = ClusterSim(ClusterSpec(decode=Pool(2, config(), profile), serve_prefill=True,
                                   local_prefill=PrefillChoice(Disaggregation.AUTO, 256)), 4096)
    _, second = roomy.run([SimRequest(0.0, prompt(0, 100), 50), SimRequest(0.3, prompt(1, 20), 3)])
    # With room everywhere nothing moves: the local route's placement (queue, then free blocks)
    # computes and decodes it on the idle decode-1, no KV tail before token 2.
    assert request_metrics(second).ttft_s == pytest.approx(0.02 + 20 * 0.002)
    assert request_metrics(second).itl_s == pytest.approx((0.022, 0.022))


def test_serve_prefill_needs_the_routers_choice_and_no_prefill_pool():
    profile = synthetic_profile(base_s=0.01)
    with pytest.raises(ValueError, match="serve_prefill"):
        ClusterSpec(decode=Pool(2, config(), profile), serve_prefill=True)
    with pytest.raises(ValueError, match="serve_prefill"):
        ClusterSpec(prefill=Pool(1, config(), profile), decode=Pool(1, config(), profile), serve_prefill=True,
                    local_prefill=PrefillChoice(Disaggregation.AUTO, 256))


def test_every_kv_push_costs_cpu_on_both_ends_and_stretches_the_steps_that_follow():
    """A 100-token prompt in 64-token chunks is pushed twice: at its hand-off the prefill node is
    charged two pushes' send CPU (20 ms each) and the decode node two pushes' receive CPU (30 ms
    each). The decode node's next step is stretched by its 60 ms at once; a prompt arriving on the
    prefill node a second later, by its 40 ms decayed over the time since."""
    transfer = TransferCost(0.0, 0.0, "synthetic", send_cpu_s=0.02, receive_cpu_s=0.03)
    prefill = synthetic_profile(base_s=0.01, per_token_s=0.001, transfer=transfer)
    decode = synthetic_profile(base_s=0.02)
    one_core = dict(num_threads=1)
    spec = ClusterSpec(prefill=Pool(1, config(max_num_batched_tokens=64, **one_core), prefill),
                       decode=Pool(1, config(**one_core), decode))
    traces = ClusterSim(spec, 4096).run([SimRequest(0.0, prompt(0, 100), 2), SimRequest(1.0, prompt(1, 100), 1)])
    first, second = (request_metrics(t) for t in traces)
    assert first.ttft_s == pytest.approx(0.074 + 0.046)
    assert first.itl_s == pytest.approx((0.02 * stretch_after(0.06, 0.0),))
    since = 1.0 - first.ttft_s
    chunk_1 = 0.074 * stretch_after(0.04, since)
    assert second.ttft_s == pytest.approx(chunk_1 + 0.046 * stretch_after(0.04, since + chunk_1))


def test_a_transfers_cpu_is_per_push_and_per_byte_on_each_end():
    transfer = TransferCost(0.0, 0.0, "synthetic", 0.001, 1e-9, 0.002, 2e-9)
    assert transfer.send_cpu(3, 1_000_000) == pytest.approx(0.003 + 0.001)
    assert transfer.receive_cpu(3, 1_000_000) == pytest.approx(0.006 + 0.002)
    assert TransferCost(0.005, 1e-6, "no CPU given").send_cpu(2, 10**6) == 0.0
