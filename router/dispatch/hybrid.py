"""Where a request's prompt is computed when decode nodes can also prefill: the prefill pool, or
the decode node itself (conditional disaggregation).

A decode node started with `--local-prefill` serves `ColocatedNode.Generate` besides `Decode`,
and registers saying so. `--disaggregation` picks, per request:

- `always`: the prefill pool (the disaggregated route), as a cluster without such nodes does;
- `never`: the decode node itself (its colocated route): no KV moves;
- `auto`: the decode node when its share is small — the prompt tokens it would compute before
  this request's token 1 (its queue and the part of this prompt not already in its prefix
  cache, as the router's prefix affinity forecasts it) within `--local-prefill-max-tokens`, few
  enough to ride along its decode steps without stretching every stream's time per token much
  — or when the prefill pool is further behind than that (its shortest queue longer), so the
  pool would only delay the first token; the prefill pool otherwise, which keeps long prompts
  off the nodes that stream tokens.

Pure: decides from token counts it is given (`Loads`, which `local_loads` gathers the same way
for the router and the planner's simulator), never calls a node or reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pdserve.engine.block_pool import BlockHash
from pdserve.router.cluster.placement import Candidate, ColocatedPlacement


class Disaggregation(str, Enum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Loads:
    """What one request would wait behind, in prompt tokens still to compute."""

    prompt_tokens: int
    prefill_queue: int | None  # the shortest among live prefill nodes; None: none live
    # The live decode node that can prefill with the least to compute before this prompt's
    # token 1: its queue (None: no such node live), and the tokens of this prompt it holds already.
    local_queue: int | None
    local_cached_tokens: int = 0

    @property
    def local_wait(self) -> int:
        """Prompt tokens that decode node computes before this request's token 1."""
        return (self.local_queue or 0) + max(0, self.prompt_tokens - self.local_cached_tokens)


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
        local = loads.local_wait
        return local <= self.max_local_tokens or loads.prefill_queue > local


def local_loads(placement: ColocatedPlacement, prompt_tokens: int, hashes: Sequence[BlockHash],
                prefill_queue: int | None, local: Sequence[Candidate]) -> Loads:
    """`Loads` for a prompt of `prompt_tokens` whose leading blocks are `hashes`, given the prefill
    pool's shortest queue and the `local` candidates (decode nodes that prefill): their queues as
    `placement` (the local route's) counts them, and what each holds of the prompt as its prefix
    affinity forecasts it."""
    if not local:
        return Loads(prompt_tokens, prefill_queue, None)
    cached = {c.node_id: min(prompt_tokens, placement.cached_tokens(c, hashes)) for c in local}
    best = min(local, key=lambda c: (placement.load(c) - cached[c.node_id], c.node_id))
    return Loads(prompt_tokens, prefill_queue, placement.load(best), cached[best.node_id])
