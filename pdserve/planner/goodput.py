"""A simulated run's SLO summary, and the goodput search over simulated runs.

The same definitions the serving bench measures with (pdserve/bench/serve/metrics.py: TTFT, TPOT,
attainment, a run's duration; pdserve/bench/serve/sweep.py: DistServe's goodput, the highest rate whose
attainment reaches the target, found by doubling/halving then bisection; pdserve/bench/serve/arrivals.py:
the seeded arrival schedule, the same pattern scaled by 1/rate at every rate), applied to the
traces of `ClusterSim` instead of a real cluster's. A prediction and a measurement of one
workload therefore differ only in what produced the traces.

Must never: read a wall clock or load torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.serve.arrivals import ArrivalProcess, arrival_times
from pdserve.bench.serve.metrics import Slo, Summary, request_metrics, run_duration, summarize
from pdserve.bench.serve.runner import RunLength
from pdserve.bench.serve.sweep import SweepConfig, find_max_rate
from pdserve.engine.step_shape import StepShape
from pdserve.planner.cluster_spec import ClusterSpec
from pdserve.planner.simulator import ClusterSim, SimRequest


class Traffic:
    """What every simulated run sends: request i's prompt and output length (the same at every
    rate), and the arrivals' shape, scaled by the probe's rate.

    A run sends at least `num_requests`, and enough that its arrivals span `min_duration_s`: a
    short burst at a rate far above what the cluster sustains can drain within the SLOs and pass
    (the bench's caveat), and simulated requests are cheap enough to make every probe a sustained
    load instead."""

    def __init__(self, request: Callable[[int], tuple[tuple[int, ...], int]], num_requests: int,
                 min_duration_s: float = 0.0, cv: float = 1.0, seed: int = 0) -> None:
        self._request = request
        self._made: list[tuple[tuple[int, ...], int]] = []
        self.num_requests = num_requests
        self.min_duration_s = min_duration_s
        self.cv = cv
        self.seed = seed

    @classmethod
    def of(cls, requests: list[tuple[tuple[int, ...], int]], cv: float = 1.0, seed: int = 0) -> Traffic:
        """Exactly these requests at every rate."""
        return cls(lambda i: requests[i], len(requests), 0.0, cv, seed)

    def request(self, index: int) -> tuple[tuple[int, ...], int]:
        while len(self._made) <= index:
            self._made.append(self._request(len(self._made)))
        return self._made[index]

    @property
    def length(self) -> RunLength:
        """What a real run of this traffic sends (a validation runs it so)."""
        return RunLength(num_requests=self.num_requests, min_duration_s=self.min_duration_s)

    def count(self, rate: float) -> int:
        return self.length.count_at(rate)

    def at_rate(self, rate: float) -> list[SimRequest]:
        times = arrival_times(ArrivalProcess(rate, self.cv), self.seed, num_requests=self.count(rate))
        return [SimRequest(t, *self.request(i)) for i, t in enumerate(times)]


@dataclass(frozen=True)
class SimRun:
    rate: float
    summary: Summary

    @property
    def attainment(self) -> float:
        return self.summary.attainment


def simulate(spec: ClusterSpec, traffic: Traffic, rate: float, slo: Slo, max_model_len: int) -> SimRun:
    traces = ClusterSim(spec, max_model_len).run(traffic.at_rate(rate))
    return SimRun(rate, summarize([request_metrics(t) for t in traces], slo, run_duration(traces)))


@dataclass(frozen=True)
class Prediction:
    goodput_rps: float  # 0 when no probed rate met the target
    run: SimRun  # at the goodput rate; when none met it, the lowest rate probed (the best attainable)
    probes: int
    converged: bool


def predict_goodput(spec: ClusterSpec, traffic: Traffic, slo: Slo, max_model_len: int,
                    sweep: SweepConfig) -> Prediction:
    runs: dict[float, SimRun] = {}

    def run_at(rate: float) -> SimRun:
        runs[rate] = simulate(spec, traffic, rate, slo, max_model_len)
        return runs[rate]

    result = find_max_rate(run_at, sweep)
    if result.best_rate is None:
        lowest = min(runs)
        return Prediction(0.0, runs[lowest], len(result.probes), result.converged)
    return Prediction(result.best_rate, runs[result.best_rate], len(result.probes), result.converged)


def start_rate(spec: ClusterSpec, traffic: Traffic) -> float:
    """Where the search starts: the rate the cluster would hold if no request were batched with
    another (each prompt in one step, each output token a batch-1 decode), which batching only
    beats. The doubling takes it from there."""
    pool = spec.colocated or spec.decode
    cost = pool.profile.step
    first = (spec.colocated or spec.prefill or spec.decode).profile.step  # decode nodes that serve prefill
    requests = [traffic.request(i) for i in range(traffic.num_requests)]
    service = [first.time(StepShape.of([(0, len(p))])) + (out - 1) * cost.time(StepShape.of([(len(p), 1)]))
               for p, out in requests]
    nodes = (spec.colocated or spec.decode).count if spec.colocated or spec.serve_prefill else min(
        spec.prefill.count, spec.decode.count)
    mean = sum(service) / len(service)
    return nodes / mean if mean > 0 and math.isfinite(mean) else 1.0
