"""Prompt logprobs through a real `pdserve cluster`: disaggregated (1P1D) and colocated.

The prefill node (or the colocated node) scores the prompt while it computes it, in chunks
(prompts longer than max_num_batched_tokens); the client gets every prompt token after the
first, with its top alternatives, on sample 0's first response — equal in float32 to
transformers' log_softmax of the same forward within 1e-5 — and the greedy tokens stay
exact. Every test ends with every node's blocks free.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from pdserve.engine.model_loader import load_reference_model
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, running_cluster

from ..integration.reference import assert_matches, greedy_references

TOLERANCE = 1e-5
CHUNK = 64
PROMPT_LENS = [150, 70, 9]  # two prompts chunked by CHUNK, one that is not
NEW_TOKENS = [6, 4, 3]
TOPS = [3, 0, 5]


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    model = load_reference_model(model_dir, torch.float32)
    with torch.inference_mode():
        logprobs = [model(torch.tensor([p])).logits[0].float().log_softmax(dim=-1) for p in prompts]
    return prompts, logprobs, greedy_references(model_dir, prompts, NEW_TOKENS)


def request(prompt: list[int], max_tokens: int, k: int, **params) -> pdserve_pb2.GenerateRequest:
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(max_tokens=max_tokens, prompt_logprobs=k, **params),
    )


async def generate_all(router: str, requests) -> list[list[pdserve_pb2.GenerateResponse]]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(req):
            return [r async for r in stub.Generate(req, timeout=120)]

        return await asyncio.gather(*(one(r) for r in requests))


def assert_prompt_logprobs(entries, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]
    for i, entry in enumerate(entries, 1):
        row = ref[i - 1]  # position i-1 scores prompt token i
        assert abs(entry.logprob - row[prompt[i]].item()) <= TOLERANCE, f"prompt token {i}"
        expected = row.topk(k).values.tolist()
        assert len(entry.top) == k
        assert all(abs(t.logprob - e) <= TOLERANCE for t, e in zip(entry.top, expected)), f"top of prompt token {i}"
        assert all(abs(t.logprob - row[t.token_id].item()) <= TOLERANCE for t in entry.top)


def check_workload(router: str, workload) -> None:
    prompts, logprobs, refs = workload
    streams = asyncio.run(generate_all(router, [request(p, n, k) for p, n, k in zip(prompts, NEW_TOKENS, TOPS)]))
    assert_matches([[t for r in s for t in r.token_ids] for s in streams], refs)
    for stream, prompt, ref, k in zip(streams, prompts, logprobs, TOPS):
        assert stream[0].token_ids  # the first response carries token 1 and the prompt's logprobs
        assert_prompt_logprobs(stream[0].prompt_logprobs, ref, prompt, k)
        assert not any(r.prompt_logprobs for r in stream[1:])


def check_n_samples(router: str, workload) -> None:
    prompts, logprobs, _ = workload
    req = request(prompts[1], 4, 2, temperature=1.0, n=2, seed=3)
    (stream,) = asyncio.run(generate_all(router, [req]))
    with_prompt = [r for r in stream if r.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0].index == 0
    assert_prompt_logprobs(with_prompt[0].prompt_logprobs, logprobs[1], prompts[1], 2)


def test_disaggregated_prefill_node_scores_the_prompt(model_dir, workload):
    with running_cluster(model_dir, 1, 1, NodeSettings(max_num_batched_tokens=CHUNK)) as cluster:
        check_workload(cluster.router, workload)
        check_n_samples(cluster.router, workload)
        assert [s.used_blocks for s in cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]


def test_colocated_node_scores_the_prompt(model_dir, workload):
    with running_cluster(model_dir, 0, 0, NodeSettings(max_num_batched_tokens=CHUNK), num_colocated=1) as cluster:
        check_workload(cluster.router, workload)
        check_n_samples(cluster.router, workload)
        assert [s.used_blocks for s in cluster.wait_all_blocks_free(timeout_s=5)] == [0]
