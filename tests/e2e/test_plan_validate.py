"""`pdserve plan --validate 1` as a user runs it, on the tiny model: the plan (on a profile in the
cache: measuring one is tests/integration/test_planner_tp_profile.py's), then the recommended
cluster started with the printed command line and swept for real, predicted beside measured in
the table and the JSON."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from pdserve.engine.dtype_choice import resolve_dtype
from pdserve.planner.profile import (
    PROFILE_VERSION, NodeSetup, ProfileCache, machine_facts, model_hash, profile_key,
)
from tests.unit.planner_profiles import store_synthetic_costs, synthetic_profile


def test_plan_validate_runs_the_recommended_cluster_and_reports_predicted_beside_measured(tiny_model, tmp_path):
    out_file = tmp_path / "plan.json"
    cache = ProfileCache(tmp_path / "profiles")
    digest, machine = model_hash(tiny_model), machine_facts()
    cache.store(profile_key(digest, machine, NodeSetup(1, resolve_dtype("auto"), 16)),
                synthetic_profile(base_s=0.002, per_token_s=0.0001))
    store_synthetic_costs(cache, digest, machine)
    # Loose SLOs: every real run meets them, so what is checked is the plumbing, never a timing.
    argv = [sys.executable, "-m", "pdserve", "plan", "--model", str(tiny_model), "--devices", "1",
            "--profile-dir", str(tmp_path / "profiles"), "--no-progress", "--workload", "fixed",
            "--input-len", "24", "--output-len", "4", "--num-requests", "6", "--min-duration-s", "0",
            "--batched-tokens", "256", "--ttft-slo", "60", "--tpot-slo", "10", "--max-probes", "3",
            "--validate", "1", "--validate-probes", "2", "--output-json", str(out_file)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads(out_file.read_text())
    validation = report["validation"]
    [checked] = validation["candidates"]  # one device: colocated x1 is the only layout
    assert checked["layout"] == "colocated x1 (1 core)" == report["candidates"][0]["layout"]
    assert checked["predicted_goodput_rps"] == report["recommended"]["predicted_goodput_rps"] > 0
    probes = checked["probes"]
    assert 1 <= len(probes) <= 2
    assert probes[0]["rate"] == checked["predicted_goodput_rps"]  # the sweep starts at the prediction
    assert all(p["passed"] and p["attainment"] == 1.0 for p in probes)
    assert checked["measured_goodput_rps"] == max(p["rate"] for p in probes)
    assert checked["goodput_error"] == (checked["predicted_goodput_rps"] - checked["measured_goodput_rps"]) \
        / checked["measured_goodput_rps"]
    measured = checked["at_predicted_rate"]
    assert measured["attainment"]["measured"] == 1.0
    assert measured["ttft_p90_s"]["measured"] > 0 and measured["tpot_p90_s"]["measured"] > 0
    assert validation["median_abs_goodput_error"] == abs(checked["goodput_error"])
    assert validation["recommended_share_of_best_measured"] == 1.0
    # The one candidate measured is the validated choice: the plan ends with its measured goodput and command.
    choice = report["validated_choice"]
    assert (choice["rank"], choice["command"]) == (1, report["recommended"]["command"])
    assert choice["measured_goodput_rps"] == checked["measured_goodput_rps"]
    assert result.stdout.splitlines()[-2].startswith(
        f"best: colocated x1 (1 core), measured goodput {checked['measured_goodput_rps']:.3g} req/s")
    assert result.stdout.splitlines()[-1] == shlex.join(choice["command"])

    table = result.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("layout "))
    assert table[header].split()[:3] == ["layout", "goodput", "pred/meas"]
    assert table[header + 1].startswith("colocated x1 (1 core)")
    assert table[header + 2].startswith("median |goodput error|: ")
    assert "validate: starting colocated x1 (1 core): pdserve cluster --model" in result.stderr
    # The client is `pdserve bench serve` in a process of its own, its command line logged to run again.
    assert "validate: colocated x1 (1 core): pdserve bench serve --addr 127.0.0.1:" in result.stderr
    assert "validate: colocated x1 (1 core): goodput at attainment >= 0.9" in result.stderr
    # What else took the machine while it was measured: the cluster and the client are this
    # process's tree, so their CPU is the tree's, not the others'.
    cpu = checked["rounds"][0]["cpu"]
    assert cpu["capacity_s"] > 0 and cpu["tree_s"] > 0 and cpu["others_s"] >= 0 and cpu["steal_s"] >= 0
    assert checked["cpu_taken_share"] == cpu["taken_share"]
    assert "validate: colocated x1 (1 core): while it was measured, steal took " in result.stderr
    # How its steps and its stack ran against the profile, read from the router's counters and /proc:
    # the router served the warm-up's and every probe's requests of 4 tokens, which the synthetic
    # costs price at 0.1 ms a request and 0.01 ms a token for each of the router, a front, the client.
    steps = checked["step_speeds"]["colocated"]
    assert steps["steps"] >= 4 and steps["predicted_s"] > 0.002 * steps["steps"] and steps["cpu_seconds"] > 0
    served = 4 + 6 * len(probes)
    for role in ("router", "fronts", "client"):
        stack = checked["stack_speeds"][role]
        assert stack["predicted_s"] == pytest.approx(served * (1e-4 + 4 * 1e-5)) and stack["cpu_s"] > 0, role
    assert "validate: colocated x1 (1 core): its steps against the profile: colocated: " in result.stderr

    # The plan had no error bar yet; its validation is now the record the next plan prints.
    assert "measured error: none yet for this model on this machine" in result.stdout
    assert report["track_record"]["overall"] is None
    [kept] = [json.loads(line) for line in (tmp_path / "profiles" / "validations.jsonl").read_text().splitlines()]
    assert kept["layout"] == checked["layout"] and kept["mode"] == "colocated"
    assert kept["goodput_error"] == checked["goodput_error"] and kept["suspect"] == checked["suspect"]
    assert kept["key"]["model"] == digest and kept["key"]["profile_version"] == PROFILE_VERSION
