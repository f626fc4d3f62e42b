"""`running_cluster(..., auth_token=...)`: a benchmark's local cluster behind a shared secret.

Router + 1 prefill + 1 decode node on 127.0.0.1, all started with the token. The
harness's own calls (its health wait, `Cluster.stats`) and the benchmarks' clients
(pdserve/bench/disagg_latency.py, pdserve/bench/overload.py) carry it and get transformers' exact
tokens; a call without it is UNAUTHENTICATED; every node ends with zero blocks in use.
"""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.common.auth import open_channel
from pdserve.bench import disagg_latency, overload
from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

from ..integration.reference import assert_matches, greedy_references

TOKEN = "bench-Secret.token-42"
BLOCK_SIZE = 8
PROMPT = [9, 4, 77, 301, 12, 12, 640, 5, 58, 2, 870]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE, num_blocks=64),
                         auth_token=TOKEN) as running:
        yield running


def greedy() -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=PROMPT),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))


async def overload_client(router: str) -> tuple[overload.Result, list[int]]:
    """The overload benchmark's request, and the tokens of the same request on the same channel."""
    async with open_channel(router, TOKEN) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        result = await overload.one_request(stub, greedy(), timeout_s=60)
        tokens = [t async for r in stub.Generate(greedy(), timeout=60) for t in r.token_ids]
    return result, tokens


def test_the_cluster_requires_the_token_and_the_bench_clients_send_it(cluster, model_dir):
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])

    with grpc.insecure_channel(cluster.router) as channel, pytest.raises(grpc.RpcError) as err:
        list(pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy(), timeout=60))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(cluster.prefill[0]) as channel, pytest.raises(grpc.RpcError) as err:
        node_pb2_grpc.PrefillNodeStub(channel).GetStats(node_pb2.StatsRequest(), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED

    result, tokens = asyncio.run(overload_client(cluster.router))
    assert result.code == "OK"
    assert_matches([tokens], [reference])

    timings = disagg_latency.one_request(cluster.router, PROMPT, NEW_TOKENS, TOKEN)
    assert timings["kv_transfer_bytes"] > 0  # the prompt's KV moved from prefill to decode

    stats = cluster.wait_all_blocks_free(timeout_s=5)  # GetStats with the token
    assert [(s.kind, s.used_blocks) for s in stats] == [("prefill", 0), ("decode", 0)]
    assert stats[0].kv_transfer.bytes == stats[1].kv_transfer.bytes > 0


def test_the_http_api_needs_the_token_as_a_bearer_header(cluster, model_dir):
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    ask = dict(model="llama", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    for key in ("wrong-token", TOKEN[:-1]):
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=cluster.state.http, api_key=key, max_retries=0).completions.create(**ask)
        assert refused.value.status_code == 401 and refused.value.body["code"] == "UNAUTHENTICATED"
    answer = openai.OpenAI(base_url=cluster.state.http, api_key=TOKEN, max_retries=0).completions.create(**ask)
    assert answer.choices[0].text == AutoTokenizer.from_pretrained(model_dir).decode(reference.token_ids)
    with urllib.request.urlopen(cluster.state.http.removesuffix("/v1") + "/health", timeout=10) as health:
        assert health.status == 200  # the probe needs no token
    stats = cluster.wait_all_blocks_free(timeout_s=5)
    assert [(s.kind, s.used_blocks) for s in stats] == [("prefill", 0), ("decode", 0)]
