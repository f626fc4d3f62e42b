"""Placement policies: which decode node holds a request, which prefill node computes it.

Pure objects over `Candidate` snapshots (built by the registry from each node's last
stats); they never call a node, never sleep and never read a clock they were not
given, so every decision is unit-testable.

- Decode: most free KV blocks after this router's own outstanding reservations (what it
  asked of the node that the node's last stats do not show yet), skipping a node that just
  refused for lack of blocks until its next stats (or a cooldown).
- Prefill: fewest queued prefill tokens (last stats + what this router sent since),
  except that the node which last got the prompt's longest known prefix wins while its
  queue is within a slack of the shortest — it will serve those blocks from its prefix
  cache (pdserve/router/cluster/prefix_affinity.py).
- Colocated (and decode nodes that prefill): fewest queued tokens (last stats + prompts
  this router sent since that have not reached token 1), then most free blocks after this
  router's reservations, with the prefill rule's prefix affinity (pdserve/router/cluster/prefix_affinity.py);
  a node that just refused is skipped as for decode.

What this router sent that a node's stats do not show yet is known exactly: every request it
sends carries a placement stamp (`PlacementStamps`), and a node's stats name the highest stamp
its engine core had taken in when it took them (`Candidate.placed_through`). Stats that merely
arrived later are not enough: a heartbeat carries the core's last snapshot, which can predate a
request the router placed a moment before it — counted as shown, that request vanished from the
router's view until the next heartbeat, and the next request went to the same node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockHash
from pdserve.router.cluster.prefix_affinity import PrefixAffinity


@dataclass(frozen=True, slots=True)
class Candidate:
    """One live node as placement sees it. `stats_seq` changes whenever new stats arrive."""

    node_id: str
    stats_seq: int
    free_blocks: int  # num_blocks - used_blocks (reserved blocks are counted as used)
    queued_prefill_tokens: int
    # The highest placement stamp these stats show (NodeStats.placed_through). None: stats that
    # show everything sent before they came (the simulator's, taken at each decision).
    placed_through: int | None = None


class PlacementStamps:
    """The stamps a router puts on what it sends: increasing, and from a router started again
    too (at least the wall clock's nanoseconds), so what a node recorded from an earlier run
    never covers a new stamp."""

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, self._clock())
        return self._last


# Stats updates after which an amount no longer counts though no stats showed its stamp: a
# request no core ever took in and nothing withdrew (a node started again under the same id)
# must not weigh on the node for good. 20 heartbeats: 10 s at the default interval.
MAX_UPDATES_UNSHOWN = 20


@dataclass(slots=True)
class _Sent:
    stats_seq: int  # the node's stats when it was sent
    amount: int


class _SinceStats:
    """Per-node amounts this router sent, by stamp, that the node's stats do not show yet."""

    def __init__(self) -> None:
        self._by_node: dict[str, dict[int, _Sent]] = {}

    def get(self, c: Candidate) -> int:
        sent = self._by_node.get(c.node_id)
        if not sent:
            return 0
        for stamp in [stamp for stamp, s in sent.items() if _shown(c, stamp, s)]:
            del sent[stamp]
        return sum(s.amount for s in sent.values())

    def add(self, c: Candidate, stamp: int, amount: int) -> None:
        """`amount` more under `stamp` (negative: given back; an amount the stats show is gone already)."""
        sent = self._by_node.setdefault(c.node_id, {})
        entry = sent.get(stamp)
        if entry is None:
            if amount <= 0:
                return
            entry = sent[stamp] = _Sent(c.stats_seq, 0)
        entry.amount += amount
        if entry.amount <= 0:
            del sent[stamp]

    def forget(self, node_ids: set[str]) -> None:
        for node_id in set(self._by_node) - node_ids:
            del self._by_node[node_id]


def _shown(c: Candidate, stamp: int, sent: _Sent) -> bool:
    if c.placed_through is None:
        return c.stats_seq != sent.stats_seq
    return stamp <= c.placed_through or c.stats_seq - sent.stats_seq > MAX_UPDATES_UNSHOWN


class DecodePlacement:
    def __init__(self, exhausted_cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._cooldown_s = exhausted_cooldown_s
        self._clock = clock
        self._reserved = _SinceStats()
        self._exhausted: dict[str, tuple[int, float]] = {}  # node_id -> (stats_seq, when)

    def free_after_reservations(self, c: Candidate) -> int:
        return c.free_blocks - self._reserved.get(c)

    def rank(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Nodes to ask, best first; nodes that just refused are left out."""
        self._reserved.forget({c.node_id for c in candidates})
        usable = [c for c in candidates if not self._recently_exhausted(c)]
        return sorted(usable, key=lambda c: (-self.free_after_reservations(c), c.node_id))

    def reserve(self, c: Candidate, stamp: int, num_blocks: int) -> None:
        """This router asked `c` to hold `num_blocks` more, in the request stamped `stamp`
        (negative: it gave them back)."""
        self._reserved.add(c, stamp, num_blocks)

    def mark_exhausted(self, c: Candidate) -> None:
        self._exhausted[c.node_id] = (c.stats_seq, self._clock())

    def _recently_exhausted(self, c: Candidate) -> bool:
        mark = self._exhausted.get(c.node_id)
        if mark is None:
            return False
        seq, when = mark
        if seq != c.stats_seq or self._clock() - when >= self._cooldown_s:
            del self._exhausted[c.node_id]
            return False
        return True


class PrefillPlacement:
    def __init__(self, block_size: int, affinity_slack_tokens: int, max_affinity_entries: int) -> None:
        self.affinity = PrefixAffinity(block_size, affinity_slack_tokens, max_affinity_entries)
        self._sent = _SinceStats()

    @property
    def block_size(self) -> int:
        return self.affinity.block_size

    def prefix_hashes(self, prompt_token_ids: Sequence[int]) -> tuple[BlockHash, ...]:
        return self.affinity.hashes(prompt_token_ids)

    def load(self, c: Candidate) -> int:
        return c.queued_prefill_tokens + self._sent.get(c)

    def choose(self, candidates: Sequence[Candidate], prompt_token_ids: Sequence[int], stamp: int) -> Candidate:
        """Pick the node for this prompt and count the prompt, sent stamped `stamp`, against its queue."""
        if not candidates:
            raise ValueError("choose needs at least one candidate")
        self._sent.forget({c.node_id for c in candidates})
        hashes = self.prefix_hashes(prompt_token_ids)
        chosen = (self.affinity.holder(candidates, hashes, self.load)
                  or min(candidates, key=lambda c: (self.load(c), c.node_id)))
        self.affinity.remember(chosen.node_id, hashes)
        self._sent.add(chosen, stamp, len(prompt_token_ids))
        return chosen

    def finished(self, c: Candidate, stamp: int, num_tokens: int) -> None:
        """A prompt sent to `c` is done; it no longer counts against c's queue."""
        self._sent.add(c, stamp, -num_tokens)


class ColocatedPlacement:
    """A colocated node computes prompts and holds KV, so both of decode's and prefill's loads count.

    The queue of prompt tokens decides first (it is what a new prompt waits behind);
    free blocks break ties; the node that last got the prompt's longest known prefix goes
    first while its queue is within the affinity's slack (it computes only the rest).
    Refusals are remembered exactly as for decode nodes.
    """

    def __init__(self, exhausted_cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 blocks: DecodePlacement | None = None, affinity: PrefixAffinity | None = None) -> None:
        # `blocks`: the decode pool's, for decode nodes that also prefill (both routes reserve there).
        self._blocks = blocks or DecodePlacement(exhausted_cooldown_s, clock)
        # None: no prefix affinity (every prompt placed by load alone).
        self.affinity = affinity
        self._sent = _SinceStats()

    def load(self, c: Candidate) -> int:
        return c.queued_prefill_tokens + self._sent.get(c)

    def rank(self, candidates: Sequence[Candidate], hashes: Sequence[BlockHash] = ()) -> list[Candidate]:
        """Nodes to ask, best first; nodes that just refused are left out. `hashes`: the prompt's
        leading blocks (`PrefixAffinity.hashes`)."""
        self._sent.forget({c.node_id for c in candidates})
        usable = self._blocks.rank(candidates)
        ranked = sorted(usable, key=lambda c: (self.load(c), -self._blocks.free_after_reservations(c), c.node_id))
        holder = self.affinity.holder(ranked, hashes, self.load) if self.affinity and hashes else None
        return ranked if holder is None else [holder, *(c for c in ranked if c is not holder)]

    def cached_tokens(self, c: Candidate, hashes: Sequence[BlockHash]) -> int:
        """Tokens of the prompt `c` probably holds in its prefix cache (0 without an affinity)."""
        return self.affinity.cached_tokens(c.node_id, hashes) if self.affinity else 0

    def assign(self, c: Candidate, stamp: int, num_tokens: int, num_blocks: int,
               hashes: Sequence[BlockHash] = ()) -> None:
        """This router sent `c` a request stamped `stamp`: `num_tokens` to prefill, `num_blocks`
        to hold, the prompt's leading blocks `hashes` (which `c` will hold from now on)."""
        self._sent.add(c, stamp, num_tokens)
        self._blocks.reserve(c, stamp, num_blocks)
        if self.affinity is not None:
            self.affinity.remember(c.node_id, hashes)

    def prefilled(self, c: Candidate, stamp: int, num_tokens: int) -> None:
        """The request's first token arrived: its prompt no longer counts against c's queue."""
        self._sent.add(c, stamp, -num_tokens)

    def withdraw(self, c: Candidate, stamp: int, num_tokens: int, num_blocks: int) -> None:
        """The request never started on `c` (refused, failed): take back what `assign` counted."""
        self._sent.add(c, stamp, -num_tokens)
        self._blocks.reserve(c, stamp, -num_blocks)

    def mark_exhausted(self, c: Candidate) -> None:
        self._blocks.mark_exhausted(c)
