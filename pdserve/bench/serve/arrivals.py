"""Open-loop arrival schedules: when each request is due, as offsets in seconds from the start.

Owns the arrival processes (Poisson, and gamma with a chosen coefficient of variation)
and the seeded schedule they produce for a request count or a duration. Pure: no clock,
no I/O. Never decides anything from how the server is doing; an open-loop request is
due at its time whatever happened to the earlier ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Unit-mean intervals are drawn in chunks of this size; a fixed size keeps the i-th
# interval the same whatever the request count, duration or rate.
_CHUNK = 256


@dataclass(frozen=True)
class ArrivalProcess:
    """Renewal process with mean rate `rate` (requests/s) and inter-arrival CV `cv`.

    Intervals are gamma with shape 1/cv² and mean 1/rate: cv = 1 is the exponential,
    i.e. Poisson arrivals; cv > 1 is burstier, cv < 1 more regular. `rate = inf` sends
    every request at once.
    """

    rate: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"cv must be a finite number > 0, got {self.cv}")

    def unit_intervals(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` intervals of mean 1 and this CV; dividing by the rate gives seconds."""
        if self.cv == 1.0:
            return rng.standard_exponential(count)
        shape = 1.0 / (self.cv * self.cv)
        return rng.standard_gamma(shape, count) / shape


def arrival_times(
    process: ArrivalProcess, seed: int, num_requests: int | None = None, duration_s: float | None = None
) -> list[float]:
    """Due times of the requests: `num_requests` of them, or all that fall inside `duration_s`.

    The unit-mean intervals depend only on the seed and the CV, so the schedules of one
    seed at two rates are the same pattern scaled: a sweep compares rates on common
    random numbers.
    """
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of num_requests and duration_s")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if math.isinf(process.rate):
        if num_requests is None:
            raise ValueError("an infinite rate needs a request count, not a duration")
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    times: list[float] = []
    now = 0.0
    while True:
        for interval in process.unit_intervals(rng, _CHUNK):
            now += float(interval) / process.rate
            if duration_s is not None and now > duration_s:
                return times
            times.append(now)
            if len(times) == num_requests:
                return times
