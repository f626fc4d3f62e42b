"""The serving stack's share of the nodes' cores as a simulated run goes, and what it does to a step.

On one machine the router, the node fronts and (when the load generator runs here) the client
take their CPU from the cores the engines step on. Each is a `CpuLoad`, charged its CPU when the
work happens — a request's per-request part when it arrives or is placed, a token's per-token
part when a node streams it (the profile's `ServingCosts`) — which keeps an exponentially
weighted rate of it over about `WINDOW_S`. Where that CPU lands follows the launcher's pinning:

- a node's front is pinned with its engine core (`--<kind>-cores`): its CPU is that node's
  cores' alone, so a decode node that relays every token carries all of that work, and the
  prefill node beside it only its per-request part;
- the router and the client run on the cores of the pool a plan pins the router to
  (`--router-cores`, the validation's client with it), or, unpinned, where the OS finds a core
  idle. Each node they may run on takes a part of their CPU in proportion to its idle cores (its
  cores less its engine's and its front's share, `idle_weighted`). Measured on a hybrid 1P1D pair
  (one core each, uniform 128–512-token prompts, 5 requests/s), unpinned: the router and the
  client ran on the prefill node's core in 85% of samples, the decode node's core being the busy
  one (its engine 0.75 of a core, its front 0.15; the prefill node's engine 0.39). At 10.7
  requests/s on a 1P1D pair they ran on the decode core instead, and stretched its steps 3–4×
  where this model put them on the prefill core: why a plan pins a split's router
  (pdserve/planner/search.py `ROUTER_POOLS`).

A step that starts at t on a node takes 1 / (1 − u) of its profiled time, u the node's front's
share of its cores plus its part of the router's and client's CPU over its cores (`stretch`).

The sharing goes both ways: the router's work takes longer than its CPU time while the cores it
may run on are busy with others (`router_slowdown`). The OS puts it on an idle core when there is
one; when every node it may run on is busy (its engine stepping, its front and the client
relaying), it shares a core with them and runs at half speed or less. It matters where the
router is near its limit: on an AMX machine in bf16, where the stack takes most of the two cores
(a hybrid 1P1D pair there, its router on the prefill core, measured at 21.6 requests/s with both
cores full), it moved the plans' predictions by 0–2% with the router's CPU profiled on a core of
its own, and by more once that CPU was profiled as it runs, sharing a core (pdserve/planner/measure_stack.py).

Why charged as it happens, not at the arrival rate × the mean output (the steady state): a
sweep's probe of a few hundred requests with long outputs never reaches that state. Its tokens
come seconds after its arrivals, many after the last one. Measured on a chat probe (13.65
requests/s, colocated × 2 on 2 cores, 338 output tokens on average): the router, fronts and
client took 0.60 of a core over the run, where the arrival rate × mean output charged 1.45 from
the first step, stretching every step 3.6× (the chat plans' TPOT p90 predicted up to 2.7× the
measured).

Pure: numbers in, numbers out; the simulator's clock is passed in.
"""

from __future__ import annotations

import math

# Over about this long the stack's rate of CPU is averaged: a few hundred decode steps, long
# enough that one request's burst of per-request work does not stall a step, short enough to
# follow a probe's ramp up and its drain.
WINDOW_S = 0.5

# Over about this long a node's own engine utilisation is averaged, for where the floating work
# goes: long enough that two nodes equally loaded look equally idle between their steps (with the
# 0.5 s window the floating work fell into each step's gaps, and symmetric layouts were predicted
# up to 12% higher), short enough to follow a probe.
UTILISATION_WINDOW_S = 5.0

# A serving stack that would need more than this share of the nodes' cores is a bottleneck the
# router's queue already shows; the steps are not slowed without bound for it.
MAX_STACK_SHARE = 0.9


class CpuLoad:
    """One share of the stack's work over `cores` cores."""

    def __init__(self, cores: int, window_s: float = WINDOW_S) -> None:
        self._cores = cores
        self._window_s = window_s
        self._rate = 0.0  # CPU seconds per second, as of `_at`
        self._at = 0.0

    def charge(self, now: float, cpu_s: float) -> None:
        """`cpu_s` of CPU spent at `now`."""
        if cpu_s > 0:
            self._rate = self.rate(now) + cpu_s / self._window_s
            self._at = now

    def rate(self, now: float) -> float:
        """CPU per second at `now`, in cores."""
        return self._rate * math.exp(-(now - self._at) / self._window_s)

    def share(self, now: float) -> float:
        """The part of its cores it takes at `now` (0 with no cores)."""
        return self.rate(now) / self._cores if self._cores >= 1 else 0.0


def stretch(*shares: float) -> float:
    """How much longer a step takes than its profiled time on cores that the stack takes
    `shares` of."""
    return 1.0 / (1.0 - min(sum(shares), MAX_STACK_SHARE))


def idle_weighted(floating: float, idle_cores: list[float], cores: list[int]) -> list[float]:
    """The part of `floating` cores of unpinned work each node takes, as a share of its own
    cores: in proportion to its idle cores (`idle_cores`), or evenly over all cores when no node
    has any idle."""
    total_idle = sum(idle_cores)
    if total_idle <= 0:
        return [floating / sum(cores)] * len(cores)
    return [floating * idle / total_idle / n for idle, n in zip(idle_cores, cores)]


def router_slowdown(busy: list[float]) -> float:
    """How many times its CPU time the router's work takes: `busy` holds, for each node the router
    may run on, the share of its cores that others keep busy (its engine, its front, the client).
    The router waits only when every one is busy — they are taken as independent — and then
    shares a core with at least one other thread: at most half speed, so 1 + the chance of that."""
    return 1.0 + math.prod(min(1.0, b) for b in busy) if busy else 1.0
