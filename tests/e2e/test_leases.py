"""Leases free what a vanished peer would otherwise hold forever, with exact statuses.

Real prefill and decode node processes (and a router, unused here: the test plays the
router and calls the nodes itself) with a short lease. A decode reservation whose KV
never comes ends DEADLINE_EXCEEDED and its blocks come back; a prefill whose pushes the
decode node never acknowledges (the decode node is frozen with SIGSTOP) still answers
token 1 when it is sampled (the KV follows it), and the prefill node's lease fails the
transfer and frees its blocks while the decode node is still frozen. Afterwards both nodes hold nothing and serve an exact request again.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.testing.waiting import settled
from pdserve.proto import node_pb2, node_pb2_grpc

from ..integration.reference import assert_matches, greedy_references
from .outcomes import decode_request, held_blocks, prefill_request, random_prompt, wait_idle

BLOCK_SIZE = 8
LEASE_S = 1.5
SEED = 7


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    lease = ("--lease-s", str(LEASE_S))
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=BLOCK_SIZE), prefill_args=lease,
                         decode_args=lease) as cluster:
        yield cluster


async def stream_status(call) -> grpc.StatusCode:
    """Read a Decode stream to its end; its status."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def play_router(cluster, req_id: str, tokens: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(cluster.decode[0]) as d, grpc.aio.insecure_channel(cluster.prefill[0]) as p:
        call = node_pb2_grpc.DecodeNodeStub(d).Decode(decode_request(SEED, req_id, tokens, max_tokens), timeout=60)
        ready = (await call.read()).ready
        reply = await node_pb2_grpc.PrefillNodeStub(p).Prefill(prefill_request(SEED, req_id, tokens, max_tokens, ready,
                                                                                               cluster.decode[0]),
                                                               timeout=60)
        out = [reply.first_token_id]
        while (event := await call.read()) is not grpc.aio.EOF:
            out += event.tokens.token_ids
        return out


def node_stats(cluster, kind: str) -> node_pb2.NodeStats:
    return next(s for s in cluster.stats() if s.kind == kind)


def test_a_reservation_whose_kv_never_comes_ends_deadline_exceeded_and_is_freed(cluster):
    tokens = random_prompt(40, 1)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.decode[0]) as channel:
            request = decode_request(SEED, "never-fed", tokens, 8)
            call = node_pb2_grpc.DecodeNodeStub(channel).Decode(request, timeout=60)
            ready = (await call.read()).ready
            held = await asyncio.to_thread(node_stats, cluster, "decode")
            return ready, held, await stream_status(call)

    ready, held, code = asyncio.run(scenario())
    assert len(ready.block_ids) == 5
    assert (held.used_blocks, held.reserved_blocks) == (5, 5)
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert held_blocks(wait_idle(cluster)) == [("prefill", 0, 0), ("decode", 0, 0)]


def test_a_prefill_never_acknowledged_by_a_frozen_decode_node_fails_and_frees_its_blocks(cluster, model_dir):
    warm, tokens = random_prompt(20, 2), random_prompt(40, 3)
    decode_group = cluster.pids["decode-0"]

    async def scenario():
        await play_router(cluster, "warm-up", warm, 4)  # the prefill node is connected to the decode node
        async with grpc.aio.insecure_channel(cluster.decode[0]) as d, \
                grpc.aio.insecure_channel(cluster.prefill[0]) as p:
            call = node_pb2_grpc.DecodeNodeStub(d).Decode(decode_request(SEED, "unacked", tokens, 8), timeout=60)
            ready = (await call.read()).ready
            os.killpg(decode_group, signal.SIGSTOP)
            try:
                try:
                    await node_pb2_grpc.PrefillNodeStub(p).Prefill(prefill_request(SEED, "unacked", tokens, 8, ready,
                                                                                                   cluster.decode[0]),
                                                                   timeout=60)
                    prefill_code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    prefill_code = exc.code()
                prefill_after = await asyncio.to_thread(wait_prefill_idle, cluster)
            finally:
                os.killpg(decode_group, signal.SIGCONT)
            call.cancel()
            return prefill_code, prefill_after

    prefill_code, prefill_after = asyncio.run(scenario())
    assert prefill_code is grpc.StatusCode.OK  # token 1 left when sampled
    # Freed by the prefill node's own lease while the decode node was still frozen.
    assert (prefill_after.used_blocks, prefill_after.reserved_blocks) == (0, 0)
    assert prefill_after.kv_transfer.failures >= 1
    assert held_blocks(wait_idle(cluster)) == [("prefill", 0, 0), ("decode", 0, 0)]

    again = random_prompt(30, 4)
    out = asyncio.run(play_router(cluster, "after-the-thaw", again, 6))
    assert_matches([out], greedy_references(model_dir, [again], [6]))
    assert held_blocks(wait_idle(cluster)) == [("prefill", 0, 0), ("decode", 0, 0)]


def wait_prefill_idle(cluster, timeout_s: float = 10.0) -> node_pb2.NodeStats:
    """The prefill node's stats once it holds nothing (only the prefill node: the decode node is frozen)."""
    return settled(lambda: node_stats_of(cluster.prefill[0]),
                   lambda stats: stats.used_blocks == 0 and stats.reserved_blocks == 0, timeout_s)


def node_stats_of(address: str) -> node_pb2.NodeStats:
    with grpc.insecure_channel(address) as channel:
        return node_pb2_grpc.PrefillNodeStub(channel).GetStats(node_pb2.StatsRequest(), timeout=10)
