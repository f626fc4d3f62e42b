"""`pdserve plan --validate` over several workloads and SLO pairs: the planner's published error.

    pdserve bench plan-validation [--model DIR] [--devices 2] [--validate 1] [--validate-others 2]
                                  [--validate-probes 6] [--validate-repeats 1] [--slos 1.0,0.05 0.3,0.2]
                                  [--workloads ...]
                                  [--profile-dir DIR] [--out-dir results/plan_validation] [--rescore]

For each workload (a fixed, a uniform and a chat mix) and each SLO pair (TTFT,TPOT seconds), one
`pdserve plan ... --validate K --output-json F` exactly as a user runs it; then one table of every
validated candidate (predicted and measured goodput, the error, the P90s at the predicted rate),
and the two goals: the median absolute goodput error over every candidate measured (≤ 10%), and
for each plan the recommended configuration's measured goodput within 10% of the best measured.
Long: every candidate of every plan is started and swept for real. Prints the CPU capability.

`--rescore` measures nothing: it plans again (the same flags, the run's own run length as its
report recorded it, no --validate, `--client-here`: the measurements had their client on this
machine) on the cached profile (`--profile-dir`, the run's)
and prints each candidate an earlier run in `--out-dir` measured with its prediction then and now
beside that measurement (the median of its rounds), and where the measurement lies: in each
round the highest rate that passed and the lowest above it that failed bracket the goodput (a
sweep of a few probes rarely closes it); the column spans the rounds' brackets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from pdserve.planner.cpu_witness import SUSPECT_SHARE
from pdserve.planner.validation_report import rounds_text

WORKLOADS = {
    "fixed-256-64": ["--workload", "fixed", "--input-len", "256", "--output-len", "64"],
    "uniform-128:512-32:128": ["--workload", "uniform", "--input-len-range", "128:512", "--output-len-range", "32:128"],
    "chat": ["--workload", "chat"],
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench plan-validation", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the built-in demo model)")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--slos", nargs="+", default=["1.0,0.05", "0.3,0.2"], metavar="TTFT,TPOT",
                   help="SLO pairs in seconds (default: a TPOT-tight and a TTFT-tight pair)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--validate", type=int, default=1)
    p.add_argument("--validate-others", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--min-duration-s", type=float, default=15.0)
    p.add_argument("--validate-probes", type=int, default=6, help="real runs per candidate's sweep at most")
    p.add_argument("--validate-repeats", type=int, default=1,
                   help="rounds: each candidate measured this many times (the median is compared, the spread shown)")
    p.add_argument("--profile-dir", type=Path,
                   help="where the plans' profile is cached (an empty one: profiled afresh, under this run's conditions)")
    p.add_argument("--out-dir", type=Path, default=Path("results/plan_validation"))
    p.add_argument("--rescore", action="store_true",
                   help="measure nothing: predict the candidates that the run in --out-dir measured again, "
                        "with this simulator, and print the errors then and now")
    return p


def _plan(args: argparse.Namespace, workload: str, slo: str, out: Path, validate: bool = True) -> dict | None:
    ttft, tpot = slo.split(",")
    checks = (["--validate", str(args.validate), "--validate-others", str(args.validate_others),
               "--validate-probes", str(args.validate_probes), "--validate-repeats", str(args.validate_repeats)]
              if validate else ["--client-here"])
    argv = [sys.executable, "-m", "pdserve", "plan", "--devices", str(args.devices), "--ttft-slo", ttft,
            "--tpot-slo", tpot, "--num-requests", str(args.num_requests), "--min-duration-s", str(args.min_duration_s),
            *checks, "--no-progress", "--output-json", str(out),
            *WORKLOADS[workload], *(["--model", args.model] if args.model else []),
            *(["--profile-dir", str(args.profile_dir)] if args.profile_dir else [])]
    print(f"\n$ {' '.join(argv[2:])}", flush=True)
    done = subprocess.run(argv, check=False)
    if done.returncode != 0:  # 2: SLOs nothing meets, said on stderr; nothing to validate
        print(f"(exit {done.returncode}: no plan to validate for {workload} at {slo})", flush=True)
        return None
    return json.loads(out.read_text())


def _rows(workload: str, slo: str, report: dict) -> list[dict]:
    return [{"workload": workload, "slo": slo, **c} for c in report["validation"]["candidates"]]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        _parser().error(f"--workloads: unknown workload {unknown[0]!r} ({', '.join(WORKLOADS)})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    if args.rescore:
        return _rescore(args, workloads)
    rows, shares = [], []
    for workload in workloads:
        for slo in args.slos:
            report = _plan(args, workload, slo, _report_path(args, workload, slo))
            if report is not None:
                rows += _rows(workload, slo, report)
                shares.append(report["validation"]["recommended_share_of_best_measured"])
    print("\n| workload | SLO TTFT,TPOT s | layout | goodput pred/meas req/s | error | measured by round (spread) | "
          "TTFT p90 pred/meas ms | TPOT p90 pred/meas ms | CPU taken by others |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        at = r["at_predicted_rate"]
        p90 = {k: "/".join("-" if v is None else f"{v * 1e3:.0f}" for v in (at[k]["predicted"], at[k]["measured"]))
               for k in ("ttft_p90_s", "tpot_p90_s")}
        by_round = rounds_text([x["measured_goodput_rps"] for x in r["rounds"]], r["measured_spread"])
        bound = r.get("goodput_error_is_a_lower_bound", False)  # no rate passed: below the lowest that failed
        measured = f"<{r['measured_below_rps']:.3g}" if bound else f"{r['measured_goodput_rps']:.3g}"
        taken = r.get("cpu_taken_share")  # a report from before the witness has none
        print(f"| {r['workload']} | {r['slo']} | {r['layout']} | {r['predicted_goodput_rps']:.3g}/{measured} | "
              f"{'≥' if bound else ''}{_pct(r['goodput_error'])} | {by_round} | {p90['ttft_p90_s']} | "
              f"{p90['tpot_p90_s']} | {'-' if taken is None else f'{taken:.0%}'}{'*' if r.get('suspect') else ''} |")
    errors = [abs(r["goodput_error"]) for r in rows if r["goodput_error"] is not None]
    median = statistics.median(errors) if errors else None
    print(f"\nmedian |goodput error| over {len(errors)} measured candidates (a bound where no rate passed): "
          + ("-" if median is None else f"{median:.0%} (goal <= 10%)"))
    quiet = [abs(r["goodput_error"]) for r in rows if r["goodput_error"] is not None and not r.get("suspect")]
    if len(quiet) < len(errors):
        print(f"median |goodput error| over the {len(quiet)} measured while others took under {SUSPECT_SHARE:.0%} of "
              "the machine's CPU: " + (f"{statistics.median(quiet):.0%}" if quiet else "-"))
    spreads = [r["measured_spread"] for r in rows if r["measured_spread"] is not None]
    if spreads:
        print(f"median spread of a candidate's measured goodput over its rounds: {statistics.median(spreads):.0%}")
    print("recommended / best measured per plan: " + ", ".join("-" if s is None else f"{s:.0%}" for s in shares)
          + " (goal >= 90% each)")
    (args.out_dir / "summary.json").write_text(json.dumps({"rows": rows, "median_abs_goodput_error": median,
                                                           "recommended_share_of_best": shares}, indent=1))
    return 0



def _report_path(args: argparse.Namespace, workload: str, slo: str, suffix: str = "") -> Path:
    return args.out_dir / f"{workload}-{slo.replace(',', '_')}{suffix}.json"


def _rescore(args: argparse.Namespace, workloads: list[str]) -> int:
    print("\n| workload | SLO TTFT,TPOT s | layout | measured req/s (bracket) | predicted then -> now | "
          "error then -> now | outside the bracket now |\n| --- | --- | --- | --- | --- | --- | --- |")
    then, now, outside, shares = [], [], [], []
    for workload in workloads:
        for slo in args.slos:
            measured_in = _report_path(args, workload, slo)
            if not measured_in.exists():
                continue
            old = json.loads(measured_in.read_text())
            # The run's own run length, whatever the flags say now: a longer simulated run reaches a
            # steadier state and predicts another goodput for the same cluster.
            same = argparse.Namespace(**{**vars(args), **old.get("traffic", {})})
            new = _plan(same, workload, slo, _report_path(args, workload, slo, ".rescored"), validate=False)
            shares.append(_recommended_share(old, new))
            for measured in old["validation"]["candidates"]:
                knobs = next(c["knobs"] for c in old["candidates"] if c["layout"] == measured["layout"])
                again = next((c for c in (new or {}).get("candidates", [])
                              if c["layout"] == measured["layout"] and c["knobs"] == knobs), None)
                predicted = again["predicted_goodput_rps"] if again else 0.0
                goodput = measured["measured_goodput_rps"]  # the median of its rounds
                if goodput <= 0:  # no probe passed: no goodput to compare with
                    continue
                low, high = _bracket_over_rounds(measured)
                then.append(abs(measured["goodput_error"]))
                now.append(abs(predicted / goodput - 1))
                outside.append(0.0 if low <= predicted <= high else min(abs(predicted / e - 1) for e in (low, high)))
                print(f"| {workload} | {slo} | {measured['layout']} | {goodput:.3g} ({low:.3g}-{high:.3g}) | "
                      f"{measured['predicted_goodput_rps']:.3g} -> {predicted:.3g} | {_pct(measured['goodput_error'])} -> "
                      f"{_pct(predicted / goodput - 1)} | {outside[-1]:.0%} |")
    if then:
        print(f"\nmedian |goodput error| over {len(then)} candidates: {statistics.median(then):.0%} then, "
              f"{statistics.median(now):.0%} now (goal <= 10%); outside the measured bracket now: "
              f"{statistics.median(outside):.0%}")
    print("recommended now / best measured per plan: " + ", ".join("-" if s is None else f"{s:.0%}" for s in shares)
          + " (goal >= 90% each; - : the layout recommended now was not measured)")
    return 0


def _recommended_share(old: dict, new: dict | None) -> float | None:
    """What the layout the plan recommends now measured in the earlier run, over the best it measured."""
    measured = {c["layout"]: c["measured_goodput_rps"] for c in old["validation"]["candidates"]}
    if not new or not new["candidates"] or new["candidates"][0]["layout"] not in measured:
        return None
    return measured[new["candidates"][0]["layout"]] / max(measured.values())


def _bracket_over_rounds(measured: dict) -> tuple[float, float]:
    """From the lowest round's bracket to the highest's: where the goodput lay over the rounds
    (a report from before rounds has its one sweep's probes only)."""
    brackets = [_bracket(r["probes"]) for r in measured.get("rounds") or [{"probes": measured["probes"]}]]
    return min(low for low, _ in brackets), max(high for _, high in brackets)


def _bracket(probes: list[dict]) -> tuple[float, float]:
    """(the highest rate that passed, the lowest above it that failed; inf when none did)."""
    low = max((p["rate"] for p in probes if p["passed"]), default=0.0)
    return low, min((p["rate"] for p in probes if not p["passed"] and p["rate"] > low), default=float("inf"))


if __name__ == "__main__":
    sys.exit(main())
