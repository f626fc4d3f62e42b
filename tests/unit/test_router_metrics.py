"""RouterMetrics on hand-made response streams: latency math, token counts, final statuses, exposition."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.router.dispatch.recovery import LossReason, ResumeCounts
from pdserve.router.dispatch.state import PromptRoute, RouteCounts
from pdserve.router.errors import Overloaded
from pdserve.router.fronts.metrics import RouterMetrics, grpc_end_status, http_end_status
from pdserve.router.cluster.registry import NodeKind, NodeRegistry

PROMPT_TOKENS = 5


class FakeContext:
    """The two things the metrics read from a grpc.aio servicer context."""

    def __init__(self, time_remaining: float | None = None) -> None:
        self._code: grpc.StatusCode | None = None
        self._time_remaining = time_remaining

    def abort_with(self, code: grpc.StatusCode) -> Exception:
        self._code = code
        return RuntimeError(f"aborted with {code.name}")  # stands in for grpc's AbortError

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def time_remaining(self) -> float | None:
        return self._time_remaining


def token(index: int, token_id: int) -> pdserve_pb2.GenerateResponse:
    return pdserve_pb2.GenerateResponse(index=index, token_ids=[token_id])


def last(index: int, token_ids: list[int], completion_tokens: int, ttft_s: float,
         e2e_s: float) -> pdserve_pb2.GenerateResponse:
    return pdserve_pb2.GenerateResponse(
        index=index, token_ids=token_ids, finish_reason=pdserve_pb2.FINISH_REASON_LENGTH,
        usage=pdserve_pb2.Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=completion_tokens),
        timings=pdserve_pb2.Timings(ttft_s=ttft_s, e2e_s=e2e_s),
    )


async def stream(responses, failure: BaseException | None = None):
    for response in responses:
        yield response
    if failure is not None:
        raise failure


def drain(metrics: RouterMetrics, responses, context: FakeContext) -> list[pdserve_pb2.GenerateResponse]:
    async def scenario():
        return [r async for r in metrics.observe(responses, grpc_end_status(context))]

    return asyncio.run(scenario())


def value(registry: CollectorRegistry, sample: str, **labels: str) -> float | None:
    return registry.get_sample_value(sample, labels)


def test_two_samples_record_latency_tokens_and_ok() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    responses = [
        token(0, 11), token(1, 21),
        last(0, [12, 13], completion_tokens=3, ttft_s=0.1, e2e_s=0.5),  # TPOT (0.5 - 0.1) / 2
        last(1, [], completion_tokens=1, ttft_s=0.2, e2e_s=0.2),  # one token: no TPOT
    ]
    relayed = drain(metrics, stream(responses), grpc_end_status(FakeContext()))

    assert relayed == responses
    assert value(registry, "pdserve_request_ttft_seconds_count") == 2
    assert value(registry, "pdserve_request_ttft_seconds_sum") == pytest.approx(0.3)
    assert value(registry, "pdserve_request_e2e_seconds_count") == 2
    assert value(registry, "pdserve_request_e2e_seconds_sum") == pytest.approx(0.7)
    assert value(registry, "pdserve_request_tpot_seconds_count") == 1
    assert value(registry, "pdserve_request_tpot_seconds_sum") == pytest.approx(0.2)
    assert value(registry, "pdserve_request_ttft_seconds_bucket", le="0.1") == 1
    assert value(registry, "pdserve_request_ttft_seconds_bucket", le="0.25") == 2
    assert value(registry, "pdserve_generated_tokens_total") == 4
    assert value(registry, "pdserve_prompt_tokens_total") == PROMPT_TOKENS  # once per request, not per sample
    # Lengths per finished sample: the workload's mix, as the planner's load mode reads it.
    assert value(registry, "pdserve_request_prompt_tokens_count") == 2
    assert value(registry, "pdserve_request_prompt_tokens_sum") == 2 * PROMPT_TOKENS
    assert value(registry, "pdserve_request_generation_tokens_sum") == 3 + 1
    assert value(registry, "pdserve_request_generation_tokens_bucket", le="1.0") == 1
    assert value(registry, "pdserve_request_generation_tokens_bucket", le="4.0") == 2
    assert value(registry, "pdserve_requests_total", status="OK") == 1
    assert value(registry, "pdserve_requests_in_flight") == 0


def test_inter_token_latency_is_each_gap_over_the_tokens_it_brought() -> None:
    registry = CollectorRegistry()
    ticks = iter([10.0, 10.5, 11.0, 20.0, 20.4])  # the router's clock at each response with tokens
    metrics = RouterMetrics(registry, clock=lambda: next(ticks))
    responses = [token(0, 1), token(0, 2),  # sample 0: first token, then a 0.5 s gap
                 token(1, 7),  # sample 1's first token: no gap of its own
                 last(0, [3, 4], completion_tokens=4, ttft_s=0.1, e2e_s=2.0),  # 9.5 s over two tokens
                 last(1, [8], completion_tokens=2, ttft_s=0.1, e2e_s=2.0)]  # 9.4 s after its first
    drain(metrics, stream(responses), grpc_end_status(FakeContext()))

    assert value(registry, "pdserve_request_itl_seconds_count") == 4
    assert value(registry, "pdserve_request_itl_seconds_sum") == pytest.approx(0.5 + 4.75 * 2 + 9.4)
    assert value(registry, "pdserve_request_itl_seconds_bucket", le="0.5") == 1


def test_in_flight_while_streaming() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)

    async def scenario():
        observed = metrics.observe(stream([token(0, 1), last(0, [2], 2, 0.1, 0.2)]), grpc_end_status(FakeContext()))
        await anext(observed)
        during = value(registry, "pdserve_requests_in_flight")
        async for _ in observed:
            pass
        return during

    assert asyncio.run(scenario()) == 1
    assert value(registry, "pdserve_requests_in_flight") == 0


def test_aborted_request_counts_the_abort_code() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    context = FakeContext()
    with pytest.raises(RuntimeError):
        drain(metrics, stream([], context.abort_with(grpc.StatusCode.INVALID_ARGUMENT)), context)

    assert value(registry, "pdserve_requests_total", status="INVALID_ARGUMENT") == 1
    assert value(registry, "pdserve_requests_total", status="OK") is None
    assert value(registry, "pdserve_request_ttft_seconds_count") == 0
    assert value(registry, "pdserve_prompt_tokens_total") == 0
    assert value(registry, "pdserve_requests_in_flight") == 0


@pytest.mark.parametrize(("time_remaining", "status"), [
    (None, "CANCELLED"),  # no deadline: the client went away
    (3.0, "CANCELLED"),
    (0.0, "DEADLINE_EXCEEDED"),
])
def test_cancelled_handler_is_cancelled_or_deadline(time_remaining: float | None, status: str) -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    with pytest.raises(asyncio.CancelledError):
        drain(metrics, stream([token(0, 1)], asyncio.CancelledError()), FakeContext(time_remaining))

    assert value(registry, "pdserve_requests_total", status=status) == 1
    assert value(registry, "pdserve_generated_tokens_total") == 1  # streamed before the cancel
    assert value(registry, "pdserve_requests_in_flight") == 0


def test_stream_closed_at_a_response_counts_cancelled() -> None:
    """gRPC may drop the handler while it waits to send: the generator is closed, not raised into."""
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)

    async def scenario():
        observed = metrics.observe(stream([token(0, 1), token(0, 2)]), grpc_end_status(FakeContext()))
        await anext(observed)
        await observed.aclose()

    asyncio.run(scenario())
    assert value(registry, "pdserve_requests_total", status="CANCELLED") == 1
    assert value(registry, "pdserve_requests_in_flight") == 0


def node_stats(num_blocks: int, used: int, waiting: int, running: int) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(num_blocks=num_blocks, used_blocks=used, reserved_blocks=2,
                              num_waiting=waiting, num_running=running, queued_prefill_tokens=7)


def test_node_gauges_come_from_the_last_heartbeat() -> None:
    nodes = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0, clock=lambda: 0.0)
    nodes.register(NodeKind.PREFILL, "127.0.0.1:1", "p0")
    nodes.register(NodeKind.DECODE, "127.0.0.1:2", "d0")
    nodes.register(NodeKind.DECODE, "127.0.0.1:3", "d1")  # no heartbeat yet: no series
    nodes.heartbeat("p0", node_stats(64, 10, 1, 2))
    nodes.heartbeat("d0", node_stats(128, 100, 0, 3))
    registry = CollectorRegistry()
    RouterMetrics(registry, nodes)

    assert value(registry, "pdserve_node_kv_blocks_used", node="p0", kind="prefill") == 10
    assert value(registry, "pdserve_node_kv_blocks_free", node="p0", kind="prefill") == 54
    assert value(registry, "pdserve_node_kv_blocks_used", node="d0", kind="decode") == 100
    assert value(registry, "pdserve_node_kv_blocks_free", node="d0", kind="decode") == 28
    assert value(registry, "pdserve_node_kv_blocks_reserved", node="d0", kind="decode") == 2
    assert value(registry, "pdserve_node_requests_waiting", node="p0", kind="prefill") == 1
    assert value(registry, "pdserve_node_requests_running", node="d0", kind="decode") == 3
    assert value(registry, "pdserve_node_queued_prefill_tokens", node="p0", kind="prefill") == 7
    assert value(registry, "pdserve_node_kv_blocks_used", node="d1", kind="decode") is None

    nodes.heartbeat("d0", node_stats(128, 0, 0, 0))  # read at scrape time: the new value shows
    assert value(registry, "pdserve_node_kv_blocks_used", node="d0", kind="decode") == 0


def test_exposition_names_follow_prometheus_conventions() -> None:
    nodes = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0, clock=lambda: 0.0)
    nodes.register(NodeKind.DECODE, "127.0.0.1:2", "d0")
    nodes.heartbeat("d0", node_stats(128, 1, 0, 1))
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry, nodes)
    drain(metrics, stream([last(0, [1, 2], 2, 0.01, 0.02)]), grpc_end_status(FakeContext()))

    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    expected_types = {
        "pdserve_request_ttft_seconds": "histogram",
        "pdserve_request_tpot_seconds": "histogram",
        "pdserve_request_e2e_seconds": "histogram",
        "pdserve_request_prompt_tokens": "histogram",
        "pdserve_request_generation_tokens": "histogram",
        "pdserve_requests": "counter",
        "pdserve_generated_tokens": "counter",
        "pdserve_prompt_tokens": "counter",
        "pdserve_requests_in_flight": "gauge",
        "pdserve_node_kv_blocks_used": "gauge",
        "pdserve_node_kv_blocks_free": "gauge",
        "pdserve_node_requests_waiting": "gauge",
        "pdserve_node_requests_running": "gauge",
    }
    assert {name: families[name].type for name in expected_types} == expected_types
    sample_names = {s.name for f in families.values() for s in f.samples}
    assert {"pdserve_requests_total", "pdserve_generated_tokens_total", "pdserve_prompt_tokens_total",
            "pdserve_request_ttft_seconds_bucket", "pdserve_request_ttft_seconds_count"} <= sample_names
    buckets = [s.labels["le"] for s in families["pdserve_request_ttft_seconds"].samples
               if s.name.endswith("_bucket")]
    assert buckets[0] == "0.005" and buckets[-2:] == ["60.0", "+Inf"]


def test_http_requests_end_ok_with_the_router_errors_code_or_cancelled():
    assert http_end_status(True, None) is grpc.StatusCode.OK
    assert http_end_status(False, Overloaded("full")) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_end_status(False, GeneratorExit()) is grpc.StatusCode.CANCELLED
    assert http_end_status(False, RuntimeError("bug")) is grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("family, label, counts, expected", [
    ("pdserve_resumes", "reason", [LossReason.NODE_FAILED, LossReason.NODE_FAILED, LossReason.DRAIN_TIMEOUT],
     {"node_failed": 2.0, "node_gone": 0.0, "kv_lost": 0.0, "drain_timeout": 1.0}),
    ("pdserve_prompt_routes", "route", [PromptRoute.DECODE_NODE, PromptRoute.DECODE_NODE, PromptRoute.PREFILL_POOL],
     {"colocated": 0.0, "prefill_pool": 1.0, "decode_node": 2.0}),
])
def test_the_router_counts_are_counters_every_label_shown_from_zero(family, label, counts, expected):
    resumes, routes = ResumeCounts(), RouteCounts()
    metrics = RouterMetrics(CollectorRegistry(), resumes=resumes, routes=routes)
    for key in counts:
        (resumes if family == "pdserve_resumes" else routes).count(key)
    text = generate_latest(metrics.registry).decode()
    [found] = [f for f in text_string_to_metric_families(text) if f.name == family]
    assert found.type == "counter"
    assert {s.labels[label]: s.value for s in found.samples if s.name == f"{family}_total"} == expected
