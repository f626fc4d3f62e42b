"""The planner's choice on synthetic profiles (the hybrid among them), its command lines, its refusal
and its flag errors."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest

from pdserve.bench.serve.metrics import Distribution, Slo, summarize
from pdserve.bench.serve.sweep import SweepConfig
from pdserve.engine.config import EngineConfig
from pdserve.planner.cli import main, unattainable
from pdserve.planner.goodput import Prediction, SimRun, Traffic, predict_goodput, start_rate
from pdserve.planner.profile import ServingCosts
from pdserve.planner.search import (
    TIE_BAND, Candidate, Evaluated, Knobs, Layout, evaluate, layouts, ranked, slo_share, tpot_prompt_budget,
    with_prompt_budgets,
)
from pdserve.router.dispatch.hybrid import Disaggregation
from tests.unit.planner_profiles import synthetic_profile

BASE = EngineConfig(model="synthetic", dtype="float32", num_blocks=4096)
SWEEP = SweepConfig(0.9, tolerance=0.1, max_probes=10)


def traffic(prompt_len: int, output_len: int, count: int = 60) -> Traffic:
    return Traffic.of([(tuple(range(k * prompt_len + 1, (k + 1) * prompt_len + 1)), output_len)
                       for k in range(count)])


def best(profiles, work: Traffic, slo: Slo, knobs=Knobs(512, 64), bounds: tuple[int, ...] = ()):
    candidates = [Candidate(lay, knobs) for lay in layouts(2, bounds)]
    return ranked([evaluate(c, BASE, profiles, work, slo, SWEEP, 4096) for c in candidates], slo)


def test_layouts_on_two_and_four_devices():
    assert [lay.describe() for lay in layouts(2)] == [
        "colocated x1 (2 cores)", "colocated x2 (1 core each)",
        "1P (1 core) + 1D (1 core), router on P", "1P (1 core) + 1D (1 core), router on D"]
    four = list(layouts(4))
    assert all(lay.devices == 4 for lay in four)
    assert Layout(prefill=1, prefill_cores=1, decode=3, decode_cores=1, router_on="decode") in four
    assert Layout(prefill=2, prefill_cores=1, decode=1, decode_cores=2, router_on="prefill") in four
    assert all(lay.router_on for lay in four if lay.prefill)  # a split's router is never left to the OS


def test_a_split_pins_its_router_to_the_pool_it_names():
    lay = Layout(prefill=2, prefill_cores=1, decode=1, decode_cores=2)
    assert replace(lay, router_on="prefill").router_cores == (0, 1)
    assert replace(lay, router_on="decode").router_cores == (2, 3)
    assert lay.router_cores is None
    argv = Candidate(replace(lay, router_on="decode"), Knobs(512, 64)).command("/m", "float32", 16)
    assert argv[argv.index("--router-cores") + 1] == "2-3"
    spec = Candidate(replace(lay, router_on="decode"), Knobs(512, 64)).spec(
        EngineConfig(model="m", dtype="float32"), {(1, 1): synthetic_profile(base_s=0.01),
                                                   (2, 1): synthetic_profile(base_s=0.01)}, ServingCosts())
    assert spec.stack_on == "decode"
    with pytest.raises(ValueError, match="router_on"):
        Layout(colocated=2, colocated_cores=1, router_on="decode")
    with pytest.raises(ValueError, match="router_on"):
        replace(lay, router_on="router")


def test_every_split_is_also_tried_as_the_hybrid_at_each_bound_and_the_nodes_as_a_serve_prefill_pool():
    assert [(lay.mode, lay.describe()) for lay in layouts(2, (64, 256))] == [
        ("colocated", "colocated x1 (2 cores)"), ("colocated", "colocated x2 (1 core each)"),
        ("hybrid", "2D serving prefill (1 core each)"),
        ("disaggregated", "1P (1 core) + 1D (1 core), router on P"),
        ("hybrid", "1P (1 core) + 1D (1 core) hybrid<=64, router on P"),
        ("hybrid", "1P (1 core) + 1D (1 core) hybrid<=256, router on P"),
        ("disaggregated", "1P (1 core) + 1D (1 core), router on D"),
        ("hybrid", "1P (1 core) + 1D (1 core) hybrid<=64, router on D"),
        ("hybrid", "1P (1 core) + 1D (1 core) hybrid<=256, router on D")]
    four = list(layouts(4, (256,)))
    pools = [lay.describe() for lay in four if lay.serve_prefill]
    assert pools == ["2D serving prefill (2 cores each)", "4D serving prefill (1 core each)"]
    assert sum(lay.mode == "hybrid" for lay in four) - len(pools) == sum(lay.mode == "disaggregated" for lay in four)
    assert not any(lay.serve_prefill for lay in layouts(4))  # no hybrids asked for


def test_a_serve_prefill_pool_runs_its_decode_nodes_with_the_flag_and_the_router_on_auto():
    candidate = Candidate(Layout(decode=2, decode_cores=1, serve_prefill=True), Knobs(256, 32))
    assert candidate.command("/m", "float32", 16) == [
        "pdserve", "cluster", "--model", "/m", "--dtype", "float32", "--block-size", "16",
        "--prefill", "0", "--decode", "2", "--decode-cores", "0-1",
        "--decode-args", "--max-num-batched-tokens 256 --max-num-seqs 32 --serve-prefill",
        "--router-args", "--disaggregation auto"]
    spec = candidate.spec(EngineConfig(model="m", dtype="float32"), {(1, 1): synthetic_profile(base_s=0.01)},
                          ServingCosts())
    assert spec.serve_prefill and spec.prefill is None and spec.decode.count == 2 and spec.mode == "hybrid"
    assert spec.local_prefill.mode is Disaggregation.AUTO


def test_each_pool_is_tried_at_every_tp_size_that_divides_its_nodes_cores():
    assert [lay.describe() for lay in layouts(2, tp_sizes=(1, 2))] == [
        "colocated x1 (2 cores)", "colocated x1 (2 cores TP 2)", "colocated x2 (1 core each)",
        "1P (1 core) + 1D (1 core), router on P", "1P (1 core) + 1D (1 core), router on D"]
    four = [lay for lay in layouts(4, tp_sizes=(1, 2))
            if lay.prefill == 1 and lay.prefill_cores == 2 and lay.decode == 1 and lay.router_on == "prefill"]
    assert [(lay.prefill_tp, lay.decode_tp) for lay in four] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert four[-1].setups == {(2, 2)}


def test_a_tp_node_whose_profile_is_faster_wins():
    """Two cores as one TP 2 node whose steps take 40% of a 1-core node's, against two 1-core
    nodes (and a 2-thread TP 1 node no faster than one core): the TP node serves more."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    tp2 = synthetic_profile(base_s=0.002, per_token_s=0.0004, threads=2)
    candidates = [Candidate(lay, Knobs(512, 64)) for lay in layouts(2, tp_sizes=(1, 2))]
    slo = Slo(ttft_s=0.4, tpot_s=10.0)
    results = ranked([evaluate(c, BASE, {(1, 1): per_core, (2, 1): per_core, (2, 2): tp2}, traffic(256, 16),
                               slo, SWEEP, 4096) for c in candidates], slo)
    assert results[0].candidate.layout == Layout(colocated=1, colocated_cores=2, colocated_tp=2)


def mix(short: int, long: int, output_len: int, count: int = 60) -> Traffic:
    """Every fourth prompt long, the others short; no two share a block."""
    lengths = [long if k % 4 == 0 else short for k in range(count)]
    starts = [1 + sum(lengths[:k]) for k in range(count)]
    return Traffic.of([(tuple(range(s, s + n)), output_len) for s, n in zip(starts, lengths)])


def test_short_and_long_prompts_under_a_balanced_slo_go_hybrid():
    """64- and 512-token prompts, TTFT 1 s and TPOT 30 ms. Colocated, the long prompts stall the
    decodes beside them; disaggregated, every prompt queues on the one prefill node while the
    decode node idles between tokens. The hybrid's decode node takes the short ones along its
    decode steps and leaves the long ones to the prefill node: more than either."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    results = best({(1, 1): per_core, (2, 1): per_core}, mix(64, 512, 32), Slo(ttft_s=1.0, tpot_s=0.03), bounds=(256,))
    by_mode = {}
    for r in results:
        by_mode.setdefault(r.candidate.layout.mode, r.prediction.goodput_rps)
    assert replace(results[0].candidate.layout, router_on=None) == Layout(
        prefill=1, prefill_cores=1, decode=1, decode_cores=1, local_prefill_max_tokens=256)
    assert by_mode["hybrid"] > by_mode["colocated"] > 0 and by_mode["hybrid"] > by_mode["disaggregated"] > 0


def test_long_prompts_under_a_tight_tpot_go_disaggregated():
    """A 512-token prompt costs 0.5 s of one step: on a colocated node it stalls every decode beside
    it far past a 30 ms TPOT; a decode node never runs one."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    results = best({(1, 1): per_core, (2, 1): per_core}, traffic(512, 32), Slo(ttft_s=10.0, tpot_s=0.03))
    assert results[0].candidate.layout.mode == "disaggregated"
    assert results[0].prediction.goodput_rps > 0


def test_a_tight_ttft_with_a_loose_tpot_goes_colocated_on_two_nodes():
    """Two servers of prompts halve the queueing a single prefill node makes; TPOT is free."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    results = best({(1, 1): per_core, (2, 1): per_core}, traffic(256, 16), Slo(ttft_s=0.4, tpot_s=10.0))
    assert results[0].candidate.layout == Layout(colocated=2, colocated_cores=1)
    assert results[0].goodput_per_device > results[-1].goodput_per_device


def test_slos_nothing_meets_are_refused_naming_the_best_attainable_figures():
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    slo = Slo(ttft_s=0.1, tpot_s=0.001)  # a 256-token prompt alone takes 0.261 s
    results = best({(1, 1): per_core, (2, 1): per_core}, traffic(256, 16, count=20), slo)
    assert all(r.prediction.goodput_rps == 0 for r in results)
    message = unattainable(results, 2, slo, 0.9).cli_message()
    assert message.startswith("--ttft-slo/--tpot-slo: no configuration on 2 devices meets TTFT <= 0.1 s and "
                              "TPOT <= 0.001 s for 90% of requests; the best attainable is ")
    assert "TTFT p90 0.261 s" in message


def test_the_command_line_of_each_mode():
    knobs = Knobs(1024, 32)
    colocated = Candidate(Layout(colocated=2, colocated_cores=2), knobs).command("/m", "bfloat16", 16)
    assert shlex.join(colocated) == ("pdserve cluster --model /m --dtype bfloat16 --block-size 16 --colocated 2 "
                                     "--colocated-cores 0-3 --colocated-args '--max-num-batched-tokens 1024 "
                                     "--max-num-seqs 32'")
    pair = Candidate(Layout(prefill=1, prefill_cores=1, decode=1, decode_cores=3), Knobs(512, 64, "staged"))
    argv = pair.command("/m", "float32", 16)
    assert argv[argv.index("--prefill-cores") + 1] == "0" and argv[argv.index("--decode-cores") + 1] == "1-3"
    assert argv[argv.index("--decode-args") + 1] == "--max-num-batched-tokens 512 --max-num-seqs 64 --chunk-schedule staged"
    assert "--router-args" not in argv
    tp = Candidate(Layout(prefill=1, prefill_cores=2, decode=1, decode_cores=2, decode_tp=2),
                   knobs).command("/m", "float32", 16)
    assert tp[tp.index("--prefill-args") + 1] == "--max-num-batched-tokens 1024 --max-num-seqs 32"
    assert tp[tp.index("--decode-args") + 1] == ("--max-num-batched-tokens 1024 --max-num-seqs 32 "
                                                 "--tensor-parallel-size 2")
    hybrid = Candidate(Layout(prefill=1, prefill_cores=1, decode=1, decode_cores=1, local_prefill_max_tokens=128),
                       Knobs(512, 64)).command("/m", "float32", 16)
    assert shlex.join(hybrid) == (
        "pdserve cluster --model /m --dtype float32 --block-size 16 --prefill 1 --decode 1 --prefill-cores 0 "
        "--decode-cores 1 --prefill-args '--max-num-batched-tokens 512 --max-num-seqs 64' --decode-args "
        "'--max-num-batched-tokens 512 --max-num-seqs 64 --local-prefill' --router-args "
        "'--disaggregation auto --local-prefill-max-tokens 128'")


@pytest.mark.parametrize("argv, flag", [
    (["--devices", "0", "--ttft-slo", "1"], "--devices"),
    (["--devices", "2"], "--ttft-slo"),
    (["--devices", "2", "--ttft-slo", "-1"], "--ttft-slo"),
    (["--devices", "2", "--tpot-slo", "0.1", "--attainment", "1.5"], "--attainment"),
    (["--devices", "2", "--tpot-slo", "0.1", "--batched-tokens", "16", "--max-num-seqs", "64"], "--batched-tokens"),
    (["--devices", "2", "--tpot-slo", "0.1", "--chunk-schedules", "fast"], "--chunk-schedules"),
    (["--devices", "2", "--tpot-slo", "0.1", "--workload", "uniform"], "--workload uniform"),
    (["--devices", "2", "--tpot-slo", "0.1", "--batched-tokens", "0"], "--batched-tokens"),
    (["--devices", "2", "--tpot-slo", "0.1", "--local-prefill-max-tokens", "x"], "--local-prefill-max-tokens"),
    (["--devices", "2", "--tpot-slo", "0.1", "--validate", "1", "--validate-repeats", "0"], "--validate-repeats"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err.splitlines()[-1]


def test_every_probe_is_a_sustained_load_with_the_same_requests_at_every_rate():
    work = Traffic(lambda i: ((i + 1,), i + 1), num_requests=10, min_duration_s=5.0)
    low, high = work.at_rate(1.0), work.at_rate(4.0)
    assert (len(low), len(high)) == (10, 20)
    assert [(r.prompt_token_ids, r.output_len) for r in high[:10]] == [(r.prompt_token_ids, r.output_len) for r in low]
    # The bench's arrival pattern: the same intervals scaled by 1/rate.
    assert [r.arrival_s for r in high[:10]] == pytest.approx([r.arrival_s / 4 for r in low])


def test_the_tpot_budget_is_the_share_of_its_time_a_decode_node_can_give_times_its_prefill_speed():
    """One decode step over a 256-token context: 5 ms + 1 ms = 6 ms; a 256-token chunk: 0.261 s.
    Under a 30 ms TPOT the node can give 1 - 6/30 = 80% of its time: 0.8 x 256 / 0.261 tokens/s."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    assert tpot_prompt_budget(per_core, 0.03) == pytest.approx(0.8 * 256 / 0.261)
    assert tpot_prompt_budget(per_core, 0.006) is None  # one step takes the whole target
    assert tpot_prompt_budget(per_core, None) is None
    hybrid = Layout(prefill=1, prefill_cores=1, decode=1, decode_cores=1, local_prefill_max_tokens=256)
    tried = with_prompt_budgets(list(layouts(2, (256,))), {(1, 1): per_core, (2, 1): per_core}, 0.03)
    hybrids = [lay for lay in tried if lay.mode == "hybrid" and not lay.serve_prefill]  # a pool has no budget
    assert [lay.local_prefill_tokens_per_s for lay in hybrids] == [None, 785, 392, 196] * 2  # router on P, on D
    assert tried[-1].describe() == "1P (1 core) + 1D (1 core) hybrid<=256 196 tok/s, router on D"
    assert with_prompt_budgets([hybrid], {(1, 1): per_core}, None) == [hybrid]
    argv = Candidate(tried[-1], Knobs(512, 64)).command("/m", "float32", 16)
    assert argv[argv.index("--router-args") + 1] == ("--disaggregation auto --local-prefill-max-tokens 256 "
                                                     "--local-prefill-tokens-per-s 196")


def test_under_a_tight_tpot_the_budgeted_hybrid_serves_more_than_the_unbounded_one():
    """Prompts of 64 and 256 tokens under a 20 ms TPOT (a decode step is 6 ms): the unbounded hybrid's
    decode node computes every short prompt it can, each a stall of 70 ms or more, and its streams
    miss the TPOT; a quarter of the TPOT budget keeps them within it."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    profiles = {(1, 1): per_core, (2, 1): per_core}
    hybrids = [lay for lay in with_prompt_budgets(list(layouts(2, (256,))), profiles, 0.02)
               if lay.mode == "hybrid" and not lay.serve_prefill]
    unbounded, quarter = hybrids[0], hybrids[-1]
    goodput = {lay: evaluate(Candidate(lay, Knobs(512, 64)), BASE, profiles, mix(64, 256, 64),
                             Slo(ttft_s=1.0, tpot_s=0.02), SWEEP, 4096).prediction.goodput_rps
               for lay in (unbounded, quarter)}
    assert goodput[quarter] > 1.5 * goodput[unbounded] > 0


def predicted(layout: Layout, goodput: float, ttft_p90: float, tpot_p90: float) -> Evaluated:
    def dist(p90: float) -> Distribution:
        return Distribution(count=1, mean=p90, p50=p90, p90=p90, p99=p90)

    summary = replace(summarize([], Slo(), 1.0), ttft_s=dist(ttft_p90), tpot_s=dist(tpot_p90))
    return Evaluated(Candidate(layout, Knobs(512, 64)), Prediction(goodput, SimRun(goodput, summary), 3, True))


def test_within_the_tie_band_the_candidate_with_the_most_headroom_goes_first():
    """10.5 and 10.2 req/s are closer than the planner's own error: the one whose P90s sit further
    under the SLOs (0.80 of the TTFT SLO against 0.98) goes first; 9.9 is outside the band."""
    slo = Slo(ttft_s=4.0, tpot_s=0.035)
    split = Layout(prefill=1, prefill_cores=1, decode=1, decode_cores=1, router_on="prefill")
    tight = predicted(split, 10.5, ttft_p90=3.9, tpot_p90=0.02)
    roomy = predicted(replace(split, local_prefill_max_tokens=256), 10.2, ttft_p90=3.2, tpot_p90=0.017)
    outside = predicted(replace(split, router_on="decode"), 9.9, ttft_p90=1.0, tpot_p90=0.01)
    assert 10.5 * (1 - TIE_BAND) <= 10.2 and 10.5 * (1 - TIE_BAND) > 9.9
    assert slo_share(tight, slo) == pytest.approx(3.9 / 4.0)
    assert ranked([tight, outside, roomy], slo) == [roomy, tight, outside]
    assert ranked([tight, outside], slo) == [tight, outside]
    nothing = [predicted(split, 0.0, 9.0, 0.1), predicted(replace(split, router_on="decode"), 0.0, 8.0, 0.1)]
    assert [e.prediction.run.summary.ttft_s.p90 for e in ranked(nothing, slo)] == [8.0, 9.0]  # by rank_key


def test_the_stream_interval_joins_the_routers_other_flags_in_the_command():
    every = Knobs(512, 64, stream_interval=8)
    colocated = Candidate(Layout(colocated=2, colocated_cores=1), every).command("/m", "float32", 16)
    assert colocated[colocated.index("--router-args") + 1] == "--stream-interval 8"
    hybrid = Candidate(Layout(prefill=1, prefill_cores=1, decode=1, decode_cores=1, local_prefill_max_tokens=256,
                              router_on="prefill"), every).command("/m", "float32", 16)
    assert hybrid[hybrid.index("--router-args") + 1] == \
        "--disaggregation auto --local-prefill-max-tokens 256 --stream-interval 8"
    assert hybrid.count("--router-args") == 1
    pool = Candidate(Layout(decode=2, decode_cores=1, serve_prefill=True), every).command("/m", "float32", 16)
    assert pool[pool.index("--router-args") + 1] == "--disaggregation auto --stream-interval 8"
    once = Candidate(Layout(colocated=2, colocated_cores=1), Knobs(512, 64)).command("/m", "float32", 16)
    assert "--router-args" not in once  # one token per response: the router's default


def test_a_candidate_predicted_at_measured_step_speeds_is_one_whose_pools_profiles_ran_that_slow():
    """1P1D with the decode pool's steps 1.5× as long: the prediction of a profile 1.5× slower on
    the decode nodes only, and a lower goodput than as profiled."""
    per_core = synthetic_profile(base_s=0.005, per_token_s=0.001)
    slower = replace(per_core, step=per_core.step.scaled(1.5))
    pair = next(lay for lay in layouts(2) if lay.prefill == 1 and lay.decode == 1)
    candidate, work, slo = Candidate(pair, Knobs(512, 64)), traffic(64, 32), Slo(ttft_s=1.0, tpot_s=0.02)
    as_profiled = evaluate(candidate, BASE, {(1, 1): per_core}, work, slo, SWEEP, 4096)
    at_speed = evaluate(candidate, BASE, {(1, 1): per_core}, work, slo, SWEEP, 4096, step_scales={"decode": 1.5})
    spec = candidate.spec(BASE, {(1, 1): per_core}, ServingCosts())
    by_hand = replace(spec, decode=replace(spec.decode, profile=slower))
    assert spec.with_step_scales({"decode": 1.5}) == by_hand
    assert spec.with_step_scales({"colocated": 3.0}) == spec  # no such pool here: nothing changes
    sweep = replace(SWEEP, start_rate=start_rate(by_hand, work))
    assert at_speed.prediction == predict_goodput(by_hand, work, slo, 4096, sweep)
    assert 0 < at_speed.prediction.goodput_rps < as_profiled.prediction.goodput_rps
