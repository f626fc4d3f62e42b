"""A node's /metrics on hand-made stats snapshots: series, types, and the endpoint over HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.metrics_endpoint import Health
from pdserve.common.ports import PortUnavailable
from pdserve.kv_transfer import TransferStats
from pdserve.node.messages import StatsData
from pdserve.node.front.metrics import NodeStatsCollector, serve_node_metrics


def snapshot(used_blocks: int = 3, queries: int = 8, hits: int = 2) -> StatsData:
    return StatsData(kind="prefill", num_blocks=64, used_blocks=used_blocks, reserved_blocks=1, num_waiting=4,
                     num_running=5, queued_prefill_tokens=40,
                     kv_transfer=TransferStats(bytes=4096, blocks=2, transfers=1, failures=0, latency_s=0.25),
                     prefix_cache_queries=queries, prefix_cache_hits=hits, preemptions=6)


class Latest:
    """Stands in for `CoreClient.latest_stats`: the snapshot the core last pushed."""

    def __init__(self) -> None:
        self.stats: StatsData | None = None

    def __call__(self) -> StatsData | None:
        return self.stats


def registry_for(latest: Latest) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(NodeStatsCollector(latest))
    return registry


def test_no_series_before_the_first_snapshot() -> None:
    registry = registry_for(Latest())
    assert list(text_string_to_metric_families(generate_latest(registry).decode())) == []


def test_series_are_the_latest_snapshot() -> None:
    latest = Latest()
    registry = registry_for(latest)
    latest.stats = snapshot()
    expected = {
        "pdserve_num_requests_waiting": 4, "pdserve_num_requests_running": 5,
        "pdserve_kv_cache_blocks_used": 3, "pdserve_kv_cache_blocks_free": 61,
        "pdserve_kv_cache_usage_ratio": 3 / 64,
        "pdserve_kv_cache_blocks_reserved": 1, "pdserve_queued_prefill_tokens": 40,
        "pdserve_prefix_cache_hit_rate": 0.25,
        "pdserve_prefix_cache_queries_total": 8, "pdserve_prefix_cache_hits_total": 2,
        "pdserve_kv_transfer_bytes_total": 4096, "pdserve_kv_transfer_blocks_total": 2,
        "pdserve_kv_transfers_total": 1, "pdserve_kv_transfer_failures_total": 0,
        "pdserve_kv_transfer_seconds_total": 0.25, "pdserve_preemptions_total": 6,
    }
    assert {name: registry.get_sample_value(name) for name in expected} == expected

    latest.stats = snapshot(used_blocks=0, queries=0, hits=0)  # read at scrape time
    assert registry.get_sample_value("pdserve_kv_cache_blocks_used") == 0
    assert registry.get_sample_value("pdserve_kv_cache_usage_ratio") == 0
    assert registry.get_sample_value("pdserve_prefix_cache_hit_rate") == 0  # no queries yet: 0, not NaN


def test_counters_are_typed_counters() -> None:
    latest = Latest()
    latest.stats = snapshot()
    families = {f.name: f.type for f in text_string_to_metric_families(generate_latest(registry_for(latest)).decode())}
    assert families["pdserve_kv_transfer_bytes"] == "counter"
    assert families["pdserve_prefix_cache_queries"] == "counter"
    assert families["pdserve_kv_cache_blocks_used"] == "gauge"


def test_endpoint_serves_over_http_and_stops() -> None:
    latest = Latest()
    latest.stats = snapshot()
    endpoint = serve_node_metrics("127.0.0.1", 0, latest, lambda: Health(True, "test"))
    try:
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        with urllib.request.urlopen(endpoint.url, timeout=10) as response:
            text = response.read().decode()
        assert "pdserve_kv_transfer_bytes_total 4096.0" in text.splitlines()
        with pytest.raises(PortUnavailable) as taken:  # the port is in use: the flag's error, not a traceback
            serve_node_metrics("127.0.0.1", endpoint.port, latest, lambda: Health(True, "test"))
        assert str(taken.value) == (f"--metrics-port {endpoint.port}: 127.0.0.1:{endpoint.port} "
                                    "is already in use")
    finally:
        endpoint.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint.url, timeout=2)


def test_swap_series_are_the_latest_snapshot() -> None:
    latest = Latest()
    registry = registry_for(latest)
    latest.stats = snapshot()
    latest.stats.num_swapped, latest.stats.swap_blocks, latest.stats.used_swap_blocks = 2, 16, 5
    latest.stats.swaps_out, latest.stats.swaps_in = 7, 5
    expected = {"pdserve_num_requests_swapped": 2, "pdserve_swap_blocks_used": 5,
                "pdserve_swaps_out_total": 7, "pdserve_swaps_in_total": 5}
    assert {name: registry.get_sample_value(name) for name in expected} == expected
