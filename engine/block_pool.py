"""The pool of KV cache blocks: reference counts, the free LRU queue and the prefix cache.

A block is free when no request references it. Free blocks wait in LRU order; a free
block that still holds a cached prefix keeps its hash until it is handed out again
(lazy eviction), so a later request with the same prefix can take it back. This
module never decides *which* request gets blocks; the KV cache manager does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes

# Shared by every node so that the same prefix hashes the same everywhere.
_HASH_SEED = b"pdserve-prefix-v1"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: it names the block's tokens and every token before."""
    h = hashlib.sha256(parent_hash or _HASH_SEED)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # blocks looked up
    hits: int = 0  # blocks found

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is handed out next.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[KVBlock]:
        """The longest run of cached blocks for these leading hashes (no refs taken)."""
        found: list[KVBlock] = []
        if not self.enable_caching:
            return found
        for block_hash in block_hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def record_lookup(self, num_queried: int, num_found: int) -> None:
        """Count one admitted request's lookup (a request that waits is looked up again
        each step; only the lookup that admits it counts)."""
        self.stats.queries += num_queried
        self.stats.hits += num_found

    def allocate(self, num: int) -> list[KVBlock] | None:
        """Take `num` free blocks (LRU first), evicting any prefix they cached; None if short."""
        if num > len(self._free):
            return None
        taken = []
        for _ in range(num):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference; blocks that reach zero join the end of the free queue."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
