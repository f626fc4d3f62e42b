"""Overload is refused at once with RESOURCE_EXHAUSTED, at the router and at each node.

One cluster (router + 1 prefill + 1 decode node on 127.0.0.1) with small bounds: the
router admits 2 sequences at a time, the prefill node (one request at a time, every
step slowed to 0.1 s) queues 2 requests, the decode node holds 4 reservations waiting
for KV (so in the first test the router's own limit is what refuses). Beyond each bound
the caller gets RESOURCE_EXHAUSTED without waiting; what was admitted comes out
token-exact; nothing but OK and RESOURCE_EXHAUSTED appears; every node ends with no
used or reserved block. Timings are printed, never asserted.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until

from ..integration.reference import assert_matches, greedy_references
from .outcomes import greedy_request, held_blocks, outcome_of, wait_idle

BLOCK_SIZE = 8
ROUTER_LIMIT = 2
PREFILL_WAITING_LIMIT = 2
DECODE_WAITING_LIMIT = 4
LEASE_S = 30.0  # long: a cancelled reservation is freed at once, never at its lease
SEED = 3


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    lease = ("--lease-s", str(LEASE_S))
    with running_cluster(
        model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE, max_num_batched_tokens=16),
        router_args=("--max-inflight-requests", str(ROUTER_LIMIT)),
        prefill_args=(*lease, "--max-num-seqs", "1", "--max-waiting-requests", str(PREFILL_WAITING_LIMIT),
                      "--debug-step-delay-s", "0.1"),
        decode_args=(*lease, "--max-waiting-requests", str(DECODE_WAITING_LIMIT)),
    ) as cluster:
        yield cluster


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def assert_idle(cluster) -> None:
    assert held_blocks(wait_idle(cluster)) == [("prefill", 0, 0), ("decode", 0, 0)]


def test_the_router_refuses_beyond_its_limit_and_serves_what_it_admitted_exactly(cluster, model_dir):
    prompts = [prompt(12 + i, 100 + i) for i in range(16)]

    async def timed(stub, p):
        start = time.monotonic()
        outcome = await outcome_of(stub.Generate(greedy_request(p, 8), timeout=120))
        return outcome, time.monotonic() - start

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(timed(stub, p) for p in prompts))

    results = asyncio.run(scenario())
    codes = [o.code for o, _ in results]
    admitted = [i for i, code in enumerate(codes) if code is grpc.StatusCode.OK]
    rejected = [i for i, code in enumerate(codes) if code is grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(admitted) + len(rejected) == len(prompts), codes
    assert len(admitted) >= ROUTER_LIMIT and rejected
    assert all("router is at capacity" in results[i][0].details for i in rejected)
    refs = greedy_references(model_dir, [prompts[i] for i in admitted], [8] * len(admitted))
    assert_matches([results[i][0].token_ids for i in admitted], refs)
    print(f"admitted {len(admitted)}, rejected {len(rejected)}; median latency: rejected "
          f"{statistics.median(results[i][1] for i in rejected) * 1e3:.1f} ms, admitted "
          f"{statistics.median(results[i][1] for i in admitted) * 1e3:.1f} ms")
    assert_idle(cluster)


def test_http_requests_beyond_the_limit_get_429_with_retry_after(cluster, model_dir):
    prompts = [prompt(12 + i, 200 + i) for i in range(12)]
    http = openai.AsyncOpenAI(base_url=cluster.state.http, api_key="unused", max_retries=0)

    async def one(p):
        try:
            answer = await http.completions.create(model="llama", prompt=p, max_tokens=8, temperature=0,
                                                   extra_body={"ignore_eos": True})
            return 200, answer.choices[0].text, None
        except openai.RateLimitError as refused:
            return refused.status_code, refused.body["code"], refused.response.headers.get("retry-after")

    async def scenario():
        async with http:
            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(scenario())
    admitted = [i for i, r in enumerate(results) if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert len(admitted) >= ROUTER_LIMIT and refused
    assert set(refused) == {(429, "RESOURCE_EXHAUSTED", "1")}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    refs = greedy_references(model_dir, [prompts[i] for i in admitted], [8] * len(admitted))
    assert [results[i][1] for i in admitted] == [tokenizer.decode(r.token_ids) for r in refs]
    assert_idle(cluster)


def params(max_tokens: int) -> pdserve_pb2.SamplingParams:
    return pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def decode_call(stub, req_id: str, tokens: list[int], max_tokens: int):
    return stub.Decode(node_pb2.SampleRequest(request_id=req_id, prompt_token_ids=tokens,
                                              sampling_params=params(max_tokens), seed=SEED), timeout=60)


def prefill_call(stub, req_id: str, tokens: list[int], max_tokens: int, ready: node_pb2.Ready, decode_address: str):
    return stub.Prefill(node_pb2.PrefillRequest(request_id=req_id, prompt_token_ids=tokens,
                                                sampling_params=params(max_tokens), seed=SEED,
                                                decode_kv_layout_id=ready.kv_layout_id, decode_address=decode_address,
                                                decode_block_ids=ready.block_ids), timeout=60)


async def prefill_node_stats(stub) -> node_pb2.NodeStats:
    return await stub.GetStats(node_pb2.StatsRequest(), timeout=10)


async def stats_reach(stub, predicate) -> bool:
    return predicate(await prefill_node_stats(stub))


async def rest_of(call) -> list[int]:
    tokens = []
    while (event := await call.read()) is not grpc.aio.EOF:
        tokens += event.tokens.token_ids
    return tokens


def test_a_full_prefill_queue_refuses_at_once(cluster, model_dir):
    prompts = {"running": prompt(160, 1), "queued-0": prompt(10, 2), "queued-1": prompt(11, 3),
               "refused": prompt(12, 4)}
    served = ["running", "queued-0", "queued-1"]

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.decode[0]) as d, \
                grpc.aio.insecure_channel(cluster.prefill[0]) as p:
            decode, prefill = node_pb2_grpc.DecodeNodeStub(d), node_pb2_grpc.PrefillNodeStub(p)
            calls = {name: decode_call(decode, name, tokens, 4) for name, tokens in prompts.items()}
            ready = {name: (await call.read()).ready for name, call in calls.items()}
            firsts = {}
            for name, (field, count) in zip(served, (("num_running", 1), ("num_waiting", 1), ("num_waiting", 2))):
                firsts[name] = asyncio.ensure_future(prefill_call(prefill, name, prompts[name], 4, ready[name],
                                                                    cluster.decode[0]))
                await until(lambda: stats_reach(prefill, lambda s: getattr(s, field) == count), 30, interval_s=0.02)
            try:
                await prefill_call(prefill, "refused", prompts["refused"], 4, ready["refused"], cluster.decode[0])
                refusal = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as exc:
                refusal = (exc.code(), exc.details())
            calls["refused"].cancel()  # what the router does when no prefill node takes it
            outputs = [[(await firsts[name]).first_token_id, *await rest_of(calls[name])] for name in served]
            return refusal, outputs

    (code, details), outputs = asyncio.run(scenario())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == f"queue full: {PREFILL_WAITING_LIMIT} requests waiting (limit {PREFILL_WAITING_LIMIT})"
    assert_matches(outputs, greedy_references(model_dir, [prompts[name] for name in served], [4] * len(served)))
    assert_idle(cluster)


def test_a_decode_node_with_its_reservations_full_refuses_at_once(cluster):
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.decode[0]) as d:
            decode = node_pb2_grpc.DecodeNodeStub(d)
            held = [decode_call(decode, f"held-{i}", prompt(9, 10 + i), 4) for i in range(DECODE_WAITING_LIMIT)]
            for call in held:
                assert (await call.read()).WhichOneof("event") == "ready"
            try:
                await decode_call(decode, "one-too-many", prompt(9, 20), 4).read()
                refusal = (grpc.StatusCode.OK, "")
            except grpc.aio.AioRpcError as exc:
                refusal = (exc.code(), exc.details())
            for call in held:
                call.cancel()  # freed at once: no push can land once the write permit is revoked
            return refusal

    code, details = asyncio.run(scenario())
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == f"queue full: {DECODE_WAITING_LIMIT} requests waiting (limit {DECODE_WAITING_LIMIT})"
    assert_idle(cluster)
