"""The prefill-only scheduling policy.

A request ends at its first sampled token, and its blocks are not freed then: they
are handed to the KV exporter (through `drain_released`), which frees them once every
push reading them has finished. Must never: free a block itself.
"""

from __future__ import annotations

from pdserve.engine.block_pool import KVBlock
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.policy import SchedulingPolicy
from pdserve.engine.request import Request


class PrefillPolicy(SchedulingPolicy):
    name = "prefill"

    def __init__(self) -> None:
        self._released: list[tuple[Request, list[KVBlock]]] = []

    def finishes_after_first_token(self) -> bool:
        return True

    def release_blocks(self, request: Request, kv: KVCacheManager) -> None:
        """Detach the blocks (still referenced) and queue them for the exporter."""
        self._released.append((request, kv.take_blocks(request)))

    def drain_released(self) -> list[tuple[Request, list[KVBlock]]]:
        """Requests that ended since the last call, with the blocks they held, in order."""
        released, self._released = self._released, []
        return released
