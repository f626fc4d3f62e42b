"""`pdserve plan` end to end on a tiny model folder with synthetic profiles already in the cache:
the table, the JSON it writes, the recommended command, and the refusal of SLOs nothing meets."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine.dtype_choice import resolve_dtype
from pdserve.model_factory import make_model
from pdserve.planner.cli import main
from pdserve.planner.profile import (
    NodeSetup, ProfileCache, machine_facts, model_hash, profile_key,
)
from tests.unit.planner_profiles import store_synthetic_costs, synthetic_profile


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A model folder and a profile cache holding synthetic profiles for 1 and 2 threads, and for
    2 threads as TP 2."""
    root = tmp_path_factory.mktemp("plan")
    model = make_model(root / "tiny", "llama", "tiny", dtype=torch.float32)
    cache = ProfileCache(root / "profiles")
    digest, machine, dtype = model_hash(model), machine_facts(), resolve_dtype("auto")
    for threads in (1, 2):
        profile = synthetic_profile(base_s=0.005, per_token_s=0.001 / threads, threads=threads)
        cache.store(profile_key(digest, machine, NodeSetup(threads, dtype, 16)), profile)
    tp2 = synthetic_profile(base_s=0.005, per_token_s=0.0004, threads=2)
    cache.store(profile_key(digest, machine, NodeSetup(2, dtype, 16, tensor_parallel_size=2)), tp2)
    store_synthetic_costs(cache, digest, machine)
    return str(model), str(cache.folder)


def plan(planned, *flags: str) -> list[str]:
    model, profiles = planned
    return ["--model", model, "--profile-dir", profiles, "--devices", "2", "--no-progress", "--workload", "fixed",
            "--input-len", "128", "--output-len", "16", "--num-requests", "40", "--min-duration-s", "0",
            "--batched-tokens", "256", *flags]


def own_cache(planned, tmp_path) -> tuple[str, Path, Path]:
    """(the model, a copy of the module's profile cache that a test may add to, the plan's JSON file)."""
    model, _ = planned
    profiles = tmp_path / "profiles"
    shutil.copytree(planned[1], profiles)
    return model, profiles, tmp_path / "plan.json"


def balanced(model: str, profiles: Path, out_file: Path, *flags: str) -> list[str]:
    """A plan's argv under SLOs every layout can meet, with its JSON written to `out_file`."""
    return plan((model, str(profiles)), "--ttft-slo", "2", "--tpot-slo", "0.5", "--output-json", str(out_file), *flags)


def test_plan_prints_the_ranking_and_writes_the_recommendation(planned, tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    assert main(plan(planned, "--ttft-slo", "2", "--tpot-slo", "0.5", "--output-json", str(out_file))) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["#", "layout", "tokens"]
    report = json.loads(out_file.read_text())
    best = report["recommended"]
    assert best["command"][:2] == ["pdserve", "cluster"] and best["mode"] in ("colocated", "disaggregated", "hybrid")
    assert best["predicted_goodput_rps"] > 0
    assert set(best["predicted"]) == {"ttft_p90_s", "tpot_p90_s"}
    # colocated x1, colocated x2, the two decode nodes serving prefill, and with the router on each
    # pool's core: 1P1D and its hybrid at the router's bound, without a prompt budget and with 1, 1/2
    # and 1/4 of what the 0.5 s TPOT leaves its decode node; one knob setting
    hybrids = [c for c in report["candidates"] if c["mode"] == "hybrid"]
    assert len(hybrids) == 9 and len(report["candidates"]) == 13
    pools = [c for c in hybrids if "--serve-prefill" in c["command"][c["command"].index("--decode-args") + 1]]
    assert len(pools) == 1 and pools[0]["command"][pools[0]["command"].index("--prefill") + 1] == "0"
    hybrids = [c for c in hybrids if c not in pools]
    hybrids = [c for c in hybrids if c["command"][c["command"].index("--router-cores") + 1] == "1"]
    budgets = sorted((c["command"][c["command"].index("--router-args") + 1] for c in hybrids), key=len)
    assert budgets[0] == "--disaggregation auto --local-prefill-max-tokens 256"
    rates = sorted(float(b.split()[-1]) for b in budgets[1:])
    assert rates[0] > 0 and rates[2] == pytest.approx(4 * rates[0], abs=2)  # rounded to whole tokens
    assert report["candidates"][0]["command"] == best["command"]
    # At its goodput rate at least 90% of requests meet both SLOs. (Its P90s may lie a little above
    # them: a percentile interpolates between the last request that met the SLO and the next.)
    assert report["candidates"][0]["predicted"]["attainment"] >= 0.9
    assert lines[-1] == shlex.join(best["command"])
    assert report["traffic"] == {"num_requests": 40, "min_duration_s": 0.0}  # what a re-prediction must send


def test_no_hybrid_leaves_the_hybrid_splits_out(planned, tmp_path):
    out_file = tmp_path / "plan.json"
    assert main(plan(planned, "--ttft-slo", "2", "--no-hybrid", "--output-json", str(out_file))) == 0
    modes = [c["mode"] for c in json.loads(out_file.read_text())["candidates"]]
    assert sorted(modes) == ["colocated", "colocated", "disaggregated", "disaggregated"]


def test_slos_nothing_meets_are_refused_in_one_line(planned, capsys):
    assert main(plan(planned, "--ttft-slo", "0.01", "--max-probes", "3")) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("pdserve plan: --ttft-slo/--tpot-slo: no configuration on 2 devices meets TTFT <= 0.01 s")
    assert "the best attainable is " in last and "TTFT p90 " in last


def test_tp_sizes_are_searched_where_they_divide_a_nodes_cores(planned, tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    assert main(plan(planned, "--ttft-slo", "2", "--no-hybrid", "--tp", "1,2", "--output-json", str(out_file))) == 0
    candidates = json.loads(out_file.read_text())["candidates"]
    assert sorted(c["layout"] for c in candidates) == [
        "1P (1 core) + 1D (1 core), router on D", "1P (1 core) + 1D (1 core), router on P",
        "colocated x1 (2 cores TP 2)", "colocated x1 (2 cores)",
        "colocated x2 (1 core each)"]
    tp = next(c for c in candidates if "TP 2" in c["layout"])
    assert tp["command"][-1] == "--max-num-batched-tokens 256 --max-num-seqs 64 --tensor-parallel-size 2"


def test_a_stream_interval_that_relieves_a_busy_router_is_recommended_in_the_command(planned, tmp_path):
    """Costs where one token per response takes the router 4 ms and eight per response 0.5 ms a
    token: the router bounds the goodput, and every layout is tried at both intervals."""
    model, profiles, out_file = own_cache(planned, tmp_path)
    cache, digest, machine = ProfileCache(profiles), model_hash(model), machine_facts()
    store_synthetic_costs(cache, digest, machine, stream_interval=1, router_per_token_s=0.004)
    store_synthetic_costs(cache, digest, machine, stream_interval=8, router_per_token_s=0.0005)
    argv = balanced(model, profiles, out_file, "--no-hybrid", "--stream-intervals", "1,8")
    assert main(argv) == 0
    report = json.loads(out_file.read_text())
    candidates = report["candidates"]
    by_interval = {n: {c["layout"]: c for c in candidates if c["knobs"]["stream_interval"] == n} for n in (1, 8)}
    assert set(by_interval[1]) == set(by_interval[8]) and len(candidates) == 2 * len(by_interval[1])
    for layout, at_8 in by_interval[8].items():  # never worse; better where the router bounds it
        assert at_8["predicted_goodput_rps"] >= by_interval[1][layout]["predicted_goodput_rps"], layout
        router_args = at_8["command"][at_8["command"].index("--router-args") + 1]
        assert router_args.endswith("--stream-interval 8")
        assert "--router-args" not in by_interval[1][layout]["command"]  # no routing flags without the hybrid
    colocated = "colocated x2 (1 core each)"
    assert by_interval[8][colocated]["predicted_goodput_rps"] > by_interval[1][colocated]["predicted_goodput_rps"]
    assert report["recommended"]["command"] == candidates[0]["command"]
    assert candidates[0]["knobs"]["stream_interval"] == 8


def test_a_stream_interval_below_one_is_refused_naming_the_flag(planned, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(plan(planned, "--ttft-slo", "2", "--stream-intervals", "1,0"))
    assert exit_info.value.code == 2
    assert "--stream-intervals needs integers >= 1, got '1,0'" in capsys.readouterr().err


def test_a_plan_prints_and_writes_the_error_its_key_was_validated_with(planned, tmp_path, capsys):
    """Without a record the plan says it has none; with one (what `--validate` adds) it prints the
    median error under its table and writes it as `track_record`."""
    from pdserve.planner.track_record import Checked, ValidationLog, record_key

    model, profiles, out_file = own_cache(planned, tmp_path)
    argv = balanced(model, profiles, out_file)
    assert main(argv) == 0
    assert "measured error: none yet for this model on this machine" in capsys.readouterr().out
    report = json.loads(out_file.read_text())
    assert report["track_record"]["overall"] is None
    best = report["candidates"][0]

    machine = synthetic_profile(base_s=0.005, per_token_s=0.001).machine  # the profile's: the key of its plans
    key = record_key(model_hash(model), machine, resolve_dtype("auto"), 16)
    ValidationLog(profiles, key).add([Checked("2026-12-07T10:00:00+00:00", best["mode"], best["layout"], 1.0, 0.25,
                                              False, False),
                                      Checked("2026-12-07T10:00:00+00:00", "other", "other", 1.0, -0.05, False, False)])
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    [header] = [i for i, line in enumerate(out) if line.startswith("measured error of past plans")]
    assert out[header + 1] == (
        f"  {best['mode']} layouts: median |goodput error| 25% (signed +25%) over 1 candidate in 1 validation, "
        "latest 2026-12-07")
    record = json.loads(out_file.read_text())["track_record"]
    assert record["mode"] == best["mode"] and record["layout"] == best["layout"]
    assert record["overall"]["candidates"] == 2 and record["overall"]["median_abs_error"] == pytest.approx(0.15)
    assert record["of_layout"]["median_error"] == 0.25


def test_a_validated_plan_hands_over_the_best_measured_and_a_later_plan_names_its_close_calls(
        planned, tmp_path, capsys, monkeypatch):
    """`_measure` (a real cluster and client: tests/e2e/test_plan_validate.py) is replaced by fixed
    measurements: the first-ranked candidate measures half its prediction, the next layout all of it."""
    from pdserve.bench.serve.sweep import SweepResult
    from pdserve.planner import validate as validate_module

    model, profiles, out_file = own_cache(planned, tmp_path)
    argv = balanced(model, profiles, out_file)
    measured_share = iter([0.5, 1.0])
    monkeypatch.setattr(validate_module, "_measure", lambda e, model, checks, log: validate_module.Measurement(
        (rate := e.prediction.goodput_rps * next(measured_share)), None, SweepResult(best_rate=rate)))

    assert main([*argv, "--validate", "1", "--validate-others", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out_file.read_text())
    first, second = report["candidates"][0], next(c for c in report["candidates"] if c["layout"] != report[
        "candidates"][0]["layout"])
    choice = report["validated_choice"]
    assert (choice["layout"], choice["measured_goodput_rps"]) == (second["layout"], second["predicted_goodput_rps"])
    assert choice["rank"] == report["candidates"].index(second) + 1 and choice["command"] == second["command"]
    assert report["recommended"]["command"] == first["command"]  # the prediction's pick, as predicted
    assert lines[-2].startswith(f"best measured: {second['layout']}, measured goodput ")
    assert f"ranked #{choice['rank']} by the prediction: the measurement overrules the ranking (one round" in lines[-2]
    assert lines[-1] == shlex.join(second["command"])

    # The record now holds errors of +100% and 0%: a median |error| of 50%.
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out_file.read_text())
    best_of_layout = {}
    for rank, c in enumerate(report["candidates"], start=1):
        best_of_layout.setdefault(c["layout"], (rank, c))
    top = report["candidates"][0]
    others = [(rank, c) for rank, c in best_of_layout.values() if c is not top]
    close = [(rank, c) for rank, c in others
             if c["predicted_goodput_per_device"] >= top["predicted_goodput_per_device"] * 0.5]
    assert close  # the synthetic profiles put some layout within 50% of the first
    [line] = [line for line in lines if line.startswith("predicted within the measured error")]
    more = f" and {len(close) - 3} more" if len(close) > 3 else ""
    assert line == ("predicted within the measured error (50%) of the first: "
                    + ", ".join(f"#{rank} {c['layout']}" for rank, c in close[:3]) + more
                    + f"; `--validate 1 --validate-others {others.index(close[-1]) + 1}` measures them and hands "
                    "over the best measured")
    assert lines[-1] == shlex.join(top["command"])


def test_a_lead_within_the_rounds_spread_leaves_the_first_ranked_as_the_choice(planned, tmp_path, capsys,
                                                                               monkeypatch):
    """Two rounds: the first-ranked measures 0.8 and 1.0 of its prediction P (median 0.9 P, spread 22%),
    the next layout P in both. Its lead, 11%, is within the spread: the plan keeps the first and says so."""
    from pdserve.bench.serve.sweep import SweepResult
    from pdserve.planner import validate as validate_module

    model, profiles, out_file = own_cache(planned, tmp_path)
    argv = balanced(model, profiles, out_file, "--validate", "1", "--validate-others", "1", "--validate-repeats", "2")
    shares = iter([0.8, None, 1.0, None])  # rounds: first, other, first, other (None: the first's prediction)
    first_rps: list[float] = []

    def measure(e, model, checks, log):
        first_rps.append(first_rps[0] if first_rps else e.prediction.goodput_rps)
        rate = first_rps[0] * (next(shares) or 1.0)
        return validate_module.Measurement(rate, None, SweepResult(best_rate=rate))

    monkeypatch.setattr(validate_module, "_measure", measure)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(out_file.read_text())
    first, other = report["validation"]["candidates"]
    assert other["measured_goodput_rps"] > first["measured_goodput_rps"] == pytest.approx(0.9 * first_rps[0])
    assert report["validated_choice"]["rank"] == 1 and report["validated_choice"]["command"] == \
        report["recommended"]["command"]
    assert lines[-3].startswith(f"best: {first['layout']}, measured goodput ")
    other_rank = next(i for i, c in enumerate(report["candidates"], start=1) if c["layout"] == other["layout"])
    assert lines[-2].startswith(f"  (#{other_rank} {other['layout']} measured ")
    assert lines[-2].endswith("a lead within the runs' spread and the other work on the machine: the ranking stands)")
    assert lines[-1] == shlex.join(report["recommended"]["command"])
