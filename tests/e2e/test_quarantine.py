"""A decode node frees a reservation whose KV can no longer come at once, not after 3 leases.

Router + 2 prefill + 1 decode processes on 127.0.0.1 with a long lease (60 s: a 3-lease
quarantine would hold the blocks for 3 minutes). Each prefill node runs one request at
a time with one more waiting, every step slowed so that a long prompt prefills for
seconds.

- Reserved, then cancelled before any Prefill: the decode node holds nothing within
  seconds. A late Prefill for that id (what a partitioned prefill node would send) is
  answered, but none of its pushes is placed, and the id is refused as a new reservation.
- Every prefill node's queue full: the router refuses RESOURCE_EXHAUSTED, having never
  sent a Prefill for the reservation it made; the admitted requests come out exact, and
  then the decode node holds nothing within seconds.
- A prefill node SIGKILLed while its pushes land: the request is retried on the other
  one and comes out exact, and the decode node holds nothing within seconds.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2_grpc

from tests.e2e.cluster import FaultCluster, FaultSettings, assert_no_blocks_held
from tests.e2e.outcomes import decode_request, greedy_request, outcome_of, prefill_request, random_prompt
from tests.integration.reference import assert_matches, greedy_references
from pdserve.testing.waiting import wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LEASE_S = 60.0
FREED_S = 10.0  # how long the test polls for zero blocks; a 3-lease quarantine needs 180 s
LONG_PROMPT = 320  # tokens: 20 prefill steps of 16 at 0.15 s each
SEED = 5
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=LEASE_S, heartbeat_timeout_s=3.0,
                         prefill_step_delay_s=0.15,
                         # The later --max-num-seqs wins over the cluster's default.
                         prefill_args=("--max-num-seqs", "1", "--max-waiting-requests", "1"))


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with FaultCluster(model_dir, tmp_path_factory.mktemp("logs"), 2, 1, SETTINGS) as running:
        yield running


def held(stats: node_pb2.NodeStats) -> tuple[int, int]:
    return stats.used_blocks, stats.reserved_blocks


def prefill_load(cluster: FaultCluster) -> int:
    """Requests running or waiting on the live prefill nodes."""
    stats = [cluster.stats(n) for n in cluster.live_nodes() if n.startswith("prefill")]
    return sum(s.num_running + s.num_waiting for s in stats)


def test_a_reservation_cancelled_before_any_prefill_is_freed_at_once(cluster, model_dir):
    tokens = random_prompt(40, seed=1)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.address("decode-0")) as d, \
                grpc.aio.insecure_channel(cluster.address("prefill-0")) as p:
            decode = node_pb2_grpc.DecodeNodeStub(d)
            call = decode.Decode(decode_request(SEED, "no-prefill", tokens, 8), timeout=60)
            ready = (await call.read()).ready
            reserved = await asyncio.to_thread(cluster.stats, "decode-0")
            call.cancel()  # what the router does when it sends no Prefill
            freed = await asyncio.to_thread(cluster.wait_no_blocks, FREED_S)
            placed = (await asyncio.to_thread(cluster.stats, "decode-0")).kv_transfer.transfers
            late_request = prefill_request(SEED, "no-prefill", tokens, 8, ready, cluster.address("decode-0"))
            late = await node_pb2_grpc.PrefillNodeStub(p).Prefill(late_request, timeout=60)
            after = await asyncio.to_thread(cluster.stats, "decode-0")
            try:
                await decode.Decode(decode_request(SEED, "no-prefill", tokens, 8), timeout=60).read()
                reuse = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                reuse = exc.code()
            return ready, reserved, freed, placed, late, after, reuse

    ready, reserved, freed, placed, late, after, reuse = asyncio.run(scenario())
    assert len(ready.block_ids) == 5 and held(reserved) == (5, 5)
    assert all(h == (0, 0) for h in freed.values()), freed
    # The late prefill ran and was answered; the decode node placed none of its pushes.
    assert_matches([[late.first_token_id]], greedy_references(model_dir, [tokens], [1]))
    assert after.kv_transfer.transfers == placed and held(after) == (0, 0)
    assert reuse is grpc.StatusCode.INVALID_ARGUMENT  # the id is retired, not reusable
    assert_no_blocks_held(cluster, FREED_S)


def test_a_request_every_prefill_node_refuses_leaves_no_reservation_behind(cluster, model_dir):
    # 2 prefill nodes x (1 running + 1 waiting)
    admitted_prompts = [random_prompt(LONG_PROMPT, seed=10 + i) for i in range(4)]
    refused_prompt = random_prompt(24, seed=20)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            admitted = []
            for i, tokens in enumerate(admitted_prompts):
                admitted.append(asyncio.ensure_future(outcome_of(stub.Generate(greedy_request(tokens, 4),
                                                                                timeout=120))))
                await asyncio.to_thread(wait_until, lambda n=i + 1: prefill_load(cluster) == n,
                                        f"{i + 1} requests are on the prefill nodes")
            refused = await outcome_of(stub.Generate(greedy_request(refused_prompt, 4), timeout=120))
            return refused, [await a for a in admitted]

    refused, admitted = asyncio.run(scenario())
    assert refused.code is grpc.StatusCode.RESOURCE_EXHAUSTED, (refused.code, refused.details)
    assert "every prefill node's queue is full" in refused.details, refused.details
    assert [o.code for o in admitted] == [grpc.StatusCode.OK] * 4, [(o.code, o.details) for o in admitted]
    assert_matches([o.token_ids for o in admitted], greedy_references(model_dir, admitted_prompts, [4] * 4))
    assert_no_blocks_held(cluster, FREED_S)


def test_a_prefill_node_killed_mid_transfer_is_retried_and_its_reservation_freed_at_once(cluster, model_dir):
    tokens = random_prompt(LONG_PROMPT, seed=2)
    ref = greedy_references(model_dir, [tokens], [12])
    placed_before = cluster.stats("decode-0").kv_transfer.transfers

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stream = asyncio.ensure_future(outcome_of(pdserve_pb2_grpc.GenerationStub(channel).Generate(
                greedy_request(tokens, 12), timeout=120)))
            await asyncio.to_thread(wait_until, lambda: cluster.stats("decode-0").kv_transfer.transfers > placed_before,
                                    "a push landed on the decode node")
            victim = next(n for n in cluster.live_nodes() if n.startswith("prefill") and cluster.stats(n).num_running)
            cluster.kill(victim)
            return await stream, victim

    outcome, victim = asyncio.run(scenario())
    assert outcome.code is grpc.StatusCode.OK, (outcome.code, outcome.details)
    assert_matches([outcome.token_ids], ref)
    assert victim not in cluster.live_nodes()
    assert_no_blocks_held(cluster, FREED_S)
