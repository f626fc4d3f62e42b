"""How long a step takes on the clock: each node on cores of its own, or nodes that share the machine's.

A simulated step is priced by the profile in the seconds it takes on the node's own cores. Where
the wall clock gets those seconds depends on the machine:

- `OwnCores`: every node has cores of its own (a plan's layouts, `pdserve cluster --*-cores`).
  Only the serving stack shares them (pdserve/planner/stack_load.py), so a step's time is fixed
  when it starts, stretched by the stack's share of the node's cores at that moment.
- `ProcessorSharing`: the nodes' threads outnumber the machine's cores and nothing pins them
  (`pdserve cluster --rebalance` with three one-thread nodes on two cores, the default of
  `pdserve bench rebalance`). The OS shares the cores among whatever runs: while the stepping
  nodes' threads and the stack's CPU rate add up to D > C cores, each step advances at C / D of
  its speed. A step's end is set again whenever another starts or ends (the machine's processor
  sharing, exactly, not the load at its start: three steps started together all take 1.5× on two
  cores, where fixing each at its start would give 1×, 1× and 1.5×). The router's work takes
  (1 + D′) / C of its CPU time, D′ what the others want (D less the router's own rate): the
  router is one more thread. Pinning is not modelled here: the
  stack runs where the OS puts it.

Why: given a core of its own, each of three nodes on two cores could step at full speed while all
three were busy. What it does not model: that a step's own CPU grows beside other busy processes
(measured on a 2-core AVX2 machine, docs/benchmarks.md: a prefill node's main thread spent 115 ms
of CPU a request at 6 requests/s beside two decode nodes, where the profile prices 72–75), which
is why the load mode there still predicts SLOs its 1P2D cluster misses.

Pure: numbers in, numbers out; the simulator's clock and event queue are passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol

Schedule = Callable[[float, Callable[[], None]], None]  # at(t, action): run action at time t
StepDone = Callable[[Hashable, float], None]  # done(node, wall seconds the step took)


class StepTiming(Protocol):
    def start(self, node: Hashable, seconds: float, now: float) -> None:
        """`node` starts a step of `seconds` on its own cores; `done` is called when it ends."""

    def router_slowdown(self, now: float) -> float:
        """How many times its CPU time the router's work takes, from `now`."""


class OwnCores:
    """Each node on cores of its own: a step takes its seconds × `stretch(node, now)` (the stack's
    share of those cores when it starts)."""

    def __init__(self, stretch: Callable[[Hashable, float], float], router_slowdown: Callable[[float], float],
                 at: Schedule, done: StepDone) -> None:
        self._stretch, self._router_slowdown, self._at, self._done = stretch, router_slowdown, at, done

    def start(self, node: Hashable, seconds: float, now: float) -> None:
        duration = seconds * self._stretch(node, now)
        self._at(now + duration, lambda: self._done(node, duration))

    def router_slowdown(self, now: float) -> float:
        return self._router_slowdown(now)


@dataclass(slots=True)
class _Step:
    left_s: float  # of the step's seconds on its own cores, still to run
    started_s: float
    settled_s: float  # when left_s was last brought up to date
    ends_s: float = 0.0
    generation: int = -1  # its end event's, from one counter for all steps: any other event is stale


class ProcessorSharing:
    """Nodes whose threads share `machine_cores` with each other and the stack, as the OS shares them."""

    def __init__(self, machine_cores: int, threads: Mapping[Hashable, int], stack_rate: Callable[[float], float],
                 router_rate: Callable[[float], float], at: Schedule, done: StepDone) -> None:
        """`threads`: each node's torch threads; `stack_rate(now)`: the serving stack's CPU rate at
        `now` (the router's, the client's, the nodes' fronts' and KV pushes'), in cores;
        `router_rate(now)`: the router's own part of it."""
        if machine_cores < 1:
            raise ValueError(f"machine_cores must be at least 1, got {machine_cores}")
        self._cores, self._threads = machine_cores, threads
        self._stack_rate, self._router_rate = stack_rate, router_rate
        self._at, self._done = at, done
        self._steps: dict[Hashable, _Step] = {}
        self._generations = itertools.count()
        self._speed = 1.0  # of every step in progress, since the last start or end

    def start(self, node: Hashable, seconds: float, now: float) -> None:
        self._settle(now)
        self._steps[node] = _Step(seconds, now, now)
        self._reschedule(now)

    def router_slowdown(self, now: float) -> float:
        """The router is one thread among the others that want a core now."""
        others = self._demand(now) - self._router_rate(now)
        return max(1.0, (1.0 + others) / self._cores)

    def _demand(self, now: float) -> float:
        """Cores wanted at `now`: every stepping node's threads and the stack's rate."""
        return sum(self._threads[node] for node in self._steps) + self._stack_rate(now)

    def _settle(self, now: float) -> None:
        for step in self._steps.values():
            step.left_s = max(0.0, step.left_s - (now - step.settled_s) * self._speed)
            step.settled_s = now

    def _reschedule(self, now: float) -> None:
        demand = self._demand(now)
        self._speed = min(1.0, self._cores / demand) if demand > 0 else 1.0
        for node, step in self._steps.items():
            step.generation = next(self._generations)
            step.ends_s = now + step.left_s / self._speed
            self._at(step.ends_s, lambda n=node, g=step.generation: self._end(n, g))

    def _end(self, node: Hashable, generation: int) -> None:
        step = self._steps.get(node)
        if step is None or step.generation != generation:
            return  # rescheduled since
        now = step.ends_s
        self._settle(now)
        del self._steps[node]
        if self._steps:
            self._reschedule(now)
        self._done(node, now - step.started_s)
