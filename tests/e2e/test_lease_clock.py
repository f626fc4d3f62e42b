"""Leases bound only unacknowledged transfers, under `pdserve cluster`: a 3000-token prompt behind
a deep prefill queue, on nodes whose `--lease-s` is far shorter than the prefill takes, completes
exactly, with no transfer failed and every block free after. (The prefill node's lease runs only
while a push is unacknowledged; it renews the decode node's reservation while it queues and
computes the prompt: pdserve/node/core/lease.py.)
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, assert_every_block_free, running_cluster
from tests.e2e.outcomes import greedy_params, random_prompt
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LEASE_S = 1.0
# 64 prompt tokens a step, each step at least 50 ms longer: the queue ahead and the long prompt
# take at least 4600 / 64 * 0.05 = 3.6 s of prefill, several leases.
STEP_DELAY_S = 0.05
LONG_PROMPT = random_prompt(3000, 11)
QUEUE = [random_prompt(400, 20 + i) for i in range(4)]
MAX_TOKENS = 4
RPC_TIMEOUT_S = 300.0


def generate(router: str, ids: list[int]) -> list[int]:
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids), sampling_params=greedy_params(MAX_TOKENS))
    with grpc.insecure_channel(router) as channel:
        responses = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        return [token for response in responses for token in response.token_ids]


def test_a_long_prompt_behind_a_deep_prefill_queue_outlives_a_short_lease(tiny_llama):
    model_dir = str(tiny_llama)
    lease = ("--lease-s", str(LEASE_S))
    settings = NodeSettings(num_blocks=1024)  # the long prompt's 375 blocks, with the queue's
    with running_cluster(model_dir, 1, 1, settings, prefill_args=(*lease, "--debug-step-delay-s", str(STEP_DELAY_S)),
                         decode_args=lease) as cluster:
        prompts = [*QUEUE, LONG_PROMPT]  # submitted together: the long one shares the prefill with the queue
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda ids: generate(cluster.router, ids), prompts))
        assert_matches(outputs, greedy_references(model_dir, prompts, [MAX_TOKENS] * len(prompts)))
        prefill, decode = cluster.stats()
        assert (prefill.kv_transfer.failures, decode.kv_transfer.failures) == (0, 0)
        assert_every_block_free(cluster)
