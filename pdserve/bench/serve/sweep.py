"""The goodput search: the highest request rate whose SLO attainment still reaches a target.

DistServe defines a system's goodput as that rate. Owns the bracket (given, or found
by growing from a start rate while the target is met and shrinking while it is not,
by `growth` each probe: doubling and halving unless told)
and the bisection inside it, to a relative tolerance or a probe budget. Pure: each
probe is one call of `run_at(rate)`, a full run at that rate whose result reports an
`attainment`; this module never sends a request or reads a clock. It assumes
attainment falls as the rate rises; noise near the answer can move it by a probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Measured(Protocol):
    @property
    def attainment(self) -> float: ...


M = TypeVar("M", bound=Measured)


@dataclass(frozen=True)
class SweepConfig:
    target_attainment: float = 0.9
    rate_min: float | None = None  # with rate_max: the bracket; alone: never probe below it
    rate_max: float | None = None  # with rate_min: the bracket; alone: never probe above it
    start_rate: float = 1.0  # where the automatic bracket starts when rate_min is unset
    tolerance: float = 0.05  # stop when the bracket is at most this fraction of its top
    max_probes: int = 12
    # The automatic bracket's step: × growth after a pass, ÷ growth after a miss. A start near
    # the answer (a prediction being checked) brackets it tightly with a small one.
    growth: float = 2.0

    def __post_init__(self) -> None:
        checks = [
            (0 < self.target_attainment <= 1, "target attainment must be in (0, 1]"),
            (self.rate_min is None or 0 < self.rate_min < math.inf, "rate_min must be a finite rate > 0"),
            (self.rate_max is None or 0 < self.rate_max < math.inf, "rate_max must be a finite rate > 0"),
            (None in (self.rate_min, self.rate_max) or self.rate_min < self.rate_max, "rate_min must be < rate_max"),
            (0 < self.start_rate < math.inf, "start_rate must be a finite rate > 0"),
            (0 < self.tolerance < 1, "tolerance must be in (0, 1)"),
            (self.max_probes >= 2, "max_probes must be >= 2"),
            (1 < self.growth < math.inf, "growth must be a finite factor > 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Probe(Generic[M]):
    rate: float
    result: M
    passed: bool


@dataclass
class SweepResult(Generic[M]):
    best_rate: float | None = None  # highest probed rate that met the target; None: none did
    failed_rate: float | None = None  # lowest probed rate above it that missed; None: none did
    probes: list[Probe[M]] = field(default_factory=list)
    converged: bool = False  # the bracket closed to the tolerance (not stopped by the budget or a rate limit)

    @property
    def bracketed(self) -> bool:
        return self.best_rate is not None and self.failed_rate is not None

    def record(self, rate: float, result: M, target: float) -> bool:
        passed = result.attainment >= target
        self.probes.append(Probe(rate, result, passed))
        if passed and (self.best_rate is None or rate > self.best_rate):
            self.best_rate = rate
        if not passed and (self.failed_rate is None or rate < self.failed_rate):
            self.failed_rate = rate
        return passed


def find_max_rate(run_at: Callable[[float], M], config: SweepConfig) -> SweepResult[M]:
    sweep: SweepResult[M] = SweepResult()

    def probe(rate: float) -> bool:
        return sweep.record(rate, run_at(rate), config.target_attainment)

    _bracket(probe, config, sweep)
    while sweep.bracketed:
        low, high = sweep.best_rate, sweep.failed_rate
        sweep.converged = high - low <= config.tolerance * high
        if sweep.converged or len(sweep.probes) >= config.max_probes:
            break
        probe((low + high) / 2)
    return sweep


def _bracket(probe: Callable[[float], bool], config: SweepConfig, sweep: SweepResult) -> None:
    """Probe until one rate meets the target and a higher one misses, or a limit says stop."""
    low, high = config.rate_min, config.rate_max
    if low is not None and high is not None:
        if probe(low):
            probe(high)
        return
    rate = low if low is not None else config.start_rate
    while len(sweep.probes) < config.max_probes:
        if probe(rate):
            if sweep.failed_rate is not None or (high is not None and rate >= high):
                return
            rate = config.growth * rate if high is None else min(config.growth * rate, high)
        else:
            if sweep.best_rate is not None or (low is not None and rate <= low):
                return
            rate /= config.growth
