"""Where `pdserve bench plan-validation --rescore` says a measured goodput lies (pdserve/bench/plan_validation.py)."""

from __future__ import annotations

import math

from pdserve.bench.plan_validation import _bracket, _bracket_over_rounds


def probe(rate: float, passed: bool) -> dict:
    return {"rate": rate, "attainment": 1.0 if passed else 0.5, "passed": passed}


def test_a_sweep_brackets_the_goodput_between_its_highest_pass_and_the_lowest_failure_above_it():
    assert _bracket([probe(12, False), probe(9.6, True), probe(10.8, False), probe(10.2, True)]) == (10.2, 10.8)
    assert _bracket([probe(8, True), probe(10, True)]) == (10, math.inf)  # nothing failed: no upper bound
    assert _bracket([probe(8, False)]) == (0.0, 8)


def test_over_rounds_the_bracket_spans_from_the_lowest_rounds_to_the_highest_rounds():
    rounds = [[probe(12, False), probe(9.6, True), probe(10.8, False)],  # 9.6 - 10.8
              [probe(12, False), probe(9.6, False), probe(7.7, True), probe(8.7, True)]]  # 8.7 - 9.6
    measured = {"probes": rounds[0], "rounds": [{"measured_goodput_rps": 9.6, "probes": rounds[0]},
                                                {"measured_goodput_rps": 8.7, "probes": rounds[1]}]}
    assert _bracket_over_rounds(measured) == (8.7, 10.8)
    # A report from before rounds: its one sweep.
    assert _bracket_over_rounds({"probes": rounds[1]}) == (8.7, 9.6)
