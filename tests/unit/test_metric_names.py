"""The Grafana dashboard and docs/metrics.md name only series the code exports, and the docs name
every one: the families are read from the router's and the node's own registries."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.node.front.metrics import NodeStatsCollector
from pdserve.router.cluster.registry import NodeRegistry
from pdserve.router.dispatch.recovery import ResumeCounts
from pdserve.router.dispatch.state import RouteCounts
from pdserve.router.fronts.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
NAME = re.compile(r"\bpdserve_[a-z0-9_]+\b")
# Labels a dashboard may select or group on: the code's (histograms' `le`, RouterMetrics'
# `status`, the router's per-node `node` and `kind`), and the ones Prometheus adds to a target.
LABELS = {"le", "status", "node", "kind", "reason", "route"} | {"instance", "job", "pod", "namespace"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def families() -> dict[str, str]:
    """Every pdserve family, name -> type, as the router and a node register them."""
    router = CollectorRegistry()
    RouterMetrics(router, NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0), ResumeCounts(),
                  routes=RouteCounts())
    found = {metric.name: metric.type for metric in router.collect()}
    found.update({metric.name: metric.type for metric in NodeStatsCollector(lambda: None).describe()})
    return found


def sample_names() -> set[str]:
    return {name + suffix for name, kind in families().items() for suffix in SUFFIXES[kind]}


def exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for row in dashboard["panels"] for p in [row, *row.get("panels", [])]]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_every_family_is_found():
    assert len(families()) == 55  # 12 router request series + 13 router node series + 30 node series


def test_every_dashboard_expr_names_exported_series_and_labels():
    found = exprs()
    assert len(found) >= 20
    samples = sample_names()
    for expr in found:
        names = set(NAME.findall(expr))
        assert names and names <= samples, (expr, names - samples)
        selected = re.findall(r"(\w+)\s*(?:=|!=|=~|!~)\s*\"", expr)
        grouped = [label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
                   for label in group.split(",") if label.strip()]
        assert set(selected + grouped) <= LABELS, expr


def test_the_dashboard_covers_latency_queues_kv_transfer_and_preemptions():
    used = {name for expr in exprs() for name in NAME.findall(expr)}
    for needed in ("pdserve_request_ttft_seconds_bucket", "pdserve_request_tpot_seconds_bucket",
                   "pdserve_request_itl_seconds_bucket", "pdserve_node_queued_prefill_tokens",
                   "pdserve_node_kv_blocks_used", "pdserve_kv_transfer_bytes_total", "pdserve_preemptions_total"):
        assert needed in used, needed


def test_docs_name_every_family_and_nothing_else():
    documented = set(NAME.findall((ROOT / "docs" / "metrics.md").read_text()))
    exported = families()
    assert set(exported) <= documented, set(exported) - documented
    # What else the page names is a sample of an exported family (`pdserve_requests_total`).
    assert documented - set(exported) <= sample_names(), documented - set(exported) - sample_names()
