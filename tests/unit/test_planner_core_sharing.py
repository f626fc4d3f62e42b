"""Steps on a machine whose cores the nodes share (`ProcessorSharing`), computed by hand: steps
that start together, a step joined halfway, and the router as one more thread; and the cluster
simulator choosing it only when the nodes' threads outnumber the machine's cores."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from pdserve.bench.serve.metrics import request_metrics
from pdserve.engine.config import EngineConfig
from pdserve.planner.core_sharing import ProcessorSharing
from pdserve.planner.cluster_spec import ClusterSpec, Pool
from pdserve.planner.simulator import ClusterSim, SimRequest
from tests.unit.planner_profiles import synthetic_profile


class Events:
    """A heap of (time, action), run in order: the simulator's event queue, alone. `ended` holds,
    for each node, the wall seconds of each of its steps; `ended_at`, the clock when each ended."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.ended: dict[str, float] = {}
        self.ended_at: dict[str, list[float]] = {}
        self.then: dict[str, list] = {}  # node -> what to do when its step ends (one entry a step)

    def at(self, t: float, action) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    def done(self, node: str, wall_s: float) -> None:
        self.ended[node] = wall_s
        self.ended_at.setdefault(node, []).append(self.now)
        if self.then.get(node):
            self.then[node].pop(0)()

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()


def sharing(cores: int, threads: dict[str, int], stack_rate: float = 0.0,
            router_rate: float = 0.0) -> tuple[ProcessorSharing, Events]:
    events = Events()
    timing = ProcessorSharing(cores, threads, lambda now: stack_rate, lambda now: router_rate, events.at, events.done)
    return timing, events


def test_three_steps_started_together_on_two_cores_each_take_half_as_long_again():
    timing, events = sharing(2, {"a": 1, "b": 1, "c": 1})
    for node in "abc":
        timing.start(node, 0.1, 0.0)
    events.run()
    assert events.ended == pytest.approx({"a": 0.15, "b": 0.15, "c": 0.15})


def test_a_step_joined_halfway_slows_from_then_and_the_other_finishes_alone():
    """One core, two 100 ms steps 50 ms apart: a runs alone for 50 ms, then both at half speed
    until a's last 50 ms are done (at 150 ms); b, 50 ms done by then, finishes alone at 200 ms."""
    timing, events = sharing(1, {"a": 1, "b": 1})
    timing.start("a", 0.1, 0.0)
    events.at(0.05, lambda: timing.start("b", 0.1, 0.05))
    events.run()
    assert events.ended == pytest.approx({"a": 0.15, "b": 0.15})  # wall seconds: 0–0.15 and 0.05–0.2


def test_the_stack_and_the_router_are_threads_of_the_same_machine():
    """A 2-thread node and 1 core of stack (half of it the router's own) on 2 cores."""
    timing, events = sharing(2, {"a": 2}, stack_rate=1.0, router_rate=0.5)
    assert timing.router_slowdown(0.0) == pytest.approx(1.0)  # the router and 0.5 of others: fits on 2
    timing.start("a", 0.1, 0.0)
    assert timing.router_slowdown(0.0) == pytest.approx(1.75)  # the router, 2 threads and 0.5 on 2 cores
    events.run()
    assert events.ended == pytest.approx({"a": 0.15})  # 2 threads and 1 of stack on 2 cores


def test_a_nodes_next_step_ends_on_its_own_time_not_on_an_event_left_from_its_last():
    """Two cores; a: two 0.1 s steps back to back, b and c: 0.3 s each, all from 0. Three threads
    run at 2/3 speed: a's first step ends at 0.15 and its second at 0.30 (b and c, 0.2 done by
    then, finish alone at full speed at 0.40)."""
    timing, events = sharing(2, {"a": 1, "b": 1, "c": 1})
    events.then["a"] = [lambda: timing.start("a", 0.1, events.now)]
    for node, seconds in (("a", 0.1), ("b", 0.3), ("c", 0.3)):
        timing.start(node, seconds, 0.0)
    events.run()
    ended_at = [(node, t) for node, times in sorted(events.ended_at.items()) for t in times]
    assert [node for node, _ in ended_at] == ["a", "a", "b", "c"]
    assert [t for _, t in ended_at] == pytest.approx([0.15, 0.30, 0.40, 0.40])


def fluid_ends(cores: int, steps: dict[str, list[float]]) -> dict[str, list[float]]:
    """Processor sharing computed directly: every node steps its list back to back from 0; at
    each moment every step in progress advances at min(1, cores / steps in progress)."""
    left = {node: list(seconds) for node, seconds in steps.items() if seconds}
    ends: dict[str, list[float]] = {node: [] for node in steps}
    now = 0.0
    while left:
        speed = min(1.0, cores / len(left))
        first = min(seconds[0] for seconds in left.values())
        now += first / speed
        for node in list(left):
            left[node][0] -= first
            if left[node][0] <= 1e-12:
                ends[node].append(now)
                left[node].pop(0)
                if not left[node]:
                    del left[node]
    return ends


def test_back_to_back_steps_of_random_lengths_end_when_processor_sharing_says():
    """Every reschedule leaves end events behind; none of them may end a later step of the same
    node. Nodes stepping back to back with random lengths, against the sharing computed directly."""
    rng = random.Random(7)
    for _ in range(60):
        cores = rng.randint(1, 3)
        steps = {f"n{i}": [round(rng.uniform(0.01, 0.2), 3) for _ in range(rng.randint(1, 5))]
                 for i in range(rng.randint(2, 5))}
        timing, events = sharing(cores, {node: 1 for node in steps})
        queued = {node: list(seconds[1:]) for node, seconds in steps.items()}
        for node in steps:
            events.then[node] = [lambda n=node: timing.start(n, queued[n].pop(0), events.now)
                                 for _ in queued[node]]
            timing.start(node, steps[node][0], 0.0)
        events.run()
        expected = fluid_ends(cores, steps)
        assert set(events.ended_at) == set(expected)
        for node, times in expected.items():
            assert events.ended_at[node] == pytest.approx(times), (cores, steps)


def test_a_machine_needs_a_core():
    with pytest.raises(ValueError, match="machine_cores"):
        sharing(0, {"a": 1})


def config(**kw) -> EngineConfig:
    return EngineConfig(model="synthetic", dtype="float32", num_blocks=1000, num_threads=1, max_num_seqs=1, **kw)


def ttfts(machine_cores: int | None, nodes: int = 3, requests: int = 3) -> list[float]:
    profile = synthetic_profile(base_s=0.01, per_token_s=0.001)
    spec = ClusterSpec(colocated=Pool(nodes, config(), profile), machine_cores=machine_cores)
    prompts = [tuple(range(k * 100 + 1, (k + 1) * 100 + 1)) for k in range(requests)]
    traces = ClusterSim(spec, 4096).run([SimRequest(0.0, p, 1) for p in prompts])
    return sorted(request_metrics(t).ttft_s for t in traces)


def test_three_one_thread_nodes_on_two_cores_prefill_together_half_as_fast_again():
    assert ttfts(None) == pytest.approx([0.11] * 3)  # a core each
    assert ttfts(2) == pytest.approx([0.165] * 3)


def test_a_step_alone_runs_at_full_speed_on_a_shared_machine():
    assert ttfts(2, requests=1) == pytest.approx([0.11])


def test_a_machine_with_a_core_for_every_node_thread_is_not_shared():
    assert ttfts(3) == ttfts(None) == ttfts(8)
    assert not ClusterSpec(colocated=Pool(3, config(), synthetic_profile()), machine_cores=3).shares_cores


def test_a_cluster_spec_needs_a_machine_core():
    with pytest.raises(ValueError, match="machine_cores"):
        ClusterSpec(colocated=Pool(1, config(), synthetic_profile()), machine_cores=0)
