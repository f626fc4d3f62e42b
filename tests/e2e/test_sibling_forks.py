"""n > 1 through a real `pdserve cluster`: the samples that reach one node fork off each other there.

On a colocated cluster and on 1P1D, seeded requests with n = 3 (a prompt whose last block is
partial) give exactly the offline `LLM`'s tokens for every sample; the node that computes the
prompts reports forked samples in its stats (`forked_samples`), and every node ends with zero
blocks in use. A short delay after each step lets the router's n sends (nearly at once) queue up
at the node, so siblings arrive while sample 0 still waits for its prefill.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, running_cluster

BLOCK_SIZE = 8
PROMPT_LENS = [150, 45]  # 18 full blocks + 6 tokens, 5 + 5: the partial last block is shared
N = 3
PARAMS = dict(n=N, temperature=0.8, top_p=0.95, seed=17, max_tokens=10, ignore_eos=True)
SLOW_STEPS = ("--debug-step-delay-s", "0.05")


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(14)
    return [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def offline(model_dir, prompts) -> list[dict[int, list[int]]]:
    """Each prompt's samples from the offline `LLM`, which forks them in one engine."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE)
    outputs = llm.generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)
    return [{s.index: s.token_ids for s in out.outputs} for out in outputs]


@pytest.fixture(scope="module", params=["colocated", "1P1D"])
def cluster(request, model_dir):
    settings = NodeSettings(block_size=BLOCK_SIZE)
    if request.param == "colocated":
        with running_cluster(model_dir, 0, 0, settings, num_colocated=1, colocated_args=SLOW_STEPS) as running:
            yield running
    else:
        with running_cluster(model_dir, 1, 1, settings, prefill_args=SLOW_STEPS) as running:
            yield running


async def generate_all(router: str, prompts: list[list[int]]) -> list[list[pdserve_pb2.GenerateResponse]]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> list[pdserve_pb2.GenerateResponse]:
            request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt),
                                                  sampling_params=pdserve_pb2.SamplingParams(**PARAMS))
            return [r async for r in stub.Generate(request, timeout=120)]

        return await asyncio.gather(*(one(p) for p in prompts))


def test_n_samples_fork_on_the_node_and_draw_the_offline_tokens(cluster, prompts, offline):
    (computing,) = cluster.names("colocated") or cluster.names("prefill")  # the node that computes prompts
    before = cluster.stats(computing).forked_samples
    responses = asyncio.run(generate_all(cluster.router, prompts))
    for got, want in zip(responses, offline):
        tokens = {i: [t for r in got if r.index == i for t in r.token_ids] for i in range(N)}
        assert tokens == want
        assert len({tuple(t) for t in want.values()}) == N  # the samples really differ
    stats = cluster.wait_all_blocks_free(timeout_s=10)
    assert [s.used_blocks for s in stats] == [0] * len(stats)
    assert [s.reserved_blocks for s in stats] == [0] * len(stats)
    # A sample forks off its sibling when it reaches the node before the sibling's prefill step:
    # the step delay lets the n sends queue up behind a running step, so some of them did. How
    # many depends on arrival timing, which a loaded machine stretches: at least one, never more
    # than every request's samples 1..n-1.
    forked = cluster.stats(computing).forked_samples - before
    assert 1 <= forked <= (N - 1) * len(prompts)
