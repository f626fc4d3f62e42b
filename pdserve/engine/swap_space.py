"""The host swap space: which host blocks hold which swapped-out request's KV.

A preempted request under swap preemption (pdserve/engine/preemption.py) gives its device blocks
back at once and keeps its KV in host blocks until the scheduler swaps it back in:

    running ─swap_out─▶ swapped (host blocks held, no device block) ─swap_in─▶ running

`swap_out` copies every block that holds computed KV (the last one may be partial), shared
prefix-cache blocks included: the request keeps a private copy, and releases only its own
references on the device, so a block other requests still read stays where it is. `swap_in`
takes fresh device blocks (plus the ones this step's tokens need) and frees the host blocks.
Neither copies anything: they return the (source, destination) block pairs, which the scheduler
puts in the step's one ordered copy list (pdserve/engine/block_copies.py) that every rank makes before
the step's forward, so a device block freed by a swap-out is read before anything in the step
writes it.

Owns host block ids only; the host tensors live beside the device caches in each rank's
`RankForward`. Must never: choose victims, or decide swap versus recompute.
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.block_copies import BlockPairs
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request



def swap_blocks_for(swap_space_bytes: int, block_bytes: int) -> int:
    """Host blocks of `block_bytes` (one device block, every layer's K and V) the space holds."""
    return swap_space_bytes // block_bytes


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._req_blocks.get(req_id, ()))

    def can_hold(self, num_blocks: int) -> bool:
        return 0 < num_blocks <= len(self._free)

    def swap_out(self, request: Request, kv: KVCacheManager) -> BlockPairs:
        """Move the request's computed KV to host blocks and release its device blocks.
        The caller checked `can_hold(kv.blocks_needed(request.num_computed_tokens))`."""
        device = kv.take_blocks(request)
        num_computed_blocks = kv.blocks_needed(request.num_computed_tokens)
        host = [self._free.popleft() for _ in range(num_computed_blocks)]
        self._req_blocks[request.req_id] = host
        pairs = [(block.block_id, h) for block, h in zip(device, host)]
        assert len(pairs) == num_computed_blocks, f"{len(device)} device blocks for {num_computed_blocks} computed"
        # Tail first, as a recompute preemption frees them: the tail is reused first.
        kv.pool.free(reversed(device))
        return pairs

    def swap_in(self, request: Request, kv: KVCacheManager, num_new_tokens: int, keep_free: int) -> BlockPairs | None:
        """Device blocks for the request's swapped KV and `num_new_tokens` more; None (nothing
        changed) when fewer than `keep_free` blocks would stay free after."""
        host = self._req_blocks[request.req_id]
        if kv.allocate_slots(request, num_new_tokens, keep_free=keep_free) is None:
            return None
        device = kv.block_ids(request.req_id)
        del self._req_blocks[request.req_id]
        self._free.extend(host)
        return list(zip(host, device))

    def release(self, request: Request) -> None:
        """Free the host blocks of a swapped request that leaves (finished, aborted, detached)."""
        self._free.extend(self._req_blocks.pop(request.req_id, ()))
