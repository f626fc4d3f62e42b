"""Preemption by swap on a real node process: a colocated node whose KV pool is too small for the
load swaps preempted requests out to the host and back, and every stream stays token-exact.

The node runs `--preemption-mode swap` with a swap space of `SWAP_BLOCKS` blocks and a device pool
of `NUM_BLOCKS`, far fewer than the concurrent requests need at once. The streams equal
transformers' greedy tokens; the node reports swaps out and in (NodeStats) equal in number; and it
ends with no block used in either pool. (A 1P1D cluster does not preempt under the same load: the
router reserves each request's whole KV on a decode node before its prefill, and refuses with
RESOURCE_EXHAUSTED what no decode node can hold; the engine's swap on those node kinds is proven
in tests/unit/test_scheduler_swap.py and tests/integration/test_swap_preemption.py.)
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch

from pdserve.proto import pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, running_cluster

from ..integration.reference import assert_matches, greedy_references
from .outcomes import greedy_request

BLOCK_SIZE = 8
NUM_BLOCKS = 24  # one request needs up to 10; eight at once need 80
SWAP_BLOCKS = 64
PROMPT_LENS = [30, 41, 22, 35, 28, 39, 25, 33]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def swap_flags(model_dir: str) -> tuple[str, ...]:
    from pdserve.engine.model_loader import load_model
    from pdserve.engine.model_runner import kv_block_bytes

    block_bytes = kv_block_bytes(load_model(model_dir, torch.float32), BLOCK_SIZE, torch.float32)
    return ("--preemption-mode", "swap", "--swap-space-bytes", str(SWAP_BLOCKS * block_bytes))


@pytest.fixture(scope="module")
def cluster(model_dir):
    settings = NodeSettings(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    with running_cluster(model_dir, 0, 0, settings, num_colocated=1, colocated_args=swap_flags(model_dir)) as running:
        yield running


async def generate_all(router: str, prompts: list[list[int]]) -> list[list[int]]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(prompt: list[int]) -> list[int]:
            return [t async for r in stub.Generate(greedy_request(prompt, NEW_TOKENS), timeout=180)
                    for t in r.token_ids]
        return await asyncio.gather(*(one(p) for p in prompts))


def test_swapped_requests_stream_exact_tokens_and_leave_both_pools_empty(cluster, model_dir):
    rng = random.Random(21)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    outputs = asyncio.run(generate_all(cluster.router, prompts))
    assert_matches(outputs, greedy_references(model_dir, prompts, [NEW_TOKENS] * len(prompts)))
    (node,) = cluster.wait_all_blocks_free(timeout_s=30)
    assert (node.used_blocks, node.used_swap_blocks, node.num_swapped) == (0, 0, 0)
    assert node.swaps_out > 0 and node.swaps_in == node.swaps_out
