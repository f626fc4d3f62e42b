"""Which candidates `pdserve plan --validate` runs, and how it reports its error (planner/validate.py).
The real runs are tests/e2e/test_plan_validate.py's."""

from __future__ import annotations

from pdserve.bench.serve.metrics import Slo, summarize
from pdserve.bench.serve.sweep import SweepResult
from pdserve.planner.goodput import Prediction, SimRun
from pdserve.planner.search import Candidate, Evaluated, Knobs, Layout, layouts
from pdserve.planner.validate import (
    Measurement, Validation, chosen, format_validation, median_abs_goodput_error, median_spread,
    recommended_share_of_best, report_record,
)

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
