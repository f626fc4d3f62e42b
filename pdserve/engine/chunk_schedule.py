"""How many prompt tokens a request may compute in one step: the chunk schedule.

The scheduler asks `num_new_tokens` for every request it schedules; the schedules differ only
in the step's token budget while a prompt is being chunked (`step_tokens`):

- `FixedChunks` (--chunk-schedule fixed): always `max_num_batched_tokens`; a long prompt is cut
  into chunks of whatever budget the step has left.
- `StagedChunks` (--chunk-schedule staged): Sarathi-Serve's dynamic chunking schedule. Later
  chunks of a long prompt attend over more context and cost more per token, so the budget
  steps down from `high_chunk_size` to `low_chunk_size` in `chunk_schedule_stages` stages as
  the prompt's computed tokens grow, one stage every ceil(`chunk_schedule_max_tokens` /
  stages) tokens, keeping step times (and so the decodes' TPOT) flat.
- `TargetStepChunks` (--chunk-schedule target-step): the budget a profiled step-time model
  says fits `--target-step-ms` (pdserve/engine/step_profile.py).

As in Sarathi-Serve, the budget caps the whole step: a chunk gets the budget minus the tokens
already in the step. A request with one token left (a decode) is never cut.

Must never: allocate blocks or look at other requests (the scheduler does both).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

from pdserve.engine.config import EngineConfig
from pdserve.engine.request import Request

# Sarathi-Serve rounds its stage sizes to multiples of this (of low_chunk_size when smaller).
CHUNK_ALIGN = 32


class ChunkSchedule(ABC):
    def num_new_tokens(self, request: Request, num_computed: int, num_batched: int, budget: int) -> int:
        """Tokens `request` computes this step: `num_computed` of its tokens have KV (a prefix hit
        included), `num_batched` are already in the step, `budget` tokens of the step are left."""
        remaining = request.num_tokens - num_computed
        if remaining == 1:
            return min(1, budget)
        return max(0, min(remaining, budget, self.step_tokens(num_computed) - num_batched))

    @abstractmethod
    def step_tokens(self, num_computed: int) -> int:
        """The step's token budget while a prompt with `num_computed` tokens computed is chunked."""


class FixedChunks(ChunkSchedule):
    def __init__(self, max_num_batched_tokens: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens

    def step_tokens(self, num_computed: int) -> int:
        return self.max_num_batched_tokens


def staged_chunk_sizes(low: int, high: int, stages: int) -> list[int]:
    """Sarathi-Serve's stage sizes, largest first (microsoft/sarathi-serve,
    sarathi/core/scheduler/sarathi_scheduler.py, `_compute_chunk_size_schedule`):
    `np.linspace(low, high, stages, dtype=int32)[::-1]`, each rounded half-to-even to a multiple
    of min(32, low). Written without numpy; the integer cast truncates like numpy's."""
    step = (high - low) / (stages - 1) if stages > 1 else 0.0
    sizes = [high if i == stages - 1 and stages > 1 else int(low + i * step) for i in range(stages)][::-1]
    align = min(CHUNK_ALIGN, low)
    return [round(s / align) * align for s in sizes]


class StagedChunks(ChunkSchedule):
    def __init__(self, low: int, high: int, stages: int, max_tokens: int) -> None:
        self.chunk_sizes = staged_chunk_sizes(low, high, stages)
        # Sarathi-Serve: tokens_per_stage = ceil(chunk_schedule_max_tokens / stages).
        self.tokens_per_stage = math.ceil(max_tokens / stages)

    def step_tokens(self, num_computed: int) -> int:
        # Sarathi-Serve asserts a prompt never passes its last stage; a prompt longer than
        # chunk_schedule_max_tokens stays in it here.
        stage = min(num_computed // self.tokens_per_stage, len(self.chunk_sizes) - 1)
        return self.chunk_sizes[stage]


class TargetStepChunks(ChunkSchedule):
    """A constant budget: the most tokens whose modelled step time fits the target."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def step_tokens(self, num_computed: int) -> int:
        return self.tokens


def chunk_schedule_for(config: EngineConfig, step_tokens_within_target: Callable[[], int]) -> ChunkSchedule:
    """The config's schedule; `step_tokens_within_target` profiles the model (target-step only)."""
    builders: dict[str, Callable[[], ChunkSchedule]] = {
        "fixed": lambda: FixedChunks(config.max_num_batched_tokens),
        "staged": lambda: StagedChunks(config.low_chunk_size, config.staged_high_chunk_size,
                                       config.chunk_schedule_stages, config.chunk_schedule_max_tokens),
        "target-step": lambda: TargetStepChunks(step_tokens_within_target()),
    }
    return builders[config.chunk_schedule]()
