"""Which node probably holds a prompt's leading blocks in its prefix cache, as this router last
sent them: the chained block hashes of every prompt it placed (`hash_block_tokens`, the
nodes' block size — the keys every node's prefix cache uses), each mapped to the node that got
it last (LRU, at most `max_entries`).

A sample that ends adds the blocks of what its node generated (`remember_generated`): a node
caches the tokens it decodes as it caches a prompt's, so a conversation's next turn, which
carries the answer, finds the node holding it even where the prompts share a prefix that was
last sent elsewhere (a common system prompt).

A placement asks it two things: which candidate holds the longest known prefix of a prompt
(`holder`: that node wins while its queue is within `slack_tokens` of the shortest, since it
serves those blocks from its cache instead of computing them), and how many of a prompt's
tokens a given node probably has (`cached_tokens`: the hybrid rule weighs only the uncached
suffix a decode node would compute). It is a forecast: a node may have evicted the blocks since.

Pure: never calls a node or reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pdserve.engine.block_pool import BlockHash, hash_block_tokens

if TYPE_CHECKING:
    from pdserve.router.cluster.placement import Candidate
    from pdserve.router.config import RouterConfig


def prefix_hashes(token_ids: Sequence[int], block_size: int,
                  known: Sequence[BlockHash] = ()) -> tuple[BlockHash, ...]:
    """Chained hashes of the full blocks of `token_ids`, as every node's prefix cache keys them;
    `known`: those of its leading blocks, already hashed (only the blocks after them are)."""
    hashes: list[BlockHash] = list(known)
    parent: BlockHash | None = known[-1] if known else None
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return tuple(hashes)


class PrefixAffinity:
    def __init__(self, block_size: int, slack_tokens: int, max_entries: int) -> None:
        self.block_size = block_size
        self._slack = slack_tokens
        self._max_entries = max_entries
        self._node_of: OrderedDict[BlockHash, str] = OrderedDict()  # leading-block hash -> node

    @classmethod
    def for_router(cls, config: RouterConfig) -> PrefixAffinity:
        return cls(config.block_size, config.affinity_slack_tokens, config.max_affinity_entries)

    def hashes(self, token_ids: Sequence[int], known: Sequence[BlockHash] = ()) -> tuple[BlockHash, ...]:
        return prefix_hashes(token_ids, self.block_size, known)

    def holder(self, candidates: Sequence[Candidate], hashes: Sequence[BlockHash],
               load: Callable[[Candidate], int]) -> Candidate | None:
        """The candidate that last got the longest known prefix of `hashes`, if its `load` is
        within the slack of the least loaded candidate's; None otherwise."""
        if not candidates:
            return None
        by_id = {c.node_id: c for c in candidates}
        for block_hash in reversed(hashes):  # the longest known prefix first
            node = by_id.get(self._node_of.get(block_hash))
            if node is not None:
                least = min(load(c) for c in candidates)
                return node if load(node) <= least + self._slack else None
        return None

    def cached_tokens(self, node_id: str, hashes: Sequence[BlockHash]) -> int:
        """Tokens of the longest prefix of `hashes` this router last sent to `node_id`."""
        for length in range(len(hashes), 0, -1):
            if self._node_of.get(hashes[length - 1]) == node_id:
                return length * self.block_size
        return 0

    def remember_generated(self, node_id: str, prefix: Sequence[BlockHash], token_ids: Sequence[int]) -> None:
        """A sample ended on `node_id`, whose KV now holds `token_ids` (its prompt, then every
        output token but the last, which no step computed); `prefix`: the hashes of its leading
        blocks remembered when it was placed."""
        self.remember(node_id, self.hashes(token_ids, prefix)[len(prefix):])

    def remember(self, node_id: str, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self._node_of[block_hash] = node_id
            self._node_of.move_to_end(block_hash)
        while len(self._node_of) > self._max_entries:
            self._node_of.popitem(last=False)
