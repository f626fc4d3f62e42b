"""Where a request's prompt is computed when decode nodes can also prefill: the prefill pool, or
the decode node itself (conditional disaggregation).

A decode node started with `--local-prefill` serves `ColocatedNode.Generate` besides `Decode`,
and registers saying so. `--disaggregation` picks, per request:

- `always`: the prefill pool (the disaggregated route), as a cluster without such nodes does;
- `never`: the decode node itself (its colocated route): no KV moves;
- `auto`: the decode node when its share is small — the prompt tokens it would compute before
  this request's token 1 (its queue and this prompt) within `--local-prefill-max-tokens`, few
  enough to ride along its decode steps without stretching every stream's time per token much
  — or when the prefill pool is further behind than that (its shortest queue longer), so the
  pool would only delay the first token; the prefill pool otherwise, which keeps long prompts
  off the nodes that stream tokens.

Pure: decides from token counts it is given (`Loads`), never calls a node or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Disaggregation(str, Enum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Loads:
    """What one request would wait behind, in prompt tokens still to compute."""

    prompt_tokens: int
    prefill_queue: int | None  # the shortest among live prefill nodes; None: none live
    local_queue: int | None  # the shortest among live decode nodes that can prefill; None: none live


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    mode: Disaggregation
    max_local_tokens: int

    def local(self, loads: Loads) -> bool:
        """True: compute the prompt on a decode node; False: on the prefill pool. Either may be
        impossible (no such node live): the caller then takes the other, or refuses."""
        if loads.local_queue is None:
            return False
        if self.mode is Disaggregation.NEVER or loads.prefill_queue is None:
            return True
        if self.mode is Disaggregation.ALWAYS:
            return False
        local = loads.local_queue + loads.prompt_tokens
        return local <= self.max_local_tokens or loads.prefill_queue > local
