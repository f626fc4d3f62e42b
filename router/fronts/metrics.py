"""The router's Prometheus series: request latency, status and tokens, and the nodes' gauges.

Owns `RouterMetrics`, built on a `CollectorRegistry` the router passes in (one per
process, never the library's global one). Requests are recorded by observing the public
response stream of a request (`RouterMetrics.observe`: gRPC's `Generate`, and each prompt of
an HTTP request), the one place that sees a whole request: TTFT and end-to-end latency from each sample's last response (its
`timings`), TPOT = (e2e - ttft) / (completion_tokens - 1), every streamed token, the
prompt's tokens once per request, and the request's final status. The per-node gauges
come from the heartbeats the registry already keeps, read at scrape time by
`NodeStatsCollector` (no polling of its own); `pdserve_resumes_total{reason}` from the router's
`ResumeCounts` (router/dispatch/recovery.py), read at scrape time by `ResumesCollector`.

Must never: change a response, pick a status code (it only reads the one the servicer
aborted with), or call a node.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.proto import pdserve_pb2
from pdserve.router.errors import status_of
from pdserve.router.cluster.registry import NodeEntry, NodeKind, NodeRegistry
from pdserve.router.dispatch.recovery import ResumeCounts

# A tiny model on a CPU answers in milliseconds, a real one under load in tens of seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, nodes: NodeRegistry | None = None,
                 resumes: ResumeCounts | None = None) -> None:
        self.registry = registry
        self._ttft = Histogram("pdserve_request_ttft_seconds", "Time to first token of each sample",
                               buckets=LATENCY_BUCKETS_S, registry=registry)
        self._tpot = Histogram("pdserve_request_tpot_seconds",
                               "Time per output token after the first, of each sample with more than one token",
                               buckets=TPOT_BUCKETS_S, registry=registry)
        self._e2e = Histogram("pdserve_request_e2e_seconds", "Request received to last token, of each sample",
                              buckets=LATENCY_BUCKETS_S, registry=registry)
        self._requests = Counter("pdserve_requests", "Generate requests ended, by final gRPC status",
                                 ["status"], registry=registry)
        self._generated_tokens = Counter("pdserve_generated_tokens", "Tokens streamed to clients",
                                         registry=registry)
        self._prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests that finished a sample",
                                      registry=registry)
        self._in_flight = Gauge("pdserve_requests_in_flight", "Generate requests being served", registry=registry)
        if nodes is not None:
            registry.register(NodeStatsCollector(nodes))
        if resumes is not None:
            registry.register(ResumesCollector(resumes))

    async def observe(self, responses: AsyncIterator[pdserve_pb2.GenerateResponse],
                      ended: EndStatus) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """Relays one request's responses unchanged, recording them and, at its end, its status
        (`ended(completed, error)`: how the request's API says it ended)."""
        self._in_flight.inc()
        completed = False
        error: BaseException | None = None
        prompt_counted = False
        try:
            async for response in responses:
                self._generated_tokens.inc(len(response.token_ids))
                if response.HasField("usage"):  # a sample's last response
                    self._record_sample(response)
                    if not prompt_counted:
                        self._prompt_tokens.inc(response.usage.prompt_tokens)
                        prompt_counted = True
                yield response
            completed = True
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._in_flight.dec()
            self._requests.labels(status=ended(completed, error).name).inc()

    def _record_sample(self, response: pdserve_pb2.GenerateResponse) -> None:
        timings, completion_tokens = response.timings, response.usage.completion_tokens
        self._ttft.observe(timings.ttft_s)
        self._e2e.observe(timings.e2e_s)
        if completion_tokens > 1:
            self._tpot.observe((timings.e2e_s - timings.ttft_s) / (completion_tokens - 1))


# How a request ended, given whether it completed and what ended it otherwise.
EndStatus = Callable[[bool, BaseException | None], grpc.StatusCode]


def grpc_end_status(context: grpc.aio.ServicerContext) -> EndStatus:
    """A gRPC call's end: OK, the code the servicer aborted with, or the client gone."""
    return lambda completed, error: _final_status(context, completed)


def http_end_status(completed: bool, error: BaseException | None) -> grpc.StatusCode:
    """An HTTP request's end: OK, the router error's code, or CANCELLED when the client left
    (aiohttp cancels the handler, which closes this stream)."""
    if completed:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)) or error is None:
        return grpc.StatusCode.CANCELLED
    return status_of(error)[0]


def _final_status(context: grpc.aio.ServicerContext, completed: bool) -> grpc.StatusCode:
    """How a gRPC request ended: OK, the code the servicer aborted with, or the client gone."""
    if completed:
        return grpc.StatusCode.OK
    aborted_with = context.code()
    if aborted_with is not None:
        return aborted_with
    # Neither finished nor aborted: gRPC cancelled the handler, at the deadline or because
    # the client went away.
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


# (series suffix, help, value of a node's last NodeStats)
_NODE_GAUGES = (
    ("kv_blocks_used", "KV cache blocks in use on the node", lambda s: s.used_blocks),
    ("kv_blocks_free", "KV cache blocks free on the node", lambda s: max(0, s.num_blocks - s.used_blocks)),
    ("kv_blocks_reserved", "Decode blocks reserved for KV still in transfer", lambda s: s.reserved_blocks),
    ("requests_waiting", "Requests waiting in the node's scheduler", lambda s: s.num_waiting),
    ("requests_running", "Requests running in the node's scheduler", lambda s: s.num_running),
    ("queued_prefill_tokens", "Prompt tokens the node has yet to prefill", lambda s: s.queued_prefill_tokens),
)
_SNAPSHOT_ATTEMPTS = 3


class NodeStatsCollector(Collector):
    """`pdserve_node_*{node, kind}`: each live node's last heartbeat, read when scraped."""

    def __init__(self, nodes: NodeRegistry) -> None:
        self._nodes = nodes

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = list(self._families())
        for entry in self._live_entries():
            if entry.stats is None:
                continue
            labels = [entry.node_id, entry.kind.value]
            for family, (_, _, value_of) in zip(families, _NODE_GAUGES):
                family.add_metric(labels, value_of(entry.stats))
        return iter(families)

    def _families(self) -> Iterator[GaugeMetricFamily]:
        for suffix, help_text, _ in _NODE_GAUGES:
            yield GaugeMetricFamily(f"pdserve_node_{suffix}", help_text, labels=["node", "kind"])

    def _live_entries(self) -> list[NodeEntry]:
        # A scrape runs on the HTTP server's thread while the event loop may add or drop a
        # node; a node table that changed size mid-read is simply read again.
        for _ in range(_SNAPSHOT_ATTEMPTS):
            try:
                return [entry for kind in NodeKind for entry in self._nodes.live(kind)]
            except RuntimeError:
                continue
        return []


class ResumesCollector(Collector):
    """`pdserve_resumes_total{reason}`: samples computed again on another node after a loss (a
    resume while decoding, or a retry before the next token); every reason, zeros included."""

    def __init__(self, resumes: ResumeCounts) -> None:
        self._resumes = resumes

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter([self._family()])

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        # Read on the endpoint's thread while the loop may count: a copy, retried if it changed mid-read.
        for _ in range(_SNAPSHOT_ATTEMPTS):
            try:
                counts = self._resumes.snapshot()
                break
            except RuntimeError:
                continue
        else:
            counts = {}
        for reason, value in counts.items():
            family.add_metric([reason.value], value)
        return iter([family])

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily("pdserve_resumes", "Samples computed again on another node after losing one, "
                                   "by reason", labels=["reason"])
