"""One benchmark run at one rate: schedule, requests, the open-loop client, the summary.

Owns `ServeBench`, the configured benchmark that `cli` runs once per rate (a single
rate, a list of rates, or the sweep's probes). Every run of one bench uses the same
seed, so two rates send requests of the same lengths on the same arrival pattern,
scaled; synthetic prompts get fresh tokens each run, so no run hits the prefix cache
with an earlier run's prompts.
Never parses flags and never writes files.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import uvloop

from pdserve.bench.serve.arrivals import ArrivalProcess, arrival_times
from pdserve.bench.serve.client import Backend, run_open_loop
from pdserve.bench.serve.metrics import RequestMetrics, Slo, Summary, request_metrics, run_duration, summarize
from pdserve.bench.serve.workloads import Workload


@dataclass(frozen=True)
class RunLength:
    """A run sends `num_requests`, or every request due within `duration_s` (exactly one is set).

    `min_duration_s`, with `num_requests`: more requests at high rates, enough that the arrivals
    span it, so that every probe of a sweep is a sustained load (a short burst far above what a
    cluster sustains can drain within the SLOs and pass)."""

    num_requests: int | None = None
    duration_s: float | None = None
    min_duration_s: float = 0.0

    def count_at(self, rate: float) -> int | None:
        """How many requests a run at `rate` sends; None: all those due within `duration_s`."""
        if self.num_requests is None:
            return None
        if not math.isfinite(rate):
            return self.num_requests
        return max(self.num_requests, math.ceil(rate * self.min_duration_s))


@dataclass(frozen=True)
class Run:
    rate: float
    requests: list[RequestMetrics]
    summary: Summary

    @property
    def attainment(self) -> float:
        return self.summary.attainment


class ServeBench:
    def __init__(self, backend: Backend, workload: Workload, length: RunLength, cv: float, seed: int,
                 slo: Slo) -> None:
        self._backend = backend
        self._workload = workload
        self._length = length
        self._cv = cv
        self._seed = seed
        self._slo = slo
        self._runs = itertools.count()

    def run_at(self, rate: float) -> Run:
        due = arrival_times(ArrivalProcess(rate, self._cv), self._seed, self._length.count_at(rate),
                            self._length.duration_s)
        if not due:
            raise ValueError(f"no request is due within {self._length.duration_s} s at {rate:g} requests/s")
        run = next(self._runs)
        requests = [self._workload.request(i, run) for i in range(len(due))]
        traces = uvloop.run(run_open_loop(self._backend, requests, due, f"{rate:g} req/s"))
        metrics = [request_metrics(t) for t in traces]
        return Run(rate, metrics, summarize(metrics, self._slo, run_duration(traces)))
