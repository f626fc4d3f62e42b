"""Fault drills: a node slowed or poisoned on purpose, so a drill's kill, deadline or failure
lands mid-request.

`--debug-step-delay-s S` makes every engine step of the node take at least S longer.
`--debug-poison-token-id T` makes a step that computes a prompt holding token T fail the way a
model bug on some input would: an exception inside the model runner (`--debug-poison-action
raise`), or the engine core's process ending at once (`exit`, a crash in native code). Each is
applied once, when the core builds its engine (after its first steps), by wrapping a method of
that engine: the core's step loop has no branch for them, and a node without the flags runs the
engine as is.

Must never: be on by default, or change what a step computes when it does not fail.
"""

from __future__ import annotations

import os
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


POISON_EXIT_STATUS = 70  # EX_SOFTWARE: what a crashed engine core exits with in the drill


def poison_token(engine: EngineCore, token_id: int | None, action: str) -> None:
    """Make a step fail when it computes a prompt holding `token_id` (nothing when it is None)."""
    if token_id is None:
        return
    execute = engine.runner.execute

    def poisoned_execute(out):
        if any(token_id in s.request.prompt_token_ids for s in out.scheduled):
            if action == "exit":
                os._exit(POISON_EXIT_STATUS)
            raise RuntimeError(f"poisoned token {token_id} (--debug-poison-token-id)")
        return execute(out)

    engine.runner.execute = poisoned_execute
