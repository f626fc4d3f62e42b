"""Scheduling policies: what differs between the engines of a colocated, a prefill and a decode node.

The loop is the same everywhere (running requests first, then waiting ones, inside one
token budget; schedule → run → update). A policy answers the few questions where node
kinds differ, so adding a node kind never adds an `if` to the loop. Today there is one:
does a request leave this engine once it has sampled its first token? (The default for each
request: `EngineCore.add_request(hands_off=...)` overrides it, as a decode node that also prefills
for others does for the prompts it exports.)

Must never: import torch or hold request state (a node's front names its kind's policy
class without loading the engine).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class SchedulingPolicy(ABC):
    """The seam between the engine core's loop and a node kind."""

    @abstractmethod
    def hands_off_after_first_token(self) -> bool:
        """Does a request leave this engine at its first sampled token, its KV still held?

        Yes on a prefill node: the engine hands the request off (`EngineCoreOutput.handoff`
        carries its blocks, still referenced) instead of finishing it, and whoever takes
        them frees them once the KV has moved on.
        """


class ColocatedPolicy(SchedulingPolicy):
    """Both phases here: Sarathi-style stall-free batching until each request stops.

    Running requests (decodes and unfinished prefill chunks) are scheduled first, then
    waiting prompts fill the rest of the token budget in chunks, so a long prompt never
    stalls the running decodes. A decode node runs it too: its requests join the
    scheduler prefilled, with token 1, so the same rules only decode them.
    """

    def hands_off_after_first_token(self) -> bool:
        return False
