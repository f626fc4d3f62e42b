"""`pdserve plan --calibrate` (pdserve/planner/calibration.py): the medians of what earlier validations
measured of the profile's inputs, kept with each record, and a plan predicting with them."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.dtype_choice import resolve_dtype
from pdserve.planner.calibration import Calibration, digest, pool_key
from pdserve.planner.cli import main
from pdserve.planner.profile import (
    ClientCost, FrontCost, NodeSetup, ProfileCache, RouterCost, ServingCosts, machine_facts, model_hash, profile_key,
)
from pdserve.planner.profile_cli import serving_costs_for
from pdserve.planner.search import layouts
from pdserve.planner.track_record import Checked, ValidationLog, record_key
from tests.unit.planner_profiles import synthetic_profile
from tests.unit.test_planner_cli import balanced, own_cache, planned  # noqa: F401 - the module's fixture

WHEN = "2026-12-07T10:00:00+00:00"


def checked(when: str, steps: dict[str, float], stack: dict[str, float], against: str = "now") -> Checked:
    """A validated candidate whose scales were all measured against inputs named `against`."""
    return Checked(when, "colocated", "colocated x2 (1 core each)", 10.0, 0.3, False, False, steps, stack,
                   {k: against for k in (*steps, *stack)})


CURRENT = {"colocated 1x1": {"now"}, "decode 1x1": {"now"}, "router": {"now"}, "client": {"now"}}


def test_the_calibration_is_each_inputs_median_over_the_candidates_that_measured_it():
    found = Calibration.of([
        checked(WHEN, {"colocated 1x1": 1.2}, {"router": 1.3, "client": 1.5}),
        checked(WHEN, {"colocated 1x1": 1.1, "decode 1x1": 1.4}, {"router": 1.1}),
        checked("2026-12-07T11:00:00+00:00", {"colocated 1x1": 1.3}, {"router": 1.2, "client": 1.6}),
        checked("2026-12-07T12:00:00+00:00", {}, {}),  # measured nothing: no say, and not counted
        # Against a profile measured since again: moot.
        checked("2026-12-07T13:00:00+00:00", {"colocated 1x1": 9.0}, {"router": 9.0}, against="before"),
    ], CURRENT)
    assert found.steps == {"colocated 1x1": pytest.approx(1.2), "decode 1x1": 1.4}
    assert found.stack == {"router": pytest.approx(1.2), "client": pytest.approx(1.55)}
    assert found.validations == 2
    pair = next(lay for lay in layouts(2) if lay.prefill == 1 and lay.decode == 1)
    assert found.step_scales(pair) == {"decode": 1.4}  # no prefill pool of one core was validated
    costs = ServingCosts(RouterCost(0.001, 0.0001, "x"), FrontCost(0.001, 0.0001, "x"), ClientCost(0.002, 0.0002, "x"))
    stack, steps = Calibration.applied(found, pair, costs)
    assert steps == {"decode": 1.4} and stack.fronts == costs.fronts
    assert stack.router.per_token_s == pytest.approx(0.00012) and stack.client.per_request_s == pytest.approx(0.0031)
    assert Calibration.applied(None, pair, costs) == (costs, None)
    assert Calibration.of([], CURRENT).empty and "nothing to calibrate with yet" in Calibration.of([], CURRENT).text()


def test_a_record_keeps_what_its_runs_measured_and_reads_back_older_lines_without_it(tmp_path):
    log = ValidationLog(tmp_path, {"model": "m"})
    log.add([checked(WHEN, {"colocated 1x1": 1.25}, {"router": 1.5})])
    old = {"key": {"model": "m"}, "when": WHEN, "mode": "colocated", "layout": "x", "predicted_goodput_rps": 1.0,
           "goodput_error": 0.1, "error_is_a_bound": False, "suspect": False}  # a line from before the fields
    with (tmp_path / "validations.jsonl").open("a") as f:
        f.write(json.dumps(old) + "\n")
    kept, older = log.read()
    assert (kept.step_scales, kept.stack_scales) == ({"colocated 1x1": 1.25}, {"router": 1.5})
    assert (older.step_scales, older.stack_scales) == ({}, {})
    assert pool_key("colocated", (1, 1)) == "colocated 1x1"


def test_a_calibrated_plan_predicts_with_the_recorded_inputs_and_says_so(planned, tmp_path, capsys):  # noqa: F811
    model, profiles, out_file = own_cache(planned, tmp_path)
    argv = balanced(model, profiles, out_file)
    assert main(argv) == 0
    raw = {c["layout"]: c["predicted_goodput_rps"] for c in json.loads(out_file.read_text())["candidates"]}

    assert main([*argv, "--calibrate"]) == 0  # no record yet: the profile as measured, said
    assert "calibration: nothing to calibrate with yet" in capsys.readouterr().err
    assert {c["layout"]: c["predicted_goodput_rps"] for c in json.loads(out_file.read_text())["candidates"]} == raw

    machine = synthetic_profile().machine
    key = record_key(model_hash(model), machine, resolve_dtype("auto"), 16)
    cache = ProfileCache(profiles)
    step = digest(cache.load(profile_key(model_hash(model), machine_facts(), NodeSetup(1, resolve_dtype("auto"),
                                                                                         16))).step)
    stack = digest(serving_costs_for(model, cache))
    ValidationLog(profiles, key).add([Checked(WHEN, "colocated", "x", 10.0, 0.3, False, False, {"colocated 1x1": 2.0},
                                              {"router": 1.5}, {"colocated 1x1": step, "router": stack})])
    assert main([*argv, "--calibrate"]) == 0
    assert ("calibrated by 1 past validation: steps colocated 1x1 ×2.00; stack CPU router ×1.50"
            in capsys.readouterr().err)
    report = json.loads(out_file.read_text())
    assert report["calibration"] == {"step_speeds": {"colocated 1x1": 2.0}, "stack_ratios": {"router": 1.5},
                                     "validations": 1}
    calibrated = {c["layout"]: c["predicted_goodput_rps"] for c in report["candidates"]}
    slower = "colocated x2 (1 core each)"
    assert 0 < calibrated[slower] < raw[slower]  # its nodes' steps twice as long


def test_the_errors_of_calibrated_predictions_are_kept_apart_from_the_profiles(tmp_path):
    log = ValidationLog(tmp_path, {"model": "m"})
    log.add([checked(WHEN, {"colocated 1x1": 1.2}, {}),
             Checked(WHEN, "colocated", "x", 10.0, 0.05, False, False, calibrated=True)])
    [plain], [calibrated] = log.read(), log.read(calibrated=True)
    assert (plain.goodput_error, calibrated.goodput_error) == (0.3, 0.05)
