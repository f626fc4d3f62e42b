"""Decode nodes that are prefill nodes too (`--serve-prefill`), on a real `pdserve cluster --prefill
0 --decode 2`: a pool that is colocated and disaggregated at once, the router on
`--disaggregation auto`. Steps are slowed (`--debug-step-delay-s`) so the first request is still
decoding when the second arrives.

The first request finds both nodes idle: it is computed and decoded on the first node, no KV moved.
The second finds that node's prompt queue as short as the other's (so it is still the place to
compute the prompt), but its KV blocks held by the first request: the other node has more room
even after taking the second, so the prompt is computed on the first node and its KV moves to
the other, which decodes it. Both are token-exact against transformers, the router's
`pdserve_prompt_routes_total` counts them, the node that computed both exported once and the other
none, and every block is free after.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, counter, running_cluster

from ..integration.reference import assert_matches, greedy_references

LONG, SHORT = 120, 20  # 15 blocks of 8 held by the first request; the second needs 4 at most
LONG_NEW, SHORT_NEW = 40, 8


def request(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def first_decoding_then_second(router: str, first: list[int], second: list[int]):
    """The second request is sent once the first has streamed its first token (it is decoding)."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        stream = stub.Generate(request(first, LONG_NEW), timeout=120)
        head = await stream.read()
        second_responses = [r async for r in stub.Generate(request(second, SHORT_NEW), timeout=120)]
        first_responses = [head]
        while (response := await stream.read()) is not grpc.aio.EOF:
            first_responses.append(response)
    return first_responses, second_responses


def test_a_serve_prefill_pool_decodes_where_there_is_room_and_moves_the_kv_there(tiny_llama):
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in (LONG, SHORT)]
    refs = greedy_references(str(tiny_llama), prompts, [LONG_NEW, SHORT_NEW])
    with running_cluster(str(tiny_llama), 0, 2, NodeSettings(), router_args=("--disaggregation", "auto"),
                         decode_args=("--serve-prefill", "--debug-step-delay-s", "0.05"), metrics=True) as cluster:
        first, second = asyncio.run(first_decoding_then_second(cluster.router, *prompts))
        assert_matches([[t for r in stream for t in r.token_ids] for stream in (first, second)], refs)
        assert (first[-1].timings.prefill_s, first[-1].timings.kv_transfer_bytes) == (0.0, 0)  # colocated
        assert second[-1].timings.prefill_s > 0 and second[-1].timings.kv_transfer_bytes > 0  # moved
        assert counter(cluster.metrics["router"], "pdserve_prompt_routes", "route") == {
            "colocated": 0.0, "prefill_pool": 1.0, "decode_node": 1.0}
        nodes = cluster.wait_all_blocks_free(timeout_s=5)
        assert [(s.used_blocks, s.reserved_blocks) for s in nodes] == [(0, 0), (0, 0)]
        # (prompts computed, KV pushes sent, KV pushes received), the node that computed both first:
        by_node = sorted(((s.prefix_cache_queries > 0, s.kv_transfer_sent.transfers, s.kv_transfer.transfers)
                          for s in nodes), reverse=True)
        assert by_node == [(True, 1, 0), (False, 0, 1)]
