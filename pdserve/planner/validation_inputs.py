"""What a validation measures of the profile's inputs while a candidate serves: each node's step
sums and the serving stack's CPU, read before and after its sweep, and what they say against the
profile (pdserve/planner/step_speed.py, pdserve/planner/stack_use.py).

The steps are asked of each node (`GetStats`: its engine core's counts now), not read from the
router's copy of its last heartbeat, which a short sweep can end before. A reading that fails is
logged and the validation goes on without it: these readings explain a measurement.

Must never: start or stop a cluster (pdserve/planner/validate.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster_process import ClusterProcess
from pdserve.common.metrics_endpoint import scrape
from pdserve.engine.step_shape import StepTotals
from pdserve.planner.profile import ServingCosts
from pdserve.planner.search import Layout
from pdserve.planner.stack_use import Served, StackCpu, StackSpeed, stack_speeds
from pdserve.planner.step_cost import StepCost
from pdserve.planner.step_speed import NodeKey, StepSpeed, pool_steps


@dataclass(frozen=True)
class Readings:
    """The router's /metrics, each node's step sums and the stack processes' CPU at one moment of a
    validated cluster."""

    metrics: str
    steps: dict[NodeKey, StepTotals]
    cpu: StackCpu

    @classmethod
    def take(cls, cluster: ClusterProcess, log) -> Readings | None:
        """None when a node or the router could not be read (logged): these readings explain a
        measurement, and a validation goes on without them."""
        try:
            children = cluster.refresh().children  # a child the launcher restarted has a new pid
            steps = {(name, children[name].kind): StepTotals.of(stats.steps)
                     for name, stats in cluster.node_stats().items()}
            fronts = [child.pid for child in children.values() if child.kind != "router"]
            return cls(scrape(children["router"].metrics_url), steps,
                       StackCpu.read(children["router"].pid, fronts, cluster.pid))
        except Exception as err:  # a node's GetStats (gRPC), the router's /metrics (HTTP), /proc
            log(f"validate: the cluster's steps and the stack's CPU could not be read ({type(err).__name__}: {err}); "
                "this measurement goes without them")
            return None

    def stack_against(self, before: Readings, costs: ServingCosts | None) -> dict[str, StackSpeed]:
        if costs is None:
            return {}
        served = Served.parse(self.metrics).since(Served.parse(before.metrics))
        return stack_speeds(self.cpu.used_since(before.cpu), served, costs)


def step_speeds(before: dict[NodeKey, StepTotals], after: dict[NodeKey, StepTotals], layout: Layout,
                costs: dict[tuple[int, int], StepCost]) -> dict[str, StepSpeed]:
    """How fast each kind of node's steps ran between two readings of every node's step sums."""
    steps = pool_steps(before, after)
    return {kind: StepSpeed.of(totals, costs[layout.pool_setup(kind)], layout.pool_setup(kind)[1])
            for kind, totals in steps.items() if layout.pool_setup(kind) in costs}
