"""Which candidates `pdserve plan --validate` runs, and how it reports its error (pdserve/planner/validate.py).
The real runs are tests/e2e/test_plan_validate.py's."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.bench.serve import cli as serve_cli
from pdserve.bench.serve import report
from pdserve.bench.serve.metrics import RequestMetrics, Slo, summarize
from pdserve.bench.serve.runner import Run
from pdserve.bench.serve.sweep import SweepConfig, SweepResult
from pdserve.bench.serve.workload_flags import DEFAULT_NUM_REQUESTS, build_workload, workload_argv
from pdserve.bench.serve.workloads import ModelLimits
from pdserve.engine.step_shape import StepShape, StepTotals
from pdserve.planner import cli as plan_cli
from pdserve.planner.goodput import Prediction, SimRun
from pdserve.planner.search import Candidate, Evaluated, Knobs, Layout, layouts
from pdserve.planner.cpu_witness import CpuUse
from pdserve.planner.step_cost import StepCost
from pdserve.planner.step_speed import StepSpeed, parse_node_steps
from pdserve.planner.validate import (
    GROWTH, WARMUP_REQUESTS, Measurement, Validation, ValidationPlan, at_measured_inputs, chosen, client_argv,
    close_calls, measured_best, measurement, median_abs_goodput_error, median_spread, recommended_share_of_best,
    validated_choice,
)
from pdserve.planner.validation_inputs import step_speeds
from pdserve.planner.validation_report import format_validation, report_record
from pdserve.proto import node_pb2
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.router.fronts.metrics import RouterMetrics

EMPTY = summarize([], Slo(), 1.0)


def evaluated(layout: Layout, goodput: float, tokens: int = 256) -> Evaluated:
    return Evaluated(Candidate(layout, Knobs(tokens, 64)), Prediction(goodput, SimRun(goodput, EMPTY), 3, True))


def validation(e: Evaluated, *measured: float) -> Validation:
    """`e` measured once per goodput given, one round each."""
    return Validation(e, tuple(Measurement(m, None, SweepResult(best_rate=m or None)) for m in measured))


ONE_NODE_2_CORES, TWO_NODES_1_CORE, ONE_P_ONE_D, _ROUTER_ON_D = list(layouts(2))


def test_the_top_k_then_the_best_of_layouts_not_yet_chosen():
    ranking = [evaluated(TWO_NODES_1_CORE, 10), evaluated(TWO_NODES_1_CORE, 9, tokens=512),
               evaluated(ONE_NODE_2_CORES, 8), evaluated(ONE_NODE_2_CORES, 7, tokens=512), evaluated(ONE_P_ONE_D, 5)]
    assert chosen(ranking, 1, 2) == [ranking[0], ranking[2], ranking[4]]
    assert chosen(ranking, 2, 1) == [ranking[0], ranking[1], ranking[2]]
    assert chosen(ranking, 1, 0) == [ranking[0]]
    assert chosen(ranking, 3, 5) == [ranking[0], ranking[1], ranking[2], ranking[4]]


def test_the_error_is_relative_to_the_measurement_and_its_median_is_over_those_measured():
    vals = [validation(evaluated(TWO_NODES_1_CORE, 12), 10), validation(evaluated(ONE_NODE_2_CORES, 6), 8),
            validation(evaluated(ONE_P_ONE_D, 3), 0)]
    assert vals[0].goodput_error == 0.2 and vals[1].goodput_error == -0.25 and vals[2].goodput_error is None
    assert median_abs_goodput_error(vals) == (0.2 + 0.25) / 2
    assert median_abs_goodput_error([vals[2]]) is None


def test_the_recommendation_is_compared_per_device_with_the_best_measured():
    # colocated x1 on 2 cores measured 4 req/s (2 per device), colocated x2 on 1 core each 6 (3 per device).
    vals = [validation(evaluated(ONE_NODE_2_CORES, 5), 4), validation(evaluated(TWO_NODES_1_CORE, 4), 6)]
    assert ONE_NODE_2_CORES.devices == TWO_NODES_1_CORE.devices == 2
    assert recommended_share_of_best(vals) == 4 / 6
    assert recommended_share_of_best([validation(evaluated(ONE_NODE_2_CORES, 5), 0)]) is None


def test_the_report_names_each_layout_with_its_predicted_and_measured_goodput():
    vals = [validation(evaluated(ONE_P_ONE_D, 3), 2)]
    record = report_record(vals)
    [row] = record["candidates"]
    assert (row["layout"], row["predicted_goodput_rps"], row["measured_goodput_rps"], row["goodput_error"]) == \
        ("1P (1 core) + 1D (1 core), router on P", 3, 2, 0.5)
    assert record["median_abs_goodput_error"] == 0.5 and record["recommended_share_of_best_measured"] == 1.0
    lines = format_validation(vals).splitlines()
    assert lines[1].split("  ")[0] == "1P (1 core) + 1D (1 core), router on P" and "3/2" in lines[1] and "+50%" in lines[1]
    assert lines[2].startswith("median |goodput error|: 50%; the recommended configuration measured 100%")


def test_repeated_rounds_compare_the_prediction_with_their_median_and_report_their_spread():
    repeated = validation(evaluated(TWO_NODES_1_CORE, 12), 8, 10, 9)
    once = validation(evaluated(ONE_NODE_2_CORES, 6), 8)
    none_passed = validation(evaluated(ONE_P_ONE_D, 3), 0, 4, 0)
    assert repeated.measured_goodput_rps == 9 and repeated.goodput_error == (12 - 9) / 9
    assert repeated.spread == (10 - 8) / 9
    assert once.spread is None  # one round: no spread to speak of
    assert none_passed.measured_goodput_rps == 0 and none_passed.spread is None and none_passed.goodput_error is None
    assert median_spread([repeated, once, none_passed]) == (10 - 8) / 9
    assert median_spread([once]) is None

    record = report_record([repeated, once])
    assert [r["measured_goodput_rps"] for r in record["candidates"][0]["rounds"]] == [8, 10, 9]
    assert record["candidates"][0]["measured_spread"] == (10 - 8) / 9
    assert record["median_measured_spread"] == (10 - 8) / 9
    lines = format_validation([repeated, once]).splitlines()
    assert lines[0].endswith("measured by round (spread)")
    assert lines[1].endswith("8, 10, 9 (22%)") and lines[2].endswith("8 (-)")
    assert "median spread of the measured goodput over its rounds: 22%" in lines[4]


def test_a_candidate_that_passed_no_rate_counts_in_the_median_with_the_least_error_it_can_have():
    # Predicted 7.11; every probe from there down to 3.64 missed: the goodput is below 3.64.
    failed = Validation(evaluated(ONE_P_ONE_D, 7.11), (Measurement(0.0, None, SweepResult(failed_rate=3.64)),))
    measured = validation(evaluated(TWO_NODES_1_CORE, 8.8), 8.36)
    assert failed.measured_goodput_rps == 0 and failed.measured_below_rps == 3.64 and failed.error_is_a_bound
    assert failed.goodput_error == (7.11 - 3.64) / 3.64
    assert not measured.error_is_a_bound and measured.measured_below_rps is None
    assert median_abs_goodput_error([measured, failed]) == ((8.8 - 8.36) / 8.36 + (7.11 - 3.64) / 3.64) / 2
    row = report_record([failed])["candidates"][0]
    assert (row["measured_below_rps"], row["goodput_error_is_a_lower_bound"]) == (3.64, True)
    lines = format_validation([measured, failed]).splitlines()
    assert "7.11/<3.64" in lines[2] and "≥+95%" in lines[2]
    assert lines[4].startswith("(<R: no probed rate met the target")


def test_a_measurement_while_other_work_took_the_machine_is_marked_suspect():
    # 20 s of two cores' time: the cluster took 30 s; steal 1 s and others 3 s (10%) in one round.
    quiet, taken = CpuUse(40.0, 0.0, 30.0, 1.0), CpuUse(40.0, 1.0, 30.0, 3.0)
    e = evaluated(TWO_NODES_1_CORE, 12)
    sweep = SweepResult(best_rate=8)
    clean = Validation(e, (Measurement(8, None, sweep, quiet),))
    noisy = Validation(evaluated(ONE_P_ONE_D, 6),
                       (Measurement(8, None, sweep, quiet), Measurement(8, None, sweep, taken)))
    assert (clean.taken_share, clean.suspect) == (1.0 / 40, False)
    assert (noisy.taken_share, noisy.suspect) == (0.1, True)
    unwatched = validation(e, 8)
    assert (unwatched.taken_share, unwatched.suspect) == (None, False)
    record = report_record([clean, noisy])
    assert [(r["cpu_taken_share"], r["suspect"]) for r in record["candidates"]] == [(1.0 / 40, False), (0.1, True)]
    assert record["candidates"][1]["rounds"][1]["cpu"] == {"capacity_s": 40.0, "steal_s": 1.0, "tree_s": 30.0,
                                                           "others_s": 3.0, "taken_share": 0.1}
    lines = format_validation([clean, noisy]).splitlines()
    assert "12/8 " in lines[1] and "6/8*" in lines[2]
    assert any(line.startswith("(*: steal or processes outside the cluster took 10% or more") for line in lines)
    assert not any(line.startswith("(*:") for line in format_validation([clean]).splitlines())


# -- the client: `pdserve bench serve` in a process of its own ------------------------------------
PLAN_FLAGS = {
    "fixed": ["--workload", "fixed", "--input-len", "40", "--output-len", "9"],
    "uniform": ["--workload", "uniform", "--input-len-range", "8:300", "--output-len-range", "2:70",
                "--arrival", "gamma", "--cv", "1.5"],
    "chat": ["--workload", "chat", "--chat-input-mean", "123.5", "--chat-output-mean", "33", "--chat-sigma", "0.7",
             "--num-requests", "17", "--seed", "5"],
}


@pytest.mark.parametrize("kind", sorted(PLAN_FLAGS))
def test_the_client_sends_the_plans_own_requests_and_sweeps_from_the_prediction(kind, tmp_path):
    planned = plan_cli._parser().parse_args(["--devices", "2", "--ttft-slo", "0.5", "--tpot-slo", "0.05",
                                             "--min-duration-s", "12", *PLAN_FLAGS[kind]])
    sweep = SweepConfig(0.8, tolerance=0.03, max_probes=5)
    plan = ValidationPlan(tuple(workload_argv(planned)), Slo(0.5, 0.05), sweep, "float32", 16)

    argv = client_argv("127.0.0.1:5000", 7.3, plan, tmp_path / "bench.json", devices=2)

    assert argv[:5] == [sys.executable, "-m", "pdserve", "bench", "serve"]
    client = serve_cli._parser().parse_args(argv[5:])
    serve_cli._check_args(serve_cli._parser(), client)
    assert serve_cli._sweep_config(client) == SweepConfig(0.8, start_rate=7.3, tolerance=0.03, max_probes=5,
                                                          growth=GROWTH)
    assert (client.addr, client.ttft_slo, client.tpot_slo) == ("127.0.0.1:5000", 0.5, 0.05)
    assert client.devices == 2  # its report's goodput per device is the candidate's
    assert (client.min_duration_s, client.warmup_requests, client.output_json) == \
        (12.0, WARMUP_REQUESTS, tmp_path / "bench.json")
    assert (client.num_requests, client.arrival, client.cv, client.seed) == \
        (planned.num_requests or DEFAULT_NUM_REQUESTS, planned.arrival, planned.cv, planned.seed)
    limits = ModelLimits(vocab_size=500, max_model_len=2048)
    measured, predicted = build_workload(client, limits), build_workload(planned, limits)
    assert [measured.request(i, run=1) for i in range(20)] == [predicted.request(i, run=1) for i in range(20)]


def test_a_candidate_without_a_prediction_is_swept_from_the_plans_start_rate(tmp_path):
    plan = ValidationPlan(("--workload", "fixed"), Slo(None, 0.05), SweepConfig(start_rate=2.5), "float32", 16)
    client = serve_cli._parser().parse_args(client_argv("h:1", 0.0, plan, tmp_path / "b.json")[5:])
    assert (client.start_rate, client.ttft_slo, client.tpot_slo) == (2.5, None, 0.05)


def test_a_measurement_is_read_back_from_the_clients_json(tmp_path):
    slo = Slo(ttft_s=0.5)
    def request(index: int, ttft_s: float) -> RequestMetrics:
        return RequestMetrics(index, "OK", 8, 3, 3, due_s=0.1 * index, send_lag_s=0.001, ttft_s=ttft_s, tpot_s=0.02,
                              e2e_s=ttft_s + 0.04, itl_s=(0.02, 0.02), error="", request_id=f"r{index}")

    fast, slow = request(0, 0.1), request(1, 0.9)
    runs = [Run(rate, list(metrics), summarize(list(metrics), slo, 1.5))
            for rate, metrics in ((4.2, (fast, fast)), (5.25, (fast, slow)), (4.725, (fast, fast)))]
    sweep = SweepResult()
    for run in runs:
        sweep.record(run.rate, run, 0.9)
    sweep.converged = True
    path = tmp_path / "bench.json"
    report.write_json(path, {}, {}, runs, report.sweep_record(sweep, 0.9, 1))

    measured = measurement(json.loads(path.read_text()), 4.2)

    assert measured.goodput_rps == 4.725
    assert (measured.sweep.failed_rate, measured.sweep.converged) == (5.25, True)
    assert [(p.rate, p.passed, p.result) for p in measured.sweep.probes] == [(r.rate, r.attainment >= 0.9, r.summary)
                                                                            for r in runs]
    assert measured.at_predicted_rate == runs[0].summary
    assert measurement(json.loads(path.read_text()), 0.0).at_predicted_rate is None


def test_a_validation_adds_what_it_measured_to_the_track_record_and_says_when_it_cannot(tmp_path, monkeypatch):
    """`_measure` (a real cluster and client: tests/e2e/test_plan_validate.py) is replaced by
    fixed measurements; what is checked is what the record keeps of them."""
    from pdserve.planner import validate as validate_module
    from pdserve.planner.track_record import ValidationLog

    measured = {TWO_NODES_1_CORE: 10.0, ONE_P_ONE_D: 0.0}  # the pair passed no probed rate, failed at 4
    monkeypatch.setattr(validate_module, "_measure", lambda e, model, plan, log: Measurement(
        measured[e.candidate.layout], None, SweepResult(best_rate=measured[e.candidate.layout] or None,
                                                         failed_rate=4.0)))
    candidates = [evaluated(TWO_NODES_1_CORE, 12), evaluated(ONE_P_ONE_D, 6)]
    log = ValidationLog(tmp_path, {"model": "m"})
    plan = ValidationPlan((), Slo(1.0, 0.05), SweepConfig(0.9), "float32", 16, validation_log=log)
    validate_module.validate(candidates, "model", plan, log=lambda line: None)
    kept = log.read()
    assert [(c.mode, c.layout, c.predicted_goodput_rps, c.goodput_error, c.error_is_a_bound, c.suspect)
            for c in kept] == [("colocated", TWO_NODES_1_CORE.describe(), 12, 0.2, False, False),
                               ("disaggregated", ONE_P_ONE_D.describe(), 6, 0.5, True, False)]
    assert kept[0].when == kept[1].when  # one validation

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    said: list[str] = []
    plan = ValidationPlan((), Slo(1.0, 0.05), SweepConfig(0.9), "float32", 16,
                          validation_log=ValidationLog(blocked, {"model": "m"}))
    assert len(validate_module.validate(candidates, "model", plan, log=said.append)) == 2  # it stands
    [line] = said
    assert line.startswith(f"validate: could not keep this validation's errors in {blocked / 'validations.jsonl'}: ")


def test_close_calls_are_the_best_of_each_other_layout_within_the_measured_error_of_the_first():
    # per device: 5 (first), 4.75 (same layout), 4.5, 3.5
    ranking = [evaluated(TWO_NODES_1_CORE, 10), evaluated(TWO_NODES_1_CORE, 9.5, tokens=512),
               evaluated(ONE_NODE_2_CORES, 9), evaluated(ONE_P_ONE_D, 7)]
    assert close_calls(ranking, 0.15) == ([ranking[2]], 1)
    assert close_calls(ranking, 0.35) == ([ranking[2], ranking[3]], 2)
    assert close_calls(ranking, 0.05) == ([], 0)
    assert close_calls([], 0.5) == ([], 0) and close_calls([evaluated(ONE_P_ONE_D, 0)], 0.5) == ([], 0)
    # An error of 100% or more: a layout that meets the SLOs at no rate is still no close call.
    assert close_calls([ranking[0], evaluated(ONE_P_ONE_D, 0)], 1.5) == ([], 0)
    # Near ties go by their headroom: a layout outside the error may rank before the last close one,
    # and measuring that one too takes one more --validate-others.
    by_headroom = [ranking[0], evaluated(ONE_P_ONE_D, 7), evaluated(ONE_NODE_2_CORES, 9)]
    assert close_calls(by_headroom, 0.15) == ([by_headroom[2]], 2)


def test_the_validated_choice_is_the_best_measured_unless_the_runs_spread_cannot_tell_it_from_the_first():
    first, other = evaluated(TWO_NODES_1_CORE, 10), evaluated(ONE_P_ONE_D, 9)
    lead = [validation(first, 8), validation(other, 10)]
    assert measured_best(lead) is lead[1] and validated_choice(lead) is lead[1]  # one round: the measurement decides
    within_spread = [validation(first, 8, 9, 10), validation(other, 10)]  # the first's rounds spread 22%
    assert measured_best(within_spread) is within_spread[1] and validated_choice(within_spread) is within_spread[0]
    beyond_spread = [validation(first, 6, 7, 6.5), validation(other, 10)]
    assert validated_choice(beyond_spread) is beyond_spread[1]
    tie = [validation(first, 9), validation(other, 9)]
    assert validated_choice(tie) is tie[0]  # equals: the ranking's first
    assert validated_choice([validation(first, 0), validation(other, 0)]) is None
    # per device: colocated x1 on its one core measured 4 (4 per device), the pair on two 6 (3 per device)
    [one_device] = layouts(1)
    per_device = [validation(evaluated(one_device, 5), 4), validation(other, 6)]
    assert measured_best(per_device) is per_device[0] and validated_choice(per_device) is per_device[0]
    # The first measured while other work took 10% of the machine: slowed by as much, not shown worse.
    def slowed(goodput: float) -> Validation:
        return Validation(first, (Measurement(goodput, None, SweepResult(best_rate=goodput or None),
                                              CpuUse(40.0, 1.0, 30.0, 3.0)),))
    assert slowed(9.5).suspect and validated_choice([slowed(9.5), validation(other, 10)]).evaluated is first
    assert validated_choice([slowed(8), validation(other, 10)]).evaluated is other  # a lead beyond that
    assert validated_choice([slowed(0), validation(other, 10)]).evaluated is other


def test_each_round_reads_its_nodes_step_speed_from_the_routers_counters_and_the_report_sums_the_rounds():
    nodes = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0, clock=lambda: 0.0)
    nodes.register(NodeKind.PREFILL, "127.0.0.1:1", "prefill-0")
    nodes.register(NodeKind.DECODE, "127.0.0.1:2", "decode-0")
    registry = CollectorRegistry()
    RouterMetrics(registry, nodes)
    cost = StepCost(0.01, 0.001, 0.0, 0.0, 0.0)  # 10 ms a step, 1 ms a token
    counts = {"prefill-0": StepTotals(), "decode-0": StepTotals()}

    def run(node: str, steps: int, tokens: int, cpu_ratio: float) -> None:
        for _ in range(steps):
            shape = StepShape(tokens, 1, 0, 0)
            counts[node].add(shape, 2 * cpu_ratio * cost.time(shape), cpu_ratio * cost.time(shape))
            nodes.heartbeat(node, node_pb2.NodeStats(steps=node_pb2.StepTotals(**dataclasses.asdict(counts[node]))))

    run("prefill-0", 3, 100, 1.0)  # before the sweep: not counted
    run("decode-0", 1, 1, 1.0)
    before = generate_latest(registry).decode()
    run("prefill-0", 20, 100, 1.2)  # 2.2 s predicted
    run("decode-0", 200, 1, 0.9)  # 2.2 s predicted
    after = parse_node_steps(generate_latest(registry).decode())
    speeds = step_speeds(parse_node_steps(before), after, ONE_P_ONE_D, {(1, 1): cost})
    assert speeds["prefill"].cpu_ratio == pytest.approx(1.2) and speeds["prefill"].steps == 20
    assert speeds["decode"].cpu_ratio == pytest.approx(0.9) and speeds["decode"].clock_ratio == pytest.approx(1.8)
    assert step_speeds(parse_node_steps(before), after, ONE_P_ONE_D, {}) == {}  # no profile: no speed

    e = evaluated(ONE_P_ONE_D, 3)
    second = {"prefill": StepSpeed(20, 2.2, 4.4, 2.2 * 1.4), "decode": speeds["decode"]}
    v = Validation(e, (Measurement(2, None, SweepResult(best_rate=2), speeds=speeds),
                       Measurement(2, None, SweepResult(best_rate=2), speeds=second)))
    row = report_record([v])["candidates"][0]
    assert row["step_speeds"]["prefill"]["cpu_ratio"] == pytest.approx(1.3)  # both rounds' steps as one
    assert row["rounds"][1]["step_speeds"]["prefill"]["cpu_ratio"] == pytest.approx(1.4)
    lines = format_validation([v]).splitlines()
    assert "steps/profile" in lines[0] and "P 1.30 D 0.90" in lines[1]

    asked = []

    def repredict(e: Evaluated, steps: dict[str, float], stack: dict[str, float]) -> float:
        asked.append((e, steps, stack))
        return 2.5

    unmeasured = validation(evaluated(ONE_NODE_2_CORES, 6), 8)  # no step counted: not predicted again
    again, same = at_measured_inputs([v, unmeasured], repredict)
    [(e_asked, scales, stack)] = asked
    assert e_asked is e and scales == {"prefill": pytest.approx(1.3), "decode": pytest.approx(0.9)} and stack == {}
    assert same is unmeasured and same.error_at_speeds is None
    assert again.predicted_at_speeds_rps == 2.5 and again.error_at_speeds == pytest.approx(0.25)
    record = report_record([again, same])
    assert record["candidates"][0]["goodput_error_at_step_speeds"] == pytest.approx(0.25)
    assert record["median_abs_goodput_error_at_step_speeds"] == pytest.approx(0.25)
    lines = format_validation([again, same]).splitlines()
    assert "2.5 (+25%)" in lines[1]
    assert re.split(r"\s{2,}", lines[2])[5:8] == ["-", "-", "-"]  # no step or stack speed, no prediction at them
    assert ("median |goodput error| predicted again at the step speeds and stack CPU measured: 25%, against 50% as "
            "first predicted for the same candidates") in "\n".join(lines)
