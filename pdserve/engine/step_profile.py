"""The step-time model the target-step chunk schedule sizes its budget with.

At engine start, `profile_step_times` runs a few prefill steps of different sizes on the real
model (a dummy request, its blocks freed after, nothing published to the prefix cache), and
`StepTimeModel.fit` fits time ≈ base + per_token × tokens by least squares. A decode is one
token of the same step, so the model prices a step by its total tokens; attention over long
contexts is not in it (the staged schedule is the answer to that).

Must never: run while requests are scheduled (it borrows free blocks for its dummy steps).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from pdserve.engine.clock import Clock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

PROFILE_SHARES = (0.25, 0.5, 1.0)  # of max_num_batched_tokens: the step sizes timed
PROFILE_REPEATS = 2  # timed runs per size (after one warm-up run), the median kept


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    base_s: float
    per_token_s: float

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> StepTimeModel:
        """Least squares over (tokens, seconds); a slope below zero (noise) is taken as zero."""
        xs, ys = [float(n) for n, _ in samples], [t for _, t in samples]
        if len(set(xs)) < 2:
            return cls(0.0, ys[0] / xs[0])
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return cls(max(my - slope * mx, 0.0), slope)

    def tokens_within(self, target_s: float, low: int, high: int) -> int:
        """The most tokens in [low, high] whose modelled step time is at most `target_s` (low
        when even that exceeds it: a step must make progress)."""
        if self.per_token_s <= 0:
            return high
        return max(low, min(high, int((target_s - self.base_s) / self.per_token_s)))


def profile_step_times(run_step, kv: KVCacheManager, max_num_batched_tokens: int, clock: Clock) -> list[tuple[int, float]]:
    """(tokens, seconds) of dummy prefill steps; `run_step` runs a `SchedulerOutput` on the model."""
    capacity = kv.num_free_blocks * kv.block_size - 1
    sizes = sorted({max(1, min(capacity, int(max_num_batched_tokens * s))) for s in PROFILE_SHARES})
    samples = []
    for size in sizes:
        request = Request(f"step-profile-{size}", [0] * size, SamplingParams(max_tokens=1), -1, seed=0)
        if kv.allocate_slots(request, size) is None:
            continue
        out = SchedulerOutput([ScheduledRequest(request, size)])
        times = []
        for i in range(PROFILE_REPEATS + 1):
            start = clock.now()
            run_step(out)
            if i:  # the first run warms caches and kernels up
                times.append(clock.now() - start)
        kv.free(request)
        samples.append((size, statistics.median(times)))
    logger.info("step profile (tokens, ms): %s", [(n, round(t * 1e3, 1)) for n, t in samples])
    return samples
