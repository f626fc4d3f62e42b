"""Scheduling policies: what differs between a colocated, a prefill and a decode node.

The scheduler's loop is the same everywhere (running requests first, then waiting
ones, inside one token budget). A policy answers the few questions where node kinds
differ, so adding a node kind never adds an `if` to the loop.
"""

from __future__ import annotations

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request


class SchedulingPolicy:
    """Colocated serving: Sarathi-style stall-free batching.

    Running requests (decodes and unfinished prefill chunks) are scheduled first, then
    waiting prompts fill the rest of the token budget in chunks, so a long prompt never
    stalls the running decodes.
    """

    name = "colocated"

    def finishes_after_first_token(self) -> bool:
        """Does a request end once its first token is sampled? (prefill-only: yes)"""
        return False

    def release_blocks(self, request: Request, kv: KVCacheManager) -> None:
        """A request ended. Free its blocks (prefill-only: hold them until they are sent)."""
        kv.free(request)


ColocatedPolicy = SchedulingPolicy
