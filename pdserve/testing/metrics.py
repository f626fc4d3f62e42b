"""Reading a /metrics endpoint back: one family's samples by one label, for the tests' checks
and the benches' records (e.g. `pdserve_prompt_routes_total` by route)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.metrics_endpoint import scrape


def counter_in(text: str, family: str, label: str) -> dict[str, float]:
    """A counter family in exposition `text`, by one of its labels."""
    return _samples(text, family, f"{family}_total", label)


def gauge_in(text: str, family: str, label: str) -> dict[str, float]:
    """A gauge family in exposition `text`, by one of its labels."""
    return _samples(text, family, family, label)


def counter(metrics_url: str, family: str, label: str) -> dict[str, float]:
    """A counter family served at `metrics_url` (e.g. `pdserve_resumes`), by one of its labels."""
    return counter_in(scrape(metrics_url), family, label)


def gauge(metrics_url: str, family: str, label: str) -> dict[str, float]:
    """A gauge family served at `metrics_url` (e.g. `pdserve_node_kv_blocks_used`), by one of its labels."""
    return gauge_in(scrape(metrics_url), family, label)


def _samples(text: str, family: str, sample: str, label: str) -> dict[str, float]:
    [found] = [f for f in text_string_to_metric_families(text) if f.name == family]
    return {s.labels[label]: s.value for s in found.samples if s.name == sample}
