"""Steps on a machine whose cores the nodes share (`ProcessorSharing`), computed by hand: steps
that start together, a step joined halfway, and the router as one more thread; and the cluster
simulator choosing it only when the nodes' threads outnumber the machine's cores."""

from __future__ import annotations

import heapq
import itertools

import pytest

from pdserve.bench.serve.metrics import request_metrics
from pdserve.engine.config import EngineConfig
from pdserve.planner.core_sharing import ProcessorSharing
from pdserve.planner.simulator import ClusterSim, ClusterSpec, Pool, SimRequest
from tests.unit.planner_profiles import synthetic_profile


class Events:
    """A heap of (time, action), run in order: the simulator's event queue, alone."""

    def __init__(self) -> None:
        self._heap: list = []
        self._seq = itertools.count()
        self.ended: dict[str, float] = {}  # node -> the wall seconds its step took

    def at(self, t: float, action) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    def done(self, node: str, wall_s: float) -> None:
        self.ended[node] = wall_s

    def run(self) -> None:
        while self._heap:
            _, _, action = heapq.heappop(self._heap)
            action()


def sharing(cores: int, threads: dict[str, int], stack_rate: float = 0.0) -> tuple[ProcessorSharing, Events]:
    events = Events()
    return ProcessorSharing(cores, threads, lambda now: stack_rate, events.at, events.done), events


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
    timing, events = sharing(2, {"a": 2}, stack_rate=1.0)
    assert timing.router_slowdown(0.0) == pytest.approx(1.0)  # 1 + 0 stepping + 1 of stack: fits on 2
    timing.start("a", 0.1, 0.0)
    assert timing.router_slowdown(0.0) == pytest.approx(2.0)  # 1 + 2 + 1 on 2 cores
    events.run()
    assert events.ended == pytest.approx({"a": 0.15})  # 2 threads and 1 of stack on 2 cores


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
