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

`--local-prefill-tokens-per-s R` bounds `auto` by time as well: the decode nodes may compute at
most R prompt tokens a second each for themselves, and one bound's worth at once (a token
bucket, `PromptBudget`, as deep as `--local-prefill-max-tokens`; so with a budget no prompt
longer than the bound goes there, even when the prefill pool is further behind). The bound
limits how long one prompt stalls a node's streams; the budget limits how often, which is what
a TPOT target needs: a decode node that spends a share F of its time on prompts stretches its
streams' time per token by about 1/(1-F), so F = 1 - (decode step / TPOT target) is the most it
could give, and less is needed for the slow tail. `pdserve plan` tries rates from that share
and the node's measured prefill speed; unset, there is no such bound.

A decode node started with `--serve-prefill` is a prefill node too, so a pool of such nodes is
colocated and disaggregated at once. There every node streams tokens, so keeping prompts off
"the decode nodes" means nothing; what moving a prompt's KV buys is room: the prompt is computed
where its token 1 comes soonest (the node with the least to compute, its prefix cache counted)
and decoded there, unless that node is short of KV for it — it could not hold the request with
as many blocks again to spare — while another decode node could (`kv_short`, `short_of_kv`):
then that node decodes it and the prompt's KV moves to it. Moving it on a milder imbalance (any
node with more free blocks after taking the request) was measured: it moved a quarter to a third
of the requests, cost TTFT attainment (the reservation waits for the decode node's step, the KV
for its transfer) and did not raise TPOT attainment (docs/benchmarks.md). The prompt budget
does not apply: every node computes prompts.

`PrefillChoice` is pure: it decides from the token counts it is given (`Loads`, which
`local_loads` gathers the same way for the router and the planner's simulator) and whether the
budget allows the prompt. `HybridRouting` is the one stateful part: the budget, on the clock it
is given (the router's, or the simulator's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    local_nodes: int = 1  # live decode nodes that can prefill (the budget is per node)
    # The nearest prefill node is a decode node too (--serve-prefill), and whether the local one is
    # short of KV for this request while another decode node is not (`short_of_kv`).
    pool_decodes: bool = False
    kv_short: bool = False

    @property
    def local_new_tokens(self) -> int:
        """Tokens of this prompt that decode node would compute: the part it does not hold."""
        return max(0, self.prompt_tokens - self.local_cached_tokens)

    @property
    def local_wait(self) -> int:
        """Prompt tokens that decode node computes before this request's token 1."""
        return (self.local_queue or 0) + self.local_new_tokens


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    mode: Disaggregation
    max_local_tokens: int
    # `auto`: prompt tokens a second each decode node may compute for itself; None: no such bound.
    local_tokens_per_s: float | None = None

    def local(self, loads: Loads, within_budget: bool = True) -> bool:
        """True: compute the prompt on a decode node; False: on the prefill pool. Either may be
        impossible (no such node live): the caller then takes the other, or refuses. `auto` sends
        none beyond the prompt budget (`within_budget`: what `PromptBudget.allows` says)."""
        if loads.local_queue is None:
            return False
        if self.mode is Disaggregation.NEVER or loads.prefill_queue is None:
            return True
        if self.mode is Disaggregation.ALWAYS:
            return False
        if loads.pool_decodes:  # every node streams tokens: the KV moves only for room
            return not loads.kv_short
        if not within_budget:
            return False
        local = loads.local_wait
        return local <= self.max_local_tokens or loads.prefill_queue > local


class PromptBudget:
    """A token bucket of the prompt tokens decode nodes compute for themselves: it fills at
    `tokens_per_s` per live node up to `depth` tokens per node (the token bound), and each local
    prompt takes its new tokens out; a prompt goes only if they are left. So no prompt longer than
    the bound reaches a decode node, not even when the prefill pool is further behind: under a
    TPOT target that one stall would cost more than the pool's wait. None: unbounded."""

    def __init__(self, tokens_per_s: float | None, depth: int, clock: Callable[[], float]) -> None:
        self._rate = tokens_per_s
        self._depth = depth
        self._clock = clock
        self._level: float | None = None  # full at the first look
        self._at = 0.0

    def allows(self, tokens: int, nodes: int) -> bool:
        """May `nodes` decode nodes that prefill compute `tokens` more prompt tokens now?"""
        if self._rate is None:
            return True
        now, nodes = self._clock(), max(nodes, 1)
        capacity = self._depth * nodes
        if self._level is None:
            self._level = capacity
        else:
            self._level = min(capacity, self._level + (now - self._at) * self._rate * nodes)
        self._at = now
        return tokens <= self._level

    def take(self, tokens: int) -> None:
        if self._rate is not None and self._level is not None:
            self._level -= tokens


class HybridRouting:
    """The router's choice with its budget: one per router (or simulated run), on its clock."""

    def __init__(self, choice: PrefillChoice, clock: Callable[[], float]) -> None:
        self.choice = choice
        self._budget = PromptBudget(choice.local_tokens_per_s, choice.max_local_tokens, clock)

    def local(self, loads: Loads) -> bool:
        """`PrefillChoice.local` within the budget; a prompt sent to a decode node is charged to
        it whatever the mode, so the budget counts all the prompt work the decode nodes do."""
        if not self.choice.local(loads, self._budget.allows(loads.local_new_tokens, loads.local_nodes)):
            return False
        self._budget.take(loads.local_new_tokens)
        return True


@dataclass(frozen=True, slots=True)
class PoolNode:
    """A prefill node as `auto` weighs it."""

    node_id: str
    queue: int  # prompt tokens it has to compute, as the prefill placement counts them
    decodes: bool = False  # a decode node with --serve-prefill


def local_loads(placement: ColocatedPlacement, prompt_tokens: int, hashes: Sequence[BlockHash],
                prefill: Sequence[PoolNode], local: Sequence[Candidate],
                short_of_room: Callable[[Candidate], bool] = lambda c: False) -> Loads:
    """`Loads` for a prompt of `prompt_tokens` whose leading blocks are `hashes`, given the prefill
    pool's nodes and the `local` candidates (decode nodes that prefill): their queues as
    `placement` (the local route's) counts them, and what each holds of the prompt as its prefix
    affinity forecasts it. The pool is weighed without the local node itself (it may be in both:
    the pool route never computes a prompt on its own decode node). `short_of_room(c)`: is `c`
    short of KV for this request while another decode node is not (`short_of_kv`)?"""
    if not local:
        return Loads(prompt_tokens, min((p.queue for p in prefill), default=None), None)
    cached = {c.node_id: min(prompt_tokens, placement.cached_tokens(c, hashes)) for c in local}
    best = min(local, key=lambda c: (placement.load(c) - cached[c.node_id], c.node_id))
    nearest = min((p for p in prefill if p.node_id != best.node_id), key=lambda p: (p.queue, p.node_id),
                  default=None)
    if nearest is None:
        return Loads(prompt_tokens, None, placement.load(best), cached[best.node_id], len(local))
    return Loads(prompt_tokens, nearest.queue, placement.load(best), cached[best.node_id], len(local),
                 pool_decodes=nearest.decodes, kv_short=nearest.decodes and short_of_room(best))


def short_of_kv(free_blocks: Mapping[str, int], num_blocks: int) -> Callable[[Candidate], bool]:
    """For `local_loads`, from each decode node's free KV blocks (as the decode placement counts
    them) and the request's most blocks: could candidate `c` not hold the request with as many
    blocks again to spare, while another decode node could?"""
    most = max(free_blocks.values(), default=0)
    return lambda c: free_blocks[c.node_id] < 2 * num_blocks <= most
