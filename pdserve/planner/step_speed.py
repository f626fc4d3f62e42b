"""How fast a serving cluster's steps ran against the profile: their seconds over the predicted.

Every node sums its engine steps' shapes and seconds (pdserve/engine/step_shape.py) and the
router exports the sums per node (`pdserve_node_steps_total{node, kind}`, ...). The profile's step
model is linear in a step's shape, so over the window between two scrapes it predicts the seconds
of all the steps a pool ran from the counters' increase alone (`StepCost.total`). Per pool:

    speed = the steps' seconds / the profile's seconds for them

Above 1 the steps ran slower than the profile measured them, alone on the machine, perhaps hours
before: beside busy processes that share the caches and the memory, on a machine that drifted.
The ratio is read from the stepping thread's CPU, not the clock: time the thread spent waiting
for a core is the simulator's to model (the processes it charges to the nodes' cores), and
counting it here as well would count it twice. The clock's ratio is kept beside it for reports.

Two users: the load mode simulates each pool with its steps stretched by the pool's speed
(pdserve/planner/load_mode.py), and a validation reports each layout's speed beside its error
(pdserve/planner/validate.py): an error that the speed explains is the profile's, not the
simulator's.

Must never: scrape or read a clock (callers pass the texts), or load torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.step_shape import SERIES, StepTotals
from pdserve.planner.step_cost import StepCost

# The router's series of each StepTotals field.
_FIELD_OF_FAMILY = {f"pdserve_node_{name}": field for field, name, _ in SERIES}
# Fewer predicted seconds of steps than this in a window, and its speed is noise: a handful of
# short steps, where one timer tick or one descheduling weighs as much as the work.
MIN_PREDICTED_S = 1.0

NodeKey = tuple[str, str]  # (node id, kind)


def parse_node_steps(text: str) -> dict[NodeKey, StepTotals]:
    """Each node's step sums from the router's /metrics text."""
    found: dict[NodeKey, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field = _FIELD_OF_FAMILY.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found.setdefault((sample.labels["node"], sample.labels["kind"]), {})[field] = sample.value
    return {key: _totals(values) for key, values in found.items()}


def _totals(values: dict[str, float]) -> StepTotals:
    return StepTotals(**{field: (float(v) if field.endswith("seconds") else int(v)) for field, v in values.items()})


def pool_steps(before: dict[NodeKey, StepTotals], after: dict[NodeKey, StepTotals]) -> dict[str, StepTotals]:
    """The steps each kind of node ran between two readings, summed over the nodes in both. A node
    missing from either says nothing of the window: the router exports live nodes only, so one
    missing from the first may have been late with a heartbeat, and its counts since it started
    are not the window's. One whose counts went back restarted, and says nothing either."""
    pools: dict[str, StepTotals] = {}
    for key, now in after.items():
        delta = now.since(before[key]) if key in before else None
        if delta is not None:
            kind = key[1]
            pools[kind] = pools.get(kind, StepTotals()).plus(delta)
    return pools


@dataclass(frozen=True)
class StepSpeed:
    steps: int
    predicted_s: float  # what the profile gives the same steps
    seconds: float  # on the clock
    cpu_seconds: float  # in the stepping thread's CPU

    comparable: bool = True  # False: a tensor-parallel node's, whose CPU says nothing of its time

    @classmethod
    def of(cls, steps: StepTotals, cost: StepCost, tensor_parallel_size: int = 1) -> StepSpeed:
        """A tensor-parallel node's stepping thread sleeps in its ranks' collectives, time its CPU
        leaves out: its speed is reported, never applied. A node of several threads is compared
        as it is: its stepping thread spins at the threads' barriers, so a step held up by a
        descheduled thread counts, a slowdown the simulator does not model otherwise."""
        return cls(steps.steps, cost.total(steps), steps.seconds, steps.cpu_seconds, tensor_parallel_size == 1)

    @property
    def known(self) -> bool:
        """Enough steps to say anything (`MIN_PREDICTED_S`), CPU comparable with the profile's time."""
        return self.comparable and self.predicted_s >= MIN_PREDICTED_S and self.cpu_seconds > 0

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_seconds / self.predicted_s if self.predicted_s > 0 else 1.0

    @property
    def clock_ratio(self) -> float:
        return self.seconds / self.predicted_s if self.predicted_s > 0 else 1.0

    def plus(self, other: StepSpeed) -> StepSpeed:
        return StepSpeed(self.steps + other.steps, self.predicted_s + other.predicted_s, self.seconds + other.seconds,
                         self.cpu_seconds + other.cpu_seconds, self.comparable and other.comparable)

    def record(self) -> dict:
        return {"steps": self.steps, "predicted_s": self.predicted_s, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds, "cpu_ratio": self.cpu_ratio if self.known else None,
                "clock_ratio": self.clock_ratio if self.known else None}

    def describe(self) -> str:
        if not self.comparable:
            return f"{self.steps} steps on tensor-parallel ranks, whose CPU cannot tell their speed"
        if not self.known:
            return f"{self.steps} steps, too few to tell their speed"
        return (f"{self.steps} steps ran {self.cpu_ratio:.2f}× the profile's time in CPU, "
                f"{self.clock_ratio:.2f}× on the clock")


def pool_speeds(before: str, after: str, cost: StepCost) -> dict[str, StepSpeed]:
    """Each kind of node's step speed between two /metrics texts of the router."""
    return {kind: StepSpeed.of(steps, cost)
            for kind, steps in pool_steps(parse_node_steps(before), parse_node_steps(after)).items()}


def step_scales(speeds: dict[str, StepSpeed]) -> dict[str, float]:
    """How much longer than profiled each kind's steps take, where enough ran to tell: what a
    simulation stretches them by (`ClusterSpec.with_step_scales`)."""
    return {kind: speed.cpu_ratio for kind, speed in speeds.items() if speed.known}


def describe_speeds(speeds: dict[str, StepSpeed]) -> str:
    return "; ".join(f"{kind}: {speed.describe()}" for kind, speed in sorted(speeds.items())) or "no steps"


def summed(rounds: list[dict]) -> dict:
    """Each kind's figures (a `StepSpeed`, or a `StackSpeed`) over several windows (a validation's
    rounds), as one."""
    total: dict = {}
    for speeds in rounds:
        for kind, speed in speeds.items():
            total[kind] = total[kind].plus(speed) if kind in total else speed
    return total


def short_text(speeds: dict[str, StepSpeed]) -> str:
    """"P 1.21 D 1.05": each kind's CPU ratio by its initial; "-" where too few steps ran."""
    known = [f"{kind[0].upper()} {speed.cpu_ratio:.2f}" for kind, speed in sorted(speeds.items(), key=_pool_order)
             if speed.known]
    return " ".join(known) or "-"


POOLS = ("colocated", "prefill", "decode")  # the kinds of node, in the order reports name them


def _pool_order(item: tuple[str, StepSpeed]) -> int:
    return POOLS.index(item[0]) if item[0] in POOLS else len(POOLS)
