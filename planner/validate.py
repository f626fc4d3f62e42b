"""`pdserve plan --validate K`: the plan's own error, measured — predicted against real runs.

The top K candidates of the ranking and a few others (the best-ranked candidates of layouts
not yet chosen, so that a validation also sees the modes the plan turned down) are each started
for real with the command line the plan prints (`pdserve cluster`, as users run it), warmed up,
and swept with `pdserve bench serve`'s own machinery: the same workload, arrivals, run length
(planner/goodput.py's `Traffic`), SLOs, attainment target and bisection the prediction used.
A prediction and its measurement therefore differ only in what produced the traces.

A measurement has its own spread: on a shared machine the same layout's goodput moves from one
run to the next (measured here: 8.65 req/s, then no rate passing down to 5.2, an hour apart).
`repeats` measures every chosen candidate that many times, in rounds — each candidate once,
then each again — so a slow spell falls on every layout, not on one. A candidate's measured
goodput is the median of its rounds, and the report gives their spread beside the error: an
error smaller than the spread is not one the runs can show.

The sweep starts at the predicted goodput, so its first probe also measures the P90s at the
predicted rate: the latency error is read there, at the same rate on both sides. It moves from
there by a quarter (`GROWTH`), not by doubling: a prediction within 25% of the truth is
bracketed by its next probe, 20–25% wide, and each probe after halves that, so a budget of a
few probes measures the goodput to a few percent, where doubling left brackets of 15–25%.

Must never: decide the plan (that is planner/search.py's), or leave a cluster running.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvloop

from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo, Summary
from pdserve.bench.serve.runner import Run, RunLength, ServeBench
from pdserve.bench.serve.sweep import SweepConfig, SweepResult, find_max_rate
from pdserve.bench.serve.workloads import ModelLimits, Workload
from pdserve.cluster_process import ClusterProcess
from pdserve.common.affinity import threads_pinned_to
from pdserve.planner.goodput import Traffic
from pdserve.planner.search import Evaluated

WARMUP_REQUESTS = 4  # every node's first shapes (kernel builds, allocator growth) before any probe
GROWTH = 1.25  # the sweep's step from the predicted rate: × 1.25 up after a pass, ÷ 1.25 down after a miss


def chosen(results: list[Evaluated], top: int, others: int) -> list[Evaluated]:
    """The first `top` of the ranking, then the best-ranked candidate of each layout not yet
    chosen, in ranking order, until `others` more are chosen."""
    picked = list(results[:top])
    layouts = {e.candidate.layout for e in picked}
    for e in results[top:]:
        if len(picked) >= top + others:
            break
        if e.candidate.layout not in layouts:
            picked.append(e)
            layouts.add(e.candidate.layout)
    return picked


@dataclass(frozen=True)
class Measurement:
    """One round's sweep of one candidate."""

    goodput_rps: float  # 0 when no probed rate met the target
    at_predicted_rate: Summary | None  # the real run at the predicted goodput (None: nothing was predicted)
    sweep: SweepResult[Run]


@dataclass(frozen=True)
class Validation:
    evaluated: Evaluated
    rounds: tuple[Measurement, ...]  # in the order they ran; at least one

    @property
    def predicted_goodput_rps(self) -> float:
        return self.evaluated.prediction.goodput_rps

    @property
    def measured_goodput_rps(self) -> float:
        """The median over the rounds (0 when none passed a rate)."""
        return statistics.median(m.goodput_rps for m in self.rounds)

    @property
    def spread(self) -> float | None:
        """(highest - lowest) / median of the rounds' goodputs; None with one round or a zero median."""
        goodputs = [m.goodput_rps for m in self.rounds]
        median = self.measured_goodput_rps
        if len(goodputs) < 2 or median <= 0:
            return None
        return (max(goodputs) - min(goodputs)) / median

    @property
    def at_predicted_rate(self) -> Summary | None:
        """The first round's run at the predicted rate: where the P90s are compared."""
        return self.rounds[0].at_predicted_rate

    @property
    def measured_below_rps(self) -> float | None:
        """Where no rate passed (a zero median): the goodput lies below the lowest rate that failed
        in those rounds (the highest such, when several did); None otherwise."""
        if self.measured_goodput_rps > 0:
            return None
        failed = [m.sweep.failed_rate for m in self.rounds if m.goodput_rps <= 0 and m.sweep.failed_rate]
        return max(failed) if failed else None

    @property
    def goodput_error(self) -> float | None:
        """(predicted - measured) / measured. Where no rate passed, the least it can be, against
        `measured_below_rps` (`error_is_a_bound`): such a candidate counts in the median error,
        never out of it. None when nothing was measured at all."""
        measured = self.measured_goodput_rps or self.measured_below_rps
        if not measured:
            return None
        return (self.predicted_goodput_rps - measured) / measured

    @property
    def error_is_a_bound(self) -> bool:
        return self.measured_goodput_rps <= 0 and self.measured_below_rps is not None


@dataclass(frozen=True)
class ValidationPlan:
    """How each chosen candidate is measured."""

    traffic: Traffic
    make_workload: Callable[[ModelLimits], Workload]
    slo: Slo
    sweep: SweepConfig  # the prediction's own target, tolerance and probe budget
    dtype: str  # the plan's, resolved: the command line names it
    block_size: int
    repeats: int = 1  # rounds: each candidate measured this many times, one round after the other
    timeout_s: float = 600.0


def validate(candidates: list[Evaluated], model: str, plan: ValidationPlan, log=print) -> list[Validation]:
    rounds: list[list[Measurement]] = []
    with _search_heap_frozen():
        for number in range(1, plan.repeats + 1):
            if plan.repeats > 1:
                log(f"validate: round {number} of {plan.repeats}")
            rounds.append([_measure(e, model, plan, log) for e in candidates])
    return [Validation(e, tuple(r[i] for r in rounds)) for i, e in enumerate(candidates)]


@contextlib.contextmanager
def _search_heap_frozen() -> Iterator[None]:
    """The client runs in this process, after the search: its full garbage collections would scan
    every object the search left (measured: 340k objects, 148 ms a collection on an AMX machine),
    pausing the client mid-probe, so that it reads responses late and the cluster looks slower
    than it is (colocated x2 there at 26 req/s: 0.42 of requests within the SLOs measured from
    here, 1.0 from `pdserve bench serve` in a process of its own). Frozen, they are never scanned."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _measure(e: Evaluated, model: str, plan: ValidationPlan, log) -> Measurement:
    command = e.candidate.command(model, plan.dtype, plan.block_size)
    log(f"validate: starting {e.candidate.layout.describe()}: {' '.join(command)}")
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as workdir:
        # command[:2] is "pdserve cluster"; ClusterProcess runs the same program with its own ports.
        # The client runs with the router, on the cores the plan pinned it to: where the simulator
        # charged their CPU.
        with (ClusterProcess([*command[2:], "--http-port", "0"], workdir) as cluster,
              threads_pinned_to(e.candidate.layout.router_cores)):
            backend = GrpcBackend(cluster.router, ClientOptions(timeout_s=plan.timeout_s, progress=False))
            workload = plan.make_workload(uvloop.run(backend.model()).limits)
            traffic = plan.traffic
            bench = ServeBench(backend, workload, traffic.length, traffic.cv, traffic.seed, plan.slo)
            ServeBench(backend, workload, RunLength(num_requests=WARMUP_REQUESTS), traffic.cv, traffic.seed + 1,
                       Slo()).run_at(math.inf)
            predicted = e.prediction.goodput_rps
            runs: dict[float, Run] = {}

            def run_at(rate: float) -> Run:
                runs[rate] = bench.run_at(rate)
                log(f"validate: {e.candidate.layout.describe()} at {rate:.3g} req/s: attainment "
                    f"{runs[rate].attainment:.3f}")
                return runs[rate]

            start = predicted if predicted > 0 else plan.sweep.start_rate
            sweep = find_max_rate(run_at, SweepConfig(plan.sweep.target_attainment, start_rate=start,
                                                      tolerance=plan.sweep.tolerance,
                                                      max_probes=plan.sweep.max_probes, growth=GROWTH))
    at_predicted = runs[predicted].summary if predicted > 0 else None
    return Measurement(sweep.best_rate or 0.0, at_predicted, sweep)


# -- the report ---------------------------------------------------------------------------------
def _p90(summary: Summary | None, field: str) -> float | None:
    dist = getattr(summary, field) if summary is not None else None
    return None if dist is None else dist.p90


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def median_abs_goodput_error(validations: list[Validation]) -> float | None:
    errors = [abs(v.goodput_error) for v in validations if v.goodput_error is not None]
    return statistics.median(errors) if errors else None


def median_spread(validations: list[Validation]) -> float | None:
    """The median of the candidates' spreads over their rounds (None with one round)."""
    spreads = [v.spread for v in validations if v.spread is not None]
    return statistics.median(spreads) if spreads else None


def recommended_share_of_best(validations: list[Validation]) -> float | None:
    """The recommended (first-ranked) candidate's measured goodput over the best measured one's."""
    best = max((v.measured_goodput_rps / v.evaluated.candidate.layout.devices for v in validations), default=0.0)
    if not validations or best <= 0:
        return None
    first = validations[0]
    return first.measured_goodput_rps / first.evaluated.candidate.layout.devices / best


def validation_record(v: Validation) -> dict:
    predicted = v.evaluated.prediction.run.summary
    return {
        "layout": v.evaluated.candidate.layout.describe(),
        "predicted_goodput_rps": v.predicted_goodput_rps,
        "measured_goodput_rps": v.measured_goodput_rps,
        "measured_below_rps": v.measured_below_rps,
        "goodput_error": v.goodput_error,
        "goodput_error_is_a_lower_bound": v.error_is_a_bound,
        "measured_spread": v.spread,
        "measured_converged": v.rounds[0].sweep.converged,
        "at_predicted_rate": {
            "ttft_p90_s": {"predicted": _p90(predicted, "ttft_s"), "measured": _p90(v.at_predicted_rate, "ttft_s")},
            "tpot_p90_s": {"predicted": _p90(predicted, "tpot_s"), "measured": _p90(v.at_predicted_rate, "tpot_s")},
            "attainment": {"predicted": predicted.attainment,
                           "measured": None if v.at_predicted_rate is None else v.at_predicted_rate.attainment},
        },
        "probes": _probes(v.rounds[0]),  # the first round's: the one sweep of reports from before rounds
        "rounds": [{"measured_goodput_rps": m.goodput_rps, "probes": _probes(m)} for m in v.rounds],
    }


def _probes(m: Measurement) -> list[dict]:
    return [{"rate": p.rate, "attainment": p.result.attainment, "passed": p.passed} for p in m.sweep.probes]


def report_record(validations: list[Validation]) -> dict:
    return {"candidates": [validation_record(v) for v in validations],
            "median_abs_goodput_error": median_abs_goodput_error(validations),
            "median_measured_spread": median_spread(validations),
            "recommended_share_of_best_measured": recommended_share_of_best(validations)}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def rounds_text(goodputs: list[float], spread: float | None) -> str:
    """A candidate's measured goodput by round and their spread, as the reports print them."""
    return ", ".join(f"{g:.3g}" for g in goodputs) + (" (-)" if spread is None else f" ({spread:.0%})")


def format_validation(validations: list[Validation]) -> str:
    repeated = any(len(v.rounds) > 1 for v in validations)
    rows = [("layout", "goodput pred/meas", "error", "TTFT p90 ms pred/meas", "TPOT p90 ms pred/meas",
             *(("measured by round (spread)",) if repeated else ()))]
    for v in validations:
        predicted = v.evaluated.prediction.run.summary
        ttft = (_p90(predicted, "ttft_s"), _p90(v.at_predicted_rate, "ttft_s"))
        tpot = (_p90(predicted, "tpot_s"), _p90(v.at_predicted_rate, "tpot_s"))
        measured = f"<{v.measured_below_rps:.3g}" if v.error_is_a_bound else f"{v.measured_goodput_rps:.3g}"
        row = (v.evaluated.candidate.layout.describe(), f"{v.predicted_goodput_rps:.3g}/{measured}",
               ("≥" if v.error_is_a_bound else "") + _pct(v.goodput_error),
               f"{_ms(ttft[0])}/{_ms(ttft[1])} ({_pct(_error(*ttft))})",
               f"{_ms(tpot[0])}/{_ms(tpot[1])} ({_pct(_error(*tpot))})")
        rows.append((*row, rounds_text([m.goodput_rps for m in v.rounds], v.spread)) if repeated else row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    median, share = median_abs_goodput_error(validations), recommended_share_of_best(validations)
    lines.append("median |goodput error|: " + ("-" if median is None else f"{median:.0%}") +
                 "; the recommended configuration measured " +
                 ("-" if share is None else f"{share:.0%}") + " of the best measured goodput per device")
    spread = median_spread(validations)
    if spread is not None:
        lines.append(f"median spread of the measured goodput over its rounds: {spread:.0%} "
                     "(an error under it is within the runs' own variation)")
    if any(v.error_is_a_bound for v in validations):
        lines.append("(<R: no probed rate met the target, the lowest to fail was R; the error shown, and counted "
                     "in the median, is the least it can be)")
    lines.append("(error = (predicted - measured) / measured, measured = the median of the rounds; "
                 "P90s at the predicted goodput rate, in the first round)")
    return "\n".join(lines)
