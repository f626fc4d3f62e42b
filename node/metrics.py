"""A node's Prometheus `/metrics`: its engine core's latest stats, whatever the node's kind.

Owns the collector that turns the core's latest `StatsData` into `pdserve_*` series at
scrape time, and the endpoint serving them (`serve_node_metrics`). The shared node front
(node/server.py) starts it, so every node kind has it. The snapshot is the one the core
pushes to the front unasked (`CoreClient.latest_stats`, at most every
`stats_push_interval_s`), so a scrape never queries the core.

Scrapes run on the HTTP server's thread, the front on its event loop. Reading the
latest snapshot is one reference read of an object the loop replaces whole and never
mutates, so it is safe from that thread. Must never: await or call into the
`CoreClient`'s asyncio side from the scrape thread, or count anything itself (counters
are the core's cumulative totals, exported as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.metrics_endpoint import MetricsEndpoint
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.messages import StatsData

LatestStats = Callable[[], StatsData | None]


def _hit_rate(stats: StatsData) -> float:
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0


# (name, help, value of a StatsData)
_GAUGES = (
    ("pdserve_num_requests_waiting", "Requests waiting in the scheduler", lambda s: s.num_waiting),
    ("pdserve_num_requests_running", "Requests running in the scheduler", lambda s: s.num_running),
    ("pdserve_kv_cache_blocks_used", "KV cache blocks in use", lambda s: s.used_blocks),
    ("pdserve_kv_cache_blocks_free", "KV cache blocks free", lambda s: max(0, s.num_blocks - s.used_blocks)),
    ("pdserve_kv_cache_blocks_reserved", "Decode blocks reserved for KV still in transfer",
     lambda s: s.reserved_blocks),
    ("pdserve_queued_prefill_tokens", "Prompt tokens yet to prefill", lambda s: s.queued_prefill_tokens),
    ("pdserve_prefix_cache_hit_rate", "Prefix cache hits over queries since start", _hit_rate),
)
# Names without the `_total` the exposition adds. A prefill node counts what it sent,
# a decode node what it received.
_COUNTERS = (
    ("pdserve_prefix_cache_queries", "Prefix cache lookups", lambda s: s.prefix_cache_queries),
    ("pdserve_prefix_cache_hits", "Prefix cache lookups that hit", lambda s: s.prefix_cache_hits),
    ("pdserve_kv_transfer_bytes", "KV bytes transferred", lambda s: s.kv_transfer.bytes),
    ("pdserve_kv_transfer_blocks", "KV blocks transferred", lambda s: s.kv_transfer.blocks),
    ("pdserve_kv_transfers", "KV transfers completed", lambda s: s.kv_transfer.transfers),
    ("pdserve_kv_transfer_failures", "KV transfers failed", lambda s: s.kv_transfer.failures),
    ("pdserve_kv_transfer_seconds", "Sum of completed KV transfers' latency", lambda s: s.kv_transfer.latency_s),
)


class NodeStatsCollector(Collector):
    """Every node series from the latest snapshot; none at all before the first one."""

    def __init__(self, latest_stats: LatestStats) -> None:
        self._latest_stats = latest_stats

    def describe(self) -> Iterator[Metric]:
        for name, help_text, _ in _GAUGES:
            yield GaugeMetricFamily(name, help_text)
        for name, help_text, _ in _COUNTERS:
            yield CounterMetricFamily(name, help_text)

    def collect(self) -> Iterator[Metric]:
        stats = self._latest_stats()
        if stats is None:
            return
        for name, help_text, value_of in _GAUGES:
            yield GaugeMetricFamily(name, help_text, value=value_of(stats))
        for name, help_text, value_of in _COUNTERS:
            yield CounterMetricFamily(name, help_text, value=value_of(stats))


def serve_node_metrics(host: str, port: int, latest_stats: LatestStats) -> MetricsEndpoint:
    """Serve the node's series on http://host:port/metrics (0: the OS picks; see `.url`)."""
    registry = CollectorRegistry()
    registry.register(NodeStatsCollector(latest_stats))
    try:
        return MetricsEndpoint.start(host, port, registry)
    except OSError as exc:
        raise NodeError(ErrorCode.UNAVAILABLE, f"cannot serve metrics on {host}:{port}: {exc}") from exc
