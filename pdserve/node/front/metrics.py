"""A node's Prometheus `/metrics` and `/health`: its engine core's latest stats and whether it
serves, whatever the node's kind.

Owns the collector that turns the core's latest `StatsData` into `pdserve_*` series at
scrape time, `NodeHealth` (what `/health` answers: serving only while the node's gRPC
server serves and its engine core process runs), and the endpoint serving both
(`serve_node_metrics`). The shared node front (pdserve/node/front/server.py) starts it, so every node
kind has it. The snapshot is the one the core pushes to the front unasked
(`CoreClient.latest_stats`, at most every `stats_push_interval_s`), so a scrape never
queries the core.

Scrapes run on the HTTP server's thread, the front on its event loop. Reading the
latest snapshot (or the health's phase) is one reference read of an object the loop
replaces whole and never mutates, so it is safe from that thread. Must never: await or
call into the `CoreClient`'s asyncio side from the scrape thread, or count anything
itself (counters are the core's cumulative totals, exported as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.lifecycle import ServerPhase
from pdserve.common.metrics_endpoint import Health, HealthCheck, MetricsEndpoint
from pdserve.common.ports import Listen, unavailable
from pdserve.engine.step_shape import SERIES as STEP_SERIES
from pdserve.node.messages import StatsData

LatestStats = Callable[[], StatsData | None]
CoreAlive = Callable[[], bool]  # safe from any thread


def _kv_usage(stats: StatsData) -> float:
    return stats.used_blocks / stats.num_blocks if stats.num_blocks else 0.0


def _hit_rate(stats: StatsData) -> float:
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0


# (name, help, value of a StatsData)
_GAUGES = (
    ("pdserve_num_requests_waiting", "Requests waiting in the scheduler", lambda s: s.num_waiting),
    ("pdserve_num_requests_running", "Requests running in the scheduler", lambda s: s.num_running),
    ("pdserve_kv_cache_blocks_used", "KV cache blocks in use", lambda s: s.used_blocks),
    ("pdserve_kv_cache_blocks_free", "KV cache blocks free", lambda s: max(0, s.num_blocks - s.used_blocks)),
    # vLLM's kv_cache_usage_perc: comparable across nodes of any cache size (what an autoscaler reads).
    ("pdserve_kv_cache_usage_ratio", "Share of the KV cache blocks in use (0 to 1)", _kv_usage),
    ("pdserve_kv_cache_blocks_reserved", "Decode blocks reserved for KV still in transfer",
     lambda s: s.reserved_blocks),
    ("pdserve_queued_prefill_tokens", "Prompt tokens yet to prefill", lambda s: s.queued_prefill_tokens),
    ("pdserve_prefix_cache_hit_rate", "Prefix cache hits over queries since start", _hit_rate),
    ("pdserve_num_requests_swapped", "Preempted requests whose KV is in the swap space", lambda s: s.num_swapped),
    ("pdserve_swap_blocks_used", "Swap space blocks in use", lambda s: s.used_swap_blocks),
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
    ("pdserve_kv_checksum_failures", "KV pushes received whose bytes failed their checksum (refused)",
     lambda s: s.kv_transfer.checksum_failures),
    ("pdserve_kv_transfer_seconds", "Sum of completed KV transfers' latency", lambda s: s.kv_transfer.latency_s),
    ("pdserve_preemptions", "Preemptions, recomputed and swapped out alike", lambda s: s.preemptions),
    ("pdserve_swaps_out", "Preemptions that swapped a request out", lambda s: s.swaps_out),
    ("pdserve_swaps_in", "Swapped-out requests swapped back in", lambda s: s.swaps_in),
    ("pdserve_forked_samples", "Samples forked off a sibling sample, sharing its prompt blocks",
     lambda s: s.forked_samples),
    ("pdserve_failed_requests", "Requests failed because a model step they were in raised",
     lambda s: s.failed_requests),
    # The engine's steps: their shapes and seconds summed (pdserve/engine/step_shape.py).
    *((f"pdserve_{name}", text, lambda s, f=field: getattr(s.steps, f)) for field, name, text in STEP_SERIES),
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


class NodeHealth:
    """A node's `/health`: serving once its gRPC server serves, while its engine core runs,
    until it stops. The front moves the phase; the endpoint's thread asks."""

    def __init__(self, kind: str, core_alive: CoreAlive) -> None:
        self._kind = kind
        self._core_alive = core_alive
        self._phase = ServerPhase.STARTING
        self._address = ""

    def serving(self, address: str) -> None:
        self._address = address
        self._phase = ServerPhase.SERVING

    def draining(self) -> None:
        self._phase = ServerPhase.DRAINING

    def stopping(self) -> None:
        self._phase = ServerPhase.STOPPING

    def __call__(self) -> Health:
        phase = self._phase
        if phase is ServerPhase.STARTING:
            return Health(False, f"{self._kind} node starting: its engine core is loading the model")
        if phase is ServerPhase.STOPPING:
            return Health(False, f"{self._kind} node stopping")
        if phase is ServerPhase.DRAINING:  # not ready for new work, still finishing what it holds
            return Health(False, f"{self._kind} node on {self._address} draining")
        if not self._core_alive():
            return Health(False, f"{self._kind} node on {self._address}: its engine core is down")
        return Health(True, f"{self._kind} node on {self._address}, engine core running")


def serve_node_metrics(host: str, port: int, latest_stats: LatestStats, health: HealthCheck) -> MetricsEndpoint:
    """Serve the node's series on http://host:port/metrics and `health` on /health (0: the OS
    picks; see `.url`). Raises PortUnavailable naming `--metrics-port` when it cannot bind."""
    registry = CollectorRegistry()
    registry.register(NodeStatsCollector(latest_stats))
    try:
        return MetricsEndpoint.start(host, port, registry, health)
    except OSError as exc:
        raise unavailable(Listen("--metrics-port", host, port), exc) from exc
