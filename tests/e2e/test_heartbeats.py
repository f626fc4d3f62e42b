"""A node whose engine core is stuck in a long step keeps its place in the router.

The prefill node's core is slowed on purpose (`--debug-step-delay-s 5`: one step holds
the core for five seconds) and the router drops nodes silent for two seconds. While a
request's single prefill step runs, the router must keep listing the prefill node (its
heartbeats carry the snapshot the core pushed, without asking the busy core), the
node's GetStats must still answer, and the request must end exactly, with every block
freed.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

from ..integration.reference import assert_matches, greedy_references
from .outcomes import greedy_request, held_blocks, outcome_of, wait_idle

STEP_DELAY_S = 5.0
HEARTBEAT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def test_a_core_busy_for_longer_than_the_heartbeat_timeout_keeps_its_node_registered(model_dir):
    prompt = [random.Random(0).randrange(1, 900) for _ in range(12)]
    router_args = ("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
    prefill_args = ("--debug-step-delay-s", str(STEP_DELAY_S))

    async def scenario(cluster):
        async with grpc.aio.insecure_channel(cluster.router) as channel, \
                grpc.aio.insecure_channel(cluster.prefill[0]) as prefill_channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            ending = asyncio.create_task(outcome_of(stub.Generate(greedy_request(prompt, 3), timeout=60)))
            health, answered = [], 0
            while not ending.done():
                health.append((await stub.Health(pdserve_pb2.HealthRequest(), timeout=5)).prefill_nodes)
                await node_pb2_grpc.PrefillNodeStub(prefill_channel).GetStats(node_pb2.StatsRequest(), timeout=5)
                answered += 1
                await asyncio.sleep(0.1)
            return health, answered, await ending

    with running_cluster(model_dir, 1, 1, NodeSettings(), router_args=router_args,
                         prefill_args=prefill_args) as cluster:
        health, answered, outcome = asyncio.run(scenario(cluster))
        stats = wait_idle(cluster)
        router_log = cluster.log("router")

    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert_matches([outcome.token_ids], greedy_references(model_dir, [prompt], [3]))
    # The request spanned at least one 5 s step (longer than the heartbeat timeout): the
    # node was listed at every poll, and the router never dropped it (one registration).
    assert health and set(health) == {1}, health
    assert "dropping prefill node" not in router_log
    assert router_log.count("registered prefill node") == 1
    assert answered == len(health)
    assert held_blocks(stats) == [("prefill", 0, 0), ("decode", 0, 0)]
