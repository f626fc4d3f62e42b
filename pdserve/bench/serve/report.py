"""The benchmark's outputs: the JSON file, the PNG plots and the summary printed to stdout.

Owns the JSON layout (config, model, runs with their summaries and per-request
records, sweep probes) and the plots: SLO attainment against rate (TTFT only, TPOT
only, both) and the latency CDFs (TTFT, TPOT, E2E) of every run. Plots are drawn on
matplotlib `Figure` objects rendered by the Agg canvas, never through pyplot, so no
global backend or figure state is touched. Never measures anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import Run
from pdserve.bench.serve.sweep import SweepResult

ATTAINMENT_PNG = "attainment_vs_rate.png"
CDF_PNG = "latency_cdf.png"


def run_record(run: Run) -> dict:
    return {
        "rate": run.rate,
        "summary": dataclasses.asdict(run.summary),
        "requests": [dataclasses.asdict(m) for m in run.requests],
    }


def sweep_record(sweep: SweepResult[Run], target: float, devices: int) -> dict:
    best = sweep.best_rate
    return {
        "target_attainment": target,
        "goodput": best,  # requests/s; None when no probed rate met the target
        "goodput_per_device": None if best is None else best / devices,
        "devices": devices,
        "failed_rate": sweep.failed_rate,
        "converged": sweep.converged,
        "probes": [
            {"rate": p.rate, "passed": p.passed, "attainment": p.result.summary.attainment,
             "ttft_attainment": p.result.summary.ttft_attainment,
             "tpot_attainment": p.result.summary.tpot_attainment}
            for p in sweep.probes
        ],
    }


def write_json(path: Path, config: dict, model: dict, runs: list[Run], sweep: dict | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "model": model, "runs": [run_record(r) for r in runs], "sweep": sweep}
    path.write_text(json.dumps(_strict_json(doc), indent=1, allow_nan=False))


def _strict_json(value):
    """`value` with every non-finite float (a rate of `inf`: all at once) as a string, which strict JSON allows."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


# --------------------------------------------------------------------------- plots


def _figure(width: float, height: float):
    # Imported here: matplotlib is the `bench` extra, needed only when plots are asked for.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_attainment(runs: list[Run], target: float, path: Path) -> None:
    ordered = sorted(runs, key=lambda r: r.rate)
    rates = [r.rate for r in ordered]
    figure = _figure(6, 4)
    axes = figure.add_subplot()
    for label, key in (("TTFT only", "ttft_attainment"), ("TPOT only", "tpot_attainment"), ("both", "attainment")):
        axes.plot(rates, [getattr(r.summary, key) for r in ordered], marker="o", label=label)
    axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
    axes.set(xlabel="request rate (requests/s)", ylabel="SLO attainment", ylim=(-0.02, 1.02))
    axes.legend()
    figure.savefig(path, dpi=100)


def plot_latency_cdfs(runs: list[Run], slo: Slo, path: Path) -> None:
    figure = _figure(12, 3.6)
    panels = (("TTFT (s)", "ttft_s", slo.ttft_s), ("TPOT (s)", "tpot_s", slo.tpot_s), ("E2E latency (s)", "e2e_s", None))
    for column, (title, field, objective) in enumerate(panels, start=1):
        axes = figure.add_subplot(1, 3, column)
        for run in sorted(runs, key=lambda r: r.rate):
            values = np.sort([v for m in run.requests if m.ok and (v := getattr(m, field)) is not None])
            if len(values):
                axes.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=f"{run.rate:g}/s")
        if objective is not None:
            axes.axvline(objective, color="grey", linestyle="--", linewidth=1, label="SLO")
        axes.set(xlabel=title, ylabel="fraction of requests", ylim=(0, 1.02))
        axes.legend(fontsize="small")
    figure.savefig(path, dpi=100)


def write_plots(directory: Path, runs: list[Run], target: float, slo: Slo) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / ATTAINMENT_PNG, directory / CDF_PNG]
    plot_attainment(runs, target, paths[0])
    plot_latency_cdfs(runs, slo, paths[1])
    return paths


# --------------------------------------------------------------------------- text


def _ms(dist) -> str:
    if dist is None:
        return "-"
    return f"mean {dist.mean * 1e3:.1f}  p50 {dist.p50 * 1e3:.1f}  p90 {dist.p90 * 1e3:.1f}  p99 {dist.p99 * 1e3:.1f} ms"


def format_run(run: Run) -> str:
    s = run.summary
    statuses = ", ".join(f"{name} {count}" for name, count in sorted(s.statuses.items()))
    return "\n".join([
        f"rate {run.rate:g} req/s: {s.num_requests} requests ({statuses}) in {s.duration_s:.2f} s",
        (f"  throughput  {s.request_throughput:.2f} req/s, {s.output_token_throughput:.1f} output tok/s, "
         f"{s.input_token_throughput:.1f} input tok/s"),
        f"  TTFT  {_ms(s.ttft_s)}",
        f"  TPOT  {_ms(s.tpot_s)}",
        f"  ITL   {_ms(s.itl_s)}",
        f"  E2E   {_ms(s.e2e_s)}",
        (f"  SLO attainment  both {s.attainment:.3f}, TTFT {s.ttft_attainment:.3f}, TPOT {s.tpot_attainment:.3f}; "
         f"goodput {s.goodput:.2f} req/s; max send lag {s.max_send_lag_s * 1e3:.1f} ms"),
    ])


def format_sweep(record: dict) -> str:
    if record["goodput"] is None:
        return f"goodput: no probed rate reached attainment {record['target_attainment']:g}"
    bound = "" if record["converged"] else " (not converged: probe budget or rate limit reached)"
    return (f"goodput at attainment >= {record['target_attainment']:g}: {record['goodput']:.3g} req/s, "
            f"{record['goodput_per_device']:.3g} req/s per device ({record['devices']} devices); "
            f"lowest failing rate {record['failed_rate']}{bound}")
