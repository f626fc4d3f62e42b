"""The NodeStats builder: one snapshot of an engine core and its KV transport.

Runs in the core process (it reads the engine's live objects); the front only relays
the `StatsData` it gets back. Must never: change engine state.
"""

from __future__ import annotations

from pdserve.engine.engine_core import EngineCore
from pdserve.kv_transfer import KVTransport, TransferStats
from pdserve.node.messages import StatsData, TransferCounters


def build_stats(kind: str, engine: EngineCore, transport: KVTransport, reserved_blocks: int) -> StatsData:
    """A prefill node counts what it sent, a decode node what it received."""
    scheduler = engine.scheduler
    queued = sum(r.num_tokens - r.num_computed_tokens for r in (*scheduler.waiting, *scheduler.running))
    transfer = transport.stats() if kind == "prefill" else transport.recv_stats()
    pool = engine.kv.pool
    return StatsData(
        kind=kind,
        num_blocks=pool.num_blocks,
        used_blocks=pool.num_used_blocks,
        reserved_blocks=reserved_blocks,
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        queued_prefill_tokens=queued if kind == "prefill" else 0,
        kv_transfer=_counters(transfer),
        prefix_cache_queries=pool.stats.queries,
        prefix_cache_hits=pool.stats.hits,
    )


def _counters(stats: TransferStats) -> TransferCounters:
    return TransferCounters(bytes=stats.bytes, blocks=stats.blocks, transfers=stats.transfers,
                            failures=stats.failures, latency_s=stats.latency_s)
