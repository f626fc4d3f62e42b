"""Fault drills: a node slowed on purpose, so a drill's kill or deadline lands mid-request.

`--debug-step-delay-s S` makes every engine step of the node take at least S longer. It
is applied once, when the core builds its engine, by wrapping that engine's `step`: the
core's step loop has no branch for it, and a node without the flag runs the engine as is.

Must never: be on by default, or change what a step computes.
"""

from __future__ import annotations

import time

from pdserve.engine.engine_core import EngineCore


def slow_every_step(engine: EngineCore, delay_s: float) -> None:
    """Make `engine.step` sleep `delay_s` after each step (nothing when `delay_s` is 0)."""
    if delay_s <= 0:
        return
    step = engine.step

    def slowed_step():
        outputs = step()
        time.sleep(delay_s)
        return outputs

    engine.step = slowed_step
