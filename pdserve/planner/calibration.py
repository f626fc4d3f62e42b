"""`pdserve plan --calibrate`: the profile's inputs corrected by what earlier validations measured of them.

A validation reads, besides its error, how fast each pool's steps ran against the profile
(pdserve/planner/step_speed.py) and how much CPU the router, the node fronts and the client took
against the profile's costs (pdserve/planner/stack_use.py), and the track record keeps both with
each validated candidate (pdserve/planner/track_record.py). `Calibration.of` takes the median of
each over the record of this model and machine: a step speed per kind of pool and node setup
("colocated 1x1": colocated nodes of one core, no tensor parallelism), a ratio per kind of stack
process. With `--calibrate` the plan predicts every candidate with its pools' steps and its stack
scaled by them; a pool setup no validation ran keeps the profile's steps, and so do the hybrid
candidates' prompt budgets (`--local-prefill-tokens-per-s`, sized from the profile alone). Only
scales measured against what the plan predicts with count (`current_inputs`: the digest of each
setup's step model and of the stack's costs): a profile measured again starts the record afresh.

Why the inputs and not the errors: an error mixes the profile's drift with the simulator's own
mistakes, and correcting predictions by it would hide the second. A step speed or a stack ratio
is a direct measurement of one input the simulator takes as given, so the calibrated prediction
still shows the simulator's own error when it is validated (measured on the 2-core AVX2 machine,
docs/benchmarks.md: steps ran 1.14–1.68× their profile beside the serving stack, the stack took
1.2–1.5× its profiled CPU, and the same predictions made at those inputs erred by 14% where the
profile's erred by 39%).

Must never: measure anything, or calibrate without saying so (the plan prints what it applied).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.planner.profile import Profile, ServingCosts
from pdserve.planner.search import Layout
from pdserve.planner.stack_use import STACK_ROLES, scaled_costs
from pdserve.planner.step_speed import POOLS
from pdserve.planner.track_record import Checked



def _medians(by_candidate: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for scales in by_candidate for k in scales})
    return {k: statistics.median(s[k] for s in by_candidate if k in s) for k in keys}


def pool_key(kind: str, setup: tuple[int, int]) -> str:
    """"colocated 1x1": a kind of pool and its nodes' (cores, TP)."""
    cores, tp = setup
    return f"{kind} {cores}x{tp}"


def layout_pools(layout: Layout) -> list[str]:
    """The kinds of node a layout runs."""
    return [kind for kind in POOLS if getattr(layout, kind)]


@dataclass(frozen=True)
class Calibration:
    steps: dict[str, float]  # pool_key -> the median step speed measured
    stack: dict[str, float]  # router / fronts / client -> the median CPU ratio measured
    validations: int  # how many validations it rests on

    @classmethod
    def of(cls, checked: Sequence[Checked], current: dict[str, set[str]]) -> Calibration:
        """From the scales measured against what this plan predicts with (`current_inputs`): a
        profile measured again makes the speeds measured against the old one moot."""
        def still_true(c: Checked, scales: dict[str, float]) -> dict[str, float]:
            return {k: v for k, v in scales.items() if c.inputs.get(k) in current.get(k, ())}

        steps = [still_true(c, c.step_scales) for c in checked]
        stack = [still_true(c, c.stack_scales) for c in checked]
        used = {c.when for c, a, b in zip(checked, steps, stack) if a or b}
        return cls(_medians(steps), _medians(stack), len(used))

    def step_scales(self, layout: Layout) -> dict[str, float]:
        """Each of the layout's pools' step speed, where a validation measured its setup."""
        keys = {kind: pool_key(kind, layout.pool_setup(kind)) for kind in layout_pools(layout)}
        return {kind: self.steps[key] for kind, key in keys.items() if key in self.steps}

    @staticmethod
    def applied(calibration: Calibration | None, layout: Layout,
                costs: ServingCosts) -> tuple[ServingCosts, dict[str, float] | None]:
        """(the stack's costs, each pool's step scale) a candidate of `layout` is predicted with:
        as profiled without a calibration."""
        if calibration is None:
            return costs, None
        return scaled_costs(costs, calibration.stack), calibration.step_scales(layout)

    @property
    def empty(self) -> bool:
        return not (self.steps or self.stack)

    def to_json(self) -> dict:
        return {"step_speeds": self.steps, "stack_ratios": self.stack, "validations": self.validations}

    def text(self) -> str:
        if self.empty:
            return ("calibration: nothing to calibrate with yet (a `--validate` run records the step speeds and the "
                    "stack CPU it measures); predicting with the profile as measured")
        steps = ", ".join(f"{key} ×{s:.2f}" for key, s in self.steps.items()) or "none"
        stack = ", ".join(f"{role} ×{s:.2f}" for role, s in self.stack.items()) or "none"
        return (f"calibrated by {self.validations} past validation{'s' * (self.validations != 1)}: steps {steps}; "
                f"stack CPU {stack}")



def digest(measured: object) -> str:
    """Of a profile's step model or of the stack's costs: a ratio measured against one says nothing
    of another (a profile measured again, costs measured again)."""
    return hashlib.sha256(json.dumps(dataclasses.asdict(measured), sort_keys=True).encode()).hexdigest()[:16]


def current_inputs(profiles: dict[tuple[int, int], Profile], costs: dict[int, ServingCosts]) -> dict[str, set[str]]:
    """What this plan predicts with, as the record keys it: each kind of pool at each profiled setup
    -> its step model's digest; each stack process -> its costs' digests (one per stream interval)."""
    found: dict[str, set[str]] = {pool_key(kind, setup): {digest(p.step)} for setup, p in profiles.items()
                                  for kind in POOLS}
    for role in STACK_ROLES:
        found[role] = {digest(c) for c in costs.values()}
    return found
