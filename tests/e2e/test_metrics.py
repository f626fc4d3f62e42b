"""Prometheus `/metrics` on a real 1P1D cluster: every series served, and moving as requests run.

The router's request series count exactly the requests, tokens and statuses the test
sent (OK, INVALID_ARGUMENT, CANCELLED); each node's series come from its engine core:
the KV bytes both nodes count equal the prompts' blocks exactly, the prefill node's
prefix cache is queried and hit by a repeated prompt, and every KV-blocks-used gauge
returns to 0.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster, NodeSettings, running_cluster
from pdserve.engine.model_loader import load_model
from pdserve.engine.step_shape import StepShape
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import settled

from ..integration.reference import assert_matches, greedy_references

BLOCK_SIZE = 8
NUM_BLOCKS = 256
PROMPT_LENS = [9, 17, 30]
NEW_TOKENS = [6, 4, 8]
WAIT_S = 15.0

ROUTER_FAMILIES = {
    "pdserve_request_ttft_seconds", "pdserve_request_tpot_seconds", "pdserve_request_itl_seconds",
    "pdserve_request_e2e_seconds", "pdserve_request_prompt_tokens", "pdserve_request_generation_tokens",
    "pdserve_requests", "pdserve_generated_tokens", "pdserve_prompt_tokens", "pdserve_requests_in_flight",
    "pdserve_node_kv_blocks_used", "pdserve_node_kv_blocks_free", "pdserve_node_kv_blocks_reserved",
    "pdserve_node_requests_waiting", "pdserve_node_requests_running", "pdserve_node_queued_prefill_tokens",
}
NODE_FAMILIES = {
    "pdserve_num_requests_waiting", "pdserve_num_requests_running", "pdserve_kv_cache_blocks_used",
    "pdserve_kv_cache_blocks_free", "pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_blocks_reserved",
    "pdserve_queued_prefill_tokens",
    "pdserve_prefix_cache_queries", "pdserve_prefix_cache_hits", "pdserve_prefix_cache_hit_rate",
    "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_blocks", "pdserve_kv_transfers",
    "pdserve_kv_transfer_failures", "pdserve_kv_transfer_seconds", "pdserve_preemptions",
}


@dataclass(frozen=True)
class Scrape:
    families: frozenset[str]
    values: dict[tuple[str, frozenset], float]

    def value(self, sample: str, **labels: str) -> float | None:
        return self.values.get((sample, frozenset(labels.items())))


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    families = list(text_string_to_metric_families(text))
    values = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return Scrape(frozenset(f.name for f in families), values)


def scrape_until(url: str, ready) -> Scrape:
    """Nodes refresh their stats and heartbeat every 0.5 s: poll until `ready`, bounded."""
    return settled(lambda: scrape(url), ready, WAIT_S, interval_s=0.1)


def ended_as(**counts: int):
    """Ready once `pdserve_requests_total` has these counts by status. A refused request's
    client sees its status before the router's handler unwinds and counts it, so a scrape
    right after the client's answer can miss it."""
    return lambda s: all(s.value("pdserve_requests_total", status=status) == n for status, n in counts.items())


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def kv_bytes_per_block(model_dir: str) -> int:
    loaded = load_model(model_dir, torch.float32)
    return 2 * loaded.num_layers * loaded.num_kv_heads * BLOCK_SIZE * loaded.head_dim * 4


def greedy(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def run_requests(router: str, prompts: list[list[int]], new_tokens: list[int]):
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(prompt, max_tokens):
            return [r async for r in stub.Generate(greedy(prompt, max_tokens), timeout=120)]

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, new_tokens)))


async def invalid_request(router: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(router) as channel:
        try:
            async for _ in pdserve_pb2_grpc.GenerationStub(channel).Generate(pdserve_pb2.GenerateRequest(), timeout=30):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def cancel_after_first_response(router: str, prompt: list[int]) -> None:
    async with grpc.aio.insecure_channel(router) as channel:
        call = pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy(prompt, 200), timeout=120)
        await call.read()
        call.cancel()


def node_urls(cluster: Cluster) -> dict[str, str]:
    return {name: url for name, url in cluster.metrics.items() if name != "router"}


def check_step_counters(cluster: Cluster, prefill_chunks: list[tuple[int, int]],
                        decodes: list[tuple[int, int]]) -> None:
    """Each node's step counters, on the router and on the node, sum exactly the chunks it computed
    ((tokens computed before, tokens scheduled) each, whatever steps they were batched in), with
    seconds spent on them."""
    for node, kind, chunks in (("prefill-0", "prefill", prefill_chunks), ("decode-0", "decode", decodes)):
        want = StepShape.of(chunks)
        router = scrape_until(cluster.metrics["router"], lambda s: s.value(
            "pdserve_node_step_tokens_total", node=node, kind=kind) == want.tokens)
        own = scrape(cluster.metrics[node])
        for field, series in (("tokens", "step_tokens"), ("requests", "step_requests"),
                              ("attended", "step_attended_pairs"), ("decode_context", "step_decode_context_tokens")):
            assert router.value(f"pdserve_node_{series}_total", node=node, kind=kind) == getattr(want, field), series
            assert own.value(f"pdserve_{series}_total") == getattr(want, field), series
        steps = router.value("pdserve_node_steps_total", node=node, kind=kind)
        assert 1 <= steps <= len(chunks) and own.value("pdserve_steps_total") == steps
        assert router.value("pdserve_node_step_seconds_total", node=node, kind=kind) > 0
        assert router.value("pdserve_node_step_cpu_seconds_total", node=node, kind=kind) > 0


def test_metrics_series_served_and_moving(model_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    refs = greedy_references(model_dir, prompts, NEW_TOKENS)
    block_bytes = kv_bytes_per_block(model_dir)
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
                         metrics=True) as cluster:
        assert set(cluster.metrics) == {"router", "prefill-0", "decode-0"}
        router_url = cluster.metrics["router"]
        before_router = scrape_until(router_url, lambda s: s.value(
            "pdserve_node_kv_blocks_free", node="decode-0", kind="decode") == NUM_BLOCKS)
        assert ROUTER_FAMILIES <= before_router.families
        assert before_router.value("pdserve_request_ttft_seconds_count") == 0
        before_nodes = {name: scrape_until(url, lambda s: NODE_FAMILIES <= s.families)
                        for name, url in node_urls(cluster).items()}
        for name, result in before_nodes.items():
            assert NODE_FAMILIES <= result.families, name
            assert result.value("pdserve_kv_cache_blocks_free") == NUM_BLOCKS
            assert result.value("pdserve_kv_transfer_bytes_total") == 0

        streams = asyncio.run(run_requests(cluster.router, prompts, NEW_TOKENS))
        assert_matches([[t for r in s for t in r.token_ids] for s in streams], refs)
        # The same prompt again: the prefill node finds its blocks in its prefix cache.
        repeat = asyncio.run(run_requests(cluster.router, [prompts[2]], [NEW_TOKENS[2]]))[0]
        assert_matches([[t for r in repeat for t in r.token_ids]], [refs[2]])
        assert repeat[-1].usage.cached_prompt_tokens > 0
        assert asyncio.run(invalid_request(cluster.router)) is grpc.StatusCode.INVALID_ARGUMENT

        num_ok = len(prompts) + 1
        all_prompts = [*prompts, prompts[2]]
        router = scrape_until(router_url, ended_as(OK=num_ok, INVALID_ARGUMENT=1))
        assert router.value("pdserve_requests_total", status="OK") == num_ok
        assert router.value("pdserve_requests_total", status="INVALID_ARGUMENT") == 1
        assert router.value("pdserve_request_ttft_seconds_count") == num_ok
        assert router.value("pdserve_request_e2e_seconds_count") == num_ok
        assert router.value("pdserve_request_tpot_seconds_count") == num_ok  # every one has > 1 token
        # One inter-token gap per token after each sample's first.
        assert router.value("pdserve_request_itl_seconds_count") == sum(NEW_TOKENS) + NEW_TOKENS[2] - num_ok
        assert router.value("pdserve_generated_tokens_total") == sum(NEW_TOKENS) + NEW_TOKENS[2]
        assert router.value("pdserve_prompt_tokens_total") == sum(len(p) for p in all_prompts)
        assert router.value("pdserve_requests_in_flight") == 0
        check_step_counters(cluster, [(0, len(p)) for p in prompts] + [(cached := repeat[-1].usage.cached_prompt_tokens,
                                                                         len(prompts[2]) - cached)],
                            [(len(p) + k, 1) for p, n in zip(all_prompts, [*NEW_TOKENS, NEW_TOKENS[2]])
                             for k in range(n - 1)])

        expected_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in all_prompts)
        for name, url in node_urls(cluster).items():
            node = scrape_until(url, lambda s: s.value("pdserve_kv_transfers_total") == num_ok
                                and s.value("pdserve_kv_cache_blocks_used") == 0)
            assert node.value("pdserve_kv_transfers_total") == num_ok, name
            assert node.value("pdserve_kv_transfer_blocks_total") == expected_blocks, name
            assert node.value("pdserve_kv_transfer_bytes_total") == expected_blocks * block_bytes, name
            assert node.value("pdserve_kv_transfer_failures_total") == 0, name
            assert node.value("pdserve_kv_transfer_seconds_total") > 0, name
            assert node.value("pdserve_kv_cache_blocks_used") == 0, name
            assert node.value("pdserve_kv_cache_blocks_free") == NUM_BLOCKS, name
            assert node.value("pdserve_num_requests_running") == 0, name
        prefill = scrape(cluster.metrics["prefill-0"])
        assert prefill.value("pdserve_prefix_cache_queries_total") > 0
        assert prefill.value("pdserve_prefix_cache_hits_total") >= 1
        assert 0 < prefill.value("pdserve_prefix_cache_hit_rate") <= 1

        asyncio.run(cancel_after_first_response(cluster.router, prompts[1]))
        router = scrape_until(router_url, ended_as(OK=num_ok, INVALID_ARGUMENT=1, CANCELLED=1))
        assert router.value("pdserve_requests_total", status="CANCELLED") == 1
        assert router.value("pdserve_requests_total", status="OK") == num_ok
        assert router.value("pdserve_requests_in_flight") == 0

        # The HTTP API's requests are counted by the same series: one OK, one refused by name.
        tokens_before = router.value("pdserve_generated_tokens_total")
        http = openai.OpenAI(base_url=cluster.state.http, api_key="unused", max_retries=0)
        http.completions.create(model="llama", prompt=prompts[0], max_tokens=3, temperature=0,
                                extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError):
            http.completions.create(model="llama", prompt=prompts[0], max_tokens=3, top_p=7)
        router = scrape_until(router_url, ended_as(OK=num_ok + 1, INVALID_ARGUMENT=2, CANCELLED=1))
        assert router.value("pdserve_requests_total", status="OK") == num_ok + 1
        assert router.value("pdserve_requests_total", status="INVALID_ARGUMENT") == 2
        assert router.value("pdserve_generated_tokens_total") == tokens_before + 3
        assert router.value("pdserve_requests_in_flight") == 0

        # /metrics on the HTTP API port: the same registry, in the exposition format Prometheus parses.
        api = scrape(cluster.state.http.removesuffix("/v1") + "/metrics")
        assert api.families == router.families
        for sample, labels in (("pdserve_requests_total", {"status": "OK"}), ("pdserve_generated_tokens_total", {}),
                               ("pdserve_request_ttft_seconds_count", {})):
            assert api.value(sample, **labels) == router.value(sample, **labels)

        assert all(s.used_blocks == 0 for s in cluster.wait_all_blocks_free(10.0))
        router = scrape_until(router_url, lambda s: all(
            s.value("pdserve_node_kv_blocks_used", node=node, kind=kind) == 0
            for node, kind in (("prefill-0", "prefill"), ("decode-0", "decode"))))
        for node, kind in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert router.value("pdserve_node_kv_blocks_used", node=node, kind=kind) == 0
            assert router.value("pdserve_node_kv_blocks_free", node=node, kind=kind) == NUM_BLOCKS
