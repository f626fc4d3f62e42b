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
from collections.abc import Iterable, Iterator, Sequence
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


class LazyBlocks:
    """The pool's blocks by id, each made on first use: a pool of a million blocks (a node's
    default KV budget on a tiny model, or every node of a simulated cluster) starts at once."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._made: dict[int, KVBlock] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> KVBlock:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._num_blocks:
                raise IndexError(f"block {block_id} is not in a pool of {self._num_blocks}")
            block = self._made[block_id] = KVBlock(block_id)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        return (self[i] for i in range(self._num_blocks))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = LazyBlocks(num_blocks)
        # Free blocks in eviction order, the first handed out next: the pool starts with every
        # block free in id order, so the never-used ids come first (from `_next_fresh` up, less
        # those taken out of turn), then the blocks freed after use, oldest first (`_free`).
        self._next_fresh = 0
        self._fresh_taken: set[int] = set()  # never-used ids above `_next_fresh` a touch took
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh - len(self._fresh_taken) + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def free_order(self) -> list[int]:
        """Free block ids in the order they are handed out (for tests that pin the order down)."""
        fresh = [i for i in range(self._next_fresh, self.num_blocks) if i not in self._fresh_taken]
        return fresh + list(self._free)

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
        if num > self.num_free_blocks:
            return None
        taken = []
        while len(taken) < num and self._next_fresh < self.num_blocks:
            block_id = self._next_fresh
            self._next_fresh += 1
            if block_id in self._fresh_taken:
                self._fresh_taken.discard(block_id)  # taken out of turn: it is in use, or in `_free`
                continue
            block = self.blocks[block_id]
            block.ref_count = 1
            taken.append(block)
        while len(taken) < num:
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_count == 0 and self._free.pop(block.block_id, None) is None:
                self._fresh_taken.add(block.block_id)  # never used yet: skipped when its turn comes
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
