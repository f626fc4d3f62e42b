"""The router's `--stream-interval`: a 1P1D cluster (`pdserve cluster --router-args "--stream-interval 4"`)
streams the same greedy tokens as transformers over gRPC and over the OpenAI HTTP API, in fewer,
larger responses: token 1 alone (the prefill node's), the decode node's first event at once, then
at least four tokens to a response until the last; every block is free afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request

import grpc
import pytest
from transformers import AutoTokenizer

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import running_cluster

from ..integration.reference import assert_matches, greedy_references

INTERVAL = 4
PROMPT_LENS = [7, 30, 64]
NEW_TOKENS = [23, 16, 2]


@pytest.fixture(scope="module")
def workload(tiny_llama):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, greedy_references(str(tiny_llama), prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    with running_cluster(str(tiny_llama), 1, 1, router_args=("--stream-interval", str(INTERVAL))) as running:
        yield running


def greedy(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def grpc_streams(router: str, prompts, new_tokens) -> list[list[list[int]]]:
    """Each stream's responses, as the token ids each carried."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(prompt, n):
            return [list(r.token_ids) async for r in stub.Generate(greedy(prompt, n), timeout=120)]

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, new_tokens)))


def assert_bursts(sizes: list[int], total: int) -> None:
    """Token 1 alone (the prefill node's), the decode node's first event at once (with any token
    that waited behind it), then at least INTERVAL tokens to a response but the last."""
    assert sum(sizes) == total and min(sizes) >= 1
    assert sizes[0] == 1
    assert all(size >= INTERVAL for size in sizes[2:-1]), sizes


def test_grpc_streams_are_token_exact_in_bursts_of_the_interval(cluster, workload):
    prompts, refs = workload
    streams = asyncio.run(grpc_streams(cluster.router, prompts, NEW_TOKENS))
    assert_matches([[t for response in s for t in response] for s in streams], refs)
    for stream, n in zip(streams, NEW_TOKENS):
        assert_bursts([len(response) for response in stream], n)
    assert len(streams[0]) < NEW_TOKENS[0]  # fewer responses than tokens
    cluster.wait_all_blocks_free()


def test_http_stream_is_token_exact_in_bursts_of_the_interval(cluster, workload, tiny_llama):
    prompts, refs = workload
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    body = json.dumps({"model": "llama", "prompt": prompts[0], "max_tokens": NEW_TOKENS[0], "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": 0}).encode()
    request = urllib.request.Request(f"{cluster.state.http}/completions", body,
                                     {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]]
    assert_bursts([s for s in sizes if s], NEW_TOKENS[0])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == tokenizer.decode(refs[0].token_ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    cluster.wait_all_blocks_free()
