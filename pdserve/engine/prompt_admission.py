"""When a waiting prompt may join the running batch: vLLM v0's watermark and delay factor.

Both hold back *new prompts* only: requests with nothing computed (fresh, or preempted and
to be recomputed). A request that joins the queue with its KV already computed (a decode
node's import) asks for no more than a decode does and is never held. Requests already
running are never held either: the rules decide admission, not progress.

- Watermark: a new prompt is admitted only if, after its blocks are allocated, at least
  `watermark_blocks` stay free, so that admitting it does not force a preemption of a running
  request a step later (vLLM v0's `BlockSpaceManager.can_allocate`). It applies only while
  something runs: with nothing running there is nothing to preempt, and a prompt that needs
  nearly the whole pool would otherwise wait forever.
- Delay factor (vLLM v0's `Scheduler._passed_delay`): while something runs, new prompts wait
  until the earliest waiting prompt has waited longer than `delay_factor` × the latency of the
  last step that admitted prompts, so prompts arriving close together are batched into one
  prefill step instead of each interrupting the decodes. 0 turns it off.

Must never: allocate blocks or reorder the queue (the scheduler does both).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.engine.clock import Clock, MonotonicClock
from pdserve.engine.request import Request


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """The blocks a new prompt must leave free: vLLM's `int(watermark * num_blocks)` (rounded
    down, so a tiny pool keeps none)."""
    return int(watermark * num_blocks)


def is_new_prompt(request: Request) -> bool:
    return request.num_computed_tokens == 0


class PromptAdmission:
    def __init__(self, watermark_blocks: int = 0, delay_factor: float = 0.0, clock: Clock | None = None) -> None:
        self.watermark_blocks = watermark_blocks
        self.delay_factor = delay_factor
        self.clock = clock or MonotonicClock()
        self.last_prompt_latency = 0.0  # seconds from a step that admitted prompts to the next step
        self._prev_step_time = 0.0
        self._prev_step_admitted = False
        self._passed_delay = True

    def arrived(self, request: Request) -> None:
        """Stamp a request as it joins the waiting queue (a preempted one keeps its stamp)."""
        request.arrival_time = self.clock.now()

    def start_step(self, waiting: Iterable[Request], anything_running: bool) -> None:
        """Decide, once per step, whether this step's new prompts have waited long enough."""
        now = self.clock.now()
        if self._prev_step_admitted:
            self.last_prompt_latency = now - self._prev_step_time
        self._prev_step_time, self._prev_step_admitted = now, False
        if self.delay_factor <= 0 or not anything_running:  # off, or nothing to hold prompts for
            self._passed_delay = True
            return
        earliest = min((r.arrival_time for r in waiting if is_new_prompt(r)), default=None)
        self._passed_delay = earliest is None or now - earliest > self.delay_factor * self.last_prompt_latency

    def blocks_to_keep_free(self, request: Request, anything_running: bool) -> int | None:
        """Blocks that must stay free once `request` has its blocks; None: hold it this step."""
        if not is_new_prompt(request):
            return 0
        if not self._passed_delay:
            return None
        return self.watermark_blocks if anything_running else 0

    def admitted(self, request: Request) -> None:
        """`request` was admitted this step (call before its prefix hit counts as computed)."""
        if is_new_prompt(request):
            self._prev_step_admitted = True
