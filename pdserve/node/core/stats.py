"""A node's load, as the core sees it: the NodeStats snapshot and the queue bounds.

`build_stats` takes one snapshot of an engine core and its KV transport (the core
answers queries with it and pushes it to the front unasked, pdserve/node/core/core_loop.py).
`QueueBounds` is what a core admits new requests against: a request that would make
the waiting queue longer than `max_waiting_requests`, or the prompt tokens still to
compute more than `max_queued_tokens`, is refused RESOURCE_EXHAUSTED at once — the
router then tries another node or tells the client — rather than queued behind work
that would push it past any deadline.

Runs in the core process (it reads the engine's live objects); the front only relays
the `StatsData` it gets. Must never: change engine state.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.engine_core import EngineCore
from pdserve.kv_transfer.counters import sum_stats
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.messages import StatsData

if TYPE_CHECKING:
    from pdserve.ranks.kv_ranks import RankedTransport


def queued_tokens(engine: EngineCore) -> int:
    """Tokens the scheduler has yet to compute (waiting and running requests)."""
    scheduler = engine.scheduler
    return sum(r.num_tokens - r.num_computed_tokens for r in (*scheduler.waiting, *scheduler.running))


def build_stats(kind: str, engine: EngineCore, transport: RankedTransport | None,
                num_blocks_outside_scheduler: int) -> StatsData:
    """A prefill node counts what it sent, a decode node what it received, a node without a
    transport (colocated) nothing; and every node what it sent (`kv_transfer_sent`: a decode node
    with --serve-prefill exports too). Queued prefill tokens are the prompt tokens a new prompt waits
    behind (none on a decode node, unless it computes prompts of its own: `--local-prefill`). Blocks held
    outside the scheduler (a decode node's reservations, a prefill node's blocks awaiting
    push acknowledgements) are reported as `reserved_blocks`; blocks are counted once per node (rank 0's
    block pool is every rank's), transfers per rank and in sum."""
    scheduler = engine.scheduler
    sent = [] if transport is None else transport.rank_stats()
    ranks = sent if kind == "prefill" or transport is None else transport.rank_recv_stats()
    pool = engine.kv.pool
    return StatsData(
        kind=kind,
        num_blocks=pool.num_blocks,
        used_blocks=pool.num_used_blocks,
        reserved_blocks=num_blocks_outside_scheduler,
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        queued_prefill_tokens=scheduler.queued_prompt_tokens(),
        kv_transfer=sum_stats(ranks),
        prefix_cache_queries=pool.stats.queries,
        prefix_cache_hits=pool.stats.hits,
        tensor_parallel_size=engine.loaded.shard.size,
        kv_transfer_ranks=ranks,
        num_swapped=len(scheduler.swapped),
        swap_blocks=engine.swap.num_blocks,
        used_swap_blocks=engine.swap.num_used_blocks,
        swaps_out=scheduler.num_swaps_out,
        swaps_in=scheduler.num_swaps_in,
        preemptions=scheduler.num_preemptions,
        forked_samples=engine.num_forked_samples,
        failed_requests=engine.num_failed_requests,
        kv_transfer_sent=sum_stats(sent),
        steps=dataclasses.replace(engine.step_totals),
    )


@dataclass(frozen=True)
class QueueBounds:
    max_waiting_requests: int
    max_queued_tokens: int

    def check(self, num_waiting: int, num_queued_tokens: int, new_tokens: int) -> None:
        """Raise RESOURCE_EXHAUSTED if one more request of `new_tokens` would pass a bound.

        A prompt longer than the whole token bound is admitted when nothing is queued,
        so it waits for an idle node instead of being refused forever.
        """
        if num_waiting >= self.max_waiting_requests:
            raise NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"queue full: {num_waiting} requests waiting "
                                                          f"(limit {self.max_waiting_requests})")
        if num_queued_tokens > 0 and num_queued_tokens + new_tokens > self.max_queued_tokens:
            raise NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"queue full: {num_queued_tokens} tokens to compute, "
                                                          f"this request adds {new_tokens} "
                                                          f"(limit {self.max_queued_tokens})")


UNBOUNDED = QueueBounds(sys.maxsize, sys.maxsize)  # admits everything the engine itself accepts
