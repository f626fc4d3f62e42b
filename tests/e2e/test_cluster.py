"""The product end to end: router + prefill + decode processes on 127.0.0.1, KV over UCX.

Greedy float32 output of every streamed request is token-identical to transformers;
token 1 comes from the prefill node; the KV bytes that crossed the transport equal the
prompts' blocks exactly; every node ends with zero blocks in use; cancelling a stream
frees every block before a shorter stream beside it ends.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import grpc
import pytest
import torch

from pdserve.engine.model_loader import load_model
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import wait_until

from ..integration.reference import assert_matches, greedy_references
from tests.e2e.cluster import NodeSettings, running_cluster

BLOCK_SIZE = 8
PROMPT_LENS = [1, 5, 8, 9, 17, 30, 47, 64, 65, 90, 120, 150, 33, 2, 77, 200]
NEW_TOKENS = [12, 20, 8, 16, 24, 5, 20, 12, 16, 1, 20, 8, 16, 20, 12, 24]


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, greedy_references(model_dir, prompts, NEW_TOKENS)


def kv_bytes_per_block(model_dir: str) -> int:
    loaded = load_model(model_dir, torch.float32)
    return 2 * loaded.num_layers * loaded.num_kv_heads * BLOCK_SIZE * loaded.head_dim * 4


async def stream_one(stub, prompt: list[int], max_tokens: int) -> list[pdserve_pb2.GenerateResponse]:
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    return [r async for r in stub.Generate(request, timeout=120)]


async def run_concurrently(router: str, prompts, new_tokens):
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(stream_one(stub, p, n) for p, n in zip(prompts, new_tokens)))


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 1), (2, 2)])
def test_disaggregated_greedy_is_token_exact(model_dir, workload, num_prefill, num_decode):
    prompts, refs = workload
    with running_cluster(model_dir, num_prefill, num_decode, NodeSettings(block_size=BLOCK_SIZE)) as cluster:
        streams = asyncio.run(run_concurrently(cluster.router, prompts, NEW_TOKENS))
        outputs = [[t for r in stream for t in r.token_ids] for stream in streams]
        assert_matches(outputs, refs)

        block_bytes = kv_bytes_per_block(model_dir)
        for prompt, stream in zip(prompts, streams):
            last = stream[-1]
            assert last.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
            # Token 1 came from a prefill node, which moved exactly the prompt's blocks.
            assert last.timings.prefill_s > 0
            assert last.timings.kv_transfer_bytes == -(-len(prompt) // BLOCK_SIZE) * block_bytes
            assert last.usage.prompt_tokens == len(prompt)

        stats = cluster.wait_all_blocks_free(timeout_s=5)
        assert [s.used_blocks for s in stats] == [0] * (num_prefill + num_decode)
        expected = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) * block_bytes
        sent = sum(s.kv_transfer.bytes for s in stats if s.kind == "prefill")
        received = sum(s.kv_transfer.bytes for s in stats if s.kind == "decode")
        assert sent == expected
        # Token 1 leaves the prefill node before its KV: a request that token 1 ends (max_tokens
        # 1) has its decode reservation cancelled at once, and what of its KV was still on the
        # way is dropped there. Every other request's KV landed whole.
        one_token = sum(-(-len(p) // BLOCK_SIZE) for p, n in zip(prompts, NEW_TOKENS) if n == 1) * block_bytes
        assert expected - one_token <= received <= expected
        if num_decode > 1:
            assert all(s.kv_transfer.transfers > 0 for s in stats), "every node took part"


@pytest.fixture(scope="module")
def small_cluster(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE)) as cluster:
        yield cluster


def test_generate_cli_json(small_cluster, workload):
    prompts, refs = workload
    for i in (3, 10):
        ids = ",".join(str(t) for t in prompts[i])
        result = subprocess.run(
            [sys.executable, "-m", "pdserve", "generate", "--addr", small_cluster.router, "--json",
             "--token-ids", ids, "--max-tokens", str(NEW_TOKENS[i]), "--temperature", "0", "--ignore-eos"],
            capture_output=True, text=True, timeout=120,
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["token_ids"] == refs[i].token_ids
        assert out["finish_reason"] == "length"
    assert [s.used_blocks for s in small_cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]


def greedy_request(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


def decode_stats_when(cluster, predicate, timeout_s: float = 60.0):
    """Poll the decode node's stats until `predicate` holds; those stats."""
    def decode_stats():
        return next(s for s in cluster.stats() if s.kind == "decode")

    def reached():
        stats = decode_stats()
        return stats if predicate(stats) else None

    return wait_until(reached, lambda: f"the decode node reaches the state: {decode_stats()}", timeout_s)


async def read_into(call, tokens: list[int]) -> None:
    """Append the stream's tokens as they come, until it ends."""
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens += response.token_ids


@pytest.fixture(scope="module")
def paced_cluster(model_dir):
    """1P1D whose decode steps take at least 10 ms: `beside` below decodes for 5 s or more, time
    enough to read the decode node's stats while it runs, whatever the machine's load."""
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE),
                         decode_args=("--debug-step-delay-s", "0.01")) as cluster:
        yield cluster


def test_cancel_mid_stream_frees_every_block_before_a_shorter_stream_beside_it_ends(paced_cluster, workload):
    # The cancelled stream has 1000 tokens to generate; `beside` joins it with 500. Both decode
    # one token per step, so had the cancel freed nothing, the cancelled one would outlive `beside`.
    # Together they fit the decode node's 256 blocks of 8 (150 + 63): no preemption muddles the count.
    prompts, _ = workload

    async def cancel_after_three():
        async with grpc.aio.insecure_channel(paced_cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(greedy_request(prompts[15], 1000), timeout=120)
            seen = [await call.read() for _ in range(3)]
            beside = stub.Generate(greedy_request(prompts[0], 500), timeout=120)
            beside_tokens: list[int] = []
            while len(beside_tokens) < 2:  # token 2 is the decode node's: `beside` runs there now
                beside_tokens += (await beside.read()).token_ids
            reading = asyncio.create_task(read_into(beside, beside_tokens))
            call.cancel()
            # Exactly one: a snapshot the node pushed before `beside` (or even the cancelled
            # stream) was admitted may still be the latest; it must not pass for "alone".
            alone = await asyncio.to_thread(decode_stats_when, paced_cluster,
                                            lambda s: s.num_running + s.num_waiting == 1)
            beside_was_running = not reading.done()
            await reading
            return seen, alone, beside_was_running, len(beside_tokens)

    seen, alone, beside_was_running, num_beside = asyncio.run(cancel_after_three())
    assert all(r.finish_reason == pdserve_pb2.FINISH_REASON_UNSPECIFIED for r in seen)
    assert (alone.num_running, alone.num_waiting) == (1, 0) and beside_was_running
    assert num_beside == 500  # `beside` ran to its end
    assert [s.used_blocks for s in paced_cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]


def test_seeded_sampling_with_n_and_logprobs_matches_the_offline_engine(small_cluster, model_dir, workload):
    """Same seed, same tokens, whichever topology samples them (token 1 on P, the rest on D)."""
    from pdserve import LLM, SamplingParams

    prompts, _ = workload
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, seed=5, max_tokens=12, logprobs=2, ignore_eos=True)
    offline = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE).generate([prompts[6]], params, use_tqdm=False)[0]

    async def generate():
        async with grpc.aio.insecure_channel(small_cluster.router) as channel:
            request = pdserve_pb2.GenerateRequest(
                token_ids=pdserve_pb2.TokenIds(ids=prompts[6]),
                sampling_params=pdserve_pb2.SamplingParams(
                    n=2, temperature=0.8, top_p=0.95, seed=5, max_tokens=12, logprobs=2, ignore_eos=True
                ),
            )
            return [r async for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]

    responses = asyncio.run(generate())
    for sample in offline.outputs:
        mine = [r for r in responses if r.index == sample.index]
        assert [t for r in mine for t in r.token_ids] == sample.token_ids
        logprobs = [lp for r in mine for lp in r.logprobs]
        assert [lp.token_id for lp in logprobs] == sample.token_ids
        for got, want in zip(logprobs, sample.logprobs):
            assert got.logprob == pytest.approx(want.token_logprob, abs=1e-4)
            assert [t.token_id for t in got.top] == want.top_token_ids
    assert offline.outputs[0].token_ids != offline.outputs[1].token_ids
    assert [s.used_blocks for s in small_cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]
