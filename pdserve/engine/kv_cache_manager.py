"""Which blocks each request holds: allocation, prefix-cache hits, forks and release.

Answers "can't" with None rather than raising, so the scheduler can preempt or wait.
Block hashes of a request are computed once per full block and kept, so a long
prompt is hashed once however many steps it is scheduled over.

Forks (beam search, the n samples of one prompt) share their parent's blocks by reference
count. A block is copied only when a step is about to write into it while another request
still references it (copy-on-write): `allocate_slots` swaps in a fresh block and records the
(src, dst) pair, which the model runner copies before the step's forward writes anything.
This module never touches the KV tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from pdserve.engine.request import Request


@dataclass(slots=True)
class PrefixHit:
    blocks: list[KVBlock]
    num_tokens: int
    num_queried: int = 0  # blocks looked up (for the prefix-cache stats, counted on admission)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # (src, dst) block ids the next step must copy before it writes (copy-on-write).
        self._pending_copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0  # blocks copied on write since start

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """Cached leading blocks of a request that has computed nothing yet.

        Stops one token short of the request's tokens: the last token is always
        computed, because its logits give the next token.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request)[:max_blocks]
        blocks = self.pool.lookup(hashes)
        return PrefixHit(blocks, len(blocks) * self.block_size, len(hashes))

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       keep_free: int = 0) -> list[int] | None:
        """Hold enough blocks for `num_new_tokens` more tokens; the new block ids, or None when
        fewer than `keep_free` blocks would stay free after (the admission watermark)."""
        held = self._req_blocks.setdefault(request.req_id, [])
        hit_blocks = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        num_needed = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(hit_blocks)
        # Cached blocks sitting in the free queue stop being free once we take them.
        num_hits_free = sum(1 for b in hit_blocks if b.ref_count == 0)
        shared = self._shared_blocks_written(held, num_computed)
        if max(num_needed, 0) + len(shared) + num_hits_free + keep_free > self.pool.num_free_blocks:
            return None
        self._copy_on_write(held, shared)
        if hit is not None:
            self.pool.record_lookup(hit.num_queried, len(hit_blocks))
        self.pool.touch(hit_blocks)
        held.extend(hit_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        held.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` reference the parent's blocks holding its first `child.num_computed_tokens`
        tokens (a prefix of the parent's computed ones): no copy until one of them writes there."""
        if child.num_computed_tokens > parent.num_computed_tokens:
            raise ValueError(f"{child.req_id!r} forks {child.num_computed_tokens} computed tokens; its parent "
                             f"{parent.req_id!r} has {parent.num_computed_tokens}")
        blocks = self._req_blocks.get(parent.req_id, [])[: self.blocks_needed(child.num_computed_tokens)]
        self.pool.touch(blocks)
        self._req_blocks[child.req_id] = list(blocks)
        num_full = child.num_computed_tokens // self.block_size
        self._req_hashes[child.req_id] = self._req_hashes.get(parent.req_id, [])[:num_full]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies the step being scheduled must make before its forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _shared_blocks_written(self, held: list[KVBlock], num_computed: int) -> list[int]:
        """Indices in `held` of blocks the next tokens write into that another request references."""
        return [i for i in range(num_computed // self.block_size, len(held)) if held[i].ref_count > 1]

    def _copy_on_write(self, held: list[KVBlock], indices: list[int]) -> None:
        if not indices:
            return
        fresh = self.pool.allocate(len(indices))
        assert fresh is not None, "allocate_slots counted these blocks as free"
        for i, block in zip(indices, fresh):
            self._pending_copies.append((held[i].block_id, block.block_id))
            self.pool.free([held[i]])  # still referenced by the sharer: never reaches the free queue
            held[i] = block
        self.num_cow_copies += len(indices)

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose KV is now in the cache.

        Called once their content exists (computed by a step, or imported from a
        prefill node), never at allocation: a reserved block must not be found by
        another request before its bytes arrive.
        """
        if not self.pool.enable_caching:
            return
        held = self._req_blocks.get(request.req_id, [])
        hashes = self._block_hashes(request)
        for block, block_hash in zip(held[: request.num_computed_tokens // self.block_size], hashes):
            self.pool.cache(block, block_hash)

    def free(self, request: Request) -> None:
        """Release every block of the request; its tail blocks are evicted first."""
        self.pool.free(reversed(self.take_blocks(request)))

    def take_blocks(self, request: Request) -> list[KVBlock]:
        """Detach the request's blocks without freeing them; the caller frees them later
        with `pool.free` (a prefill node holds them until the decode node has the KV)."""
        self._req_hashes.pop(request.req_id, None)
        blocks = self._req_blocks.pop(request.req_id, [])
        if self._pending_copies:
            # A request preempted in the step that copied for it: nothing will read its copy.
            dropped = {b.block_id for b in blocks}
            self._pending_copies = [c for c in self._pending_copies if c[1] not in dropped]
        return blocks

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._req_hashes.setdefault(request.req_id, [])
        tokens, size = request.token_ids, self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))
        return hashes
