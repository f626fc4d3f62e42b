"""Decode nodes that are prefill nodes too (`--serve-prefill`), on a real `pdserve cluster --prefill
0 --decode 2`: a pool that is colocated and disaggregated at once, the router on
`--disaggregation auto`, each node with 32 KV blocks of 8 tokens. Steps are slowed
(`--debug-step-delay-s`) so the first request is still decoding when the second arrives, which
is sent once the router's view of the nodes (their stats) shows the first request's blocks.

The first request (64 + 100 tokens: 21 blocks at most) finds both nodes idle: it is computed and
decoded on one of them, no KV moved. The second is its next turn (the same 64 tokens and 8 new,
then 32 out: 13 blocks). Its node holds the 64 tokens in its prefix cache, so it is the place to
compute the prompt, but the first request leaves it at most 23 free blocks, short of twice 13,
where the other node has 32: so the prompt is computed there and its KV moves to the other node,
which decodes it. Both are token-exact against transformers, the router's
`pdserve_prompt_routes_total` counts them, the node that computed both exported once and the
other none, and every block is free after.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until
from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.testing.metrics import counter

from ..integration.reference import assert_matches, greedy_references

FIRST, NEXT_TURN = 64, 8  # the next turn's new tokens, after the first prompt
FIRST_NEW, NEXT_NEW = 100, 32
FIRST_BLOCKS = FIRST // 8 + 1  # its prompt and token 1, in blocks of 8
SETTINGS = NodeSettings(num_blocks=32)


def request(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def most_blocks_in_use(metrics_url: str) -> float:
    """The most KV blocks any node uses, as the router's node table (its last stats) has them."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return max((sample.value for family in text_string_to_metric_families(text)
                if family.name == "pdserve_node_kv_blocks_used" for sample in family.samples), default=0.0)


async def first_decoding_then_second(router: str, router_metrics: str, first: list[int], second: list[int]):
    """The second request is sent once the first is decoding and the router sees its blocks."""
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        stream = stub.Generate(request(first, FIRST_NEW), timeout=120)
        head = await stream.read()
        await until(lambda: most_blocks_in_use(router_metrics) >= FIRST_BLOCKS, timeout_s=30)
        second_responses = [r async for r in stub.Generate(request(second, NEXT_NEW), timeout=120)]
        first_responses = [head]
        while (response := await stream.read()) is not grpc.aio.EOF:
            first_responses.append(response)
    return first_responses, second_responses


def test_a_serve_prefill_pool_moves_a_prompts_kv_to_the_node_with_room_when_its_own_is_short(tiny_llama):
    rng = random.Random(11)
    history = [rng.randrange(1, 900) for _ in range(FIRST)]
    prompts = [history, history + [rng.randrange(1, 900) for _ in range(NEXT_TURN)]]
    refs = greedy_references(str(tiny_llama), prompts, [FIRST_NEW, NEXT_NEW])
    with running_cluster(str(tiny_llama), 0, 2, SETTINGS, router_args=("--disaggregation", "auto"),
                         decode_args=("--serve-prefill", "--debug-step-delay-s", "0.05"), metrics=True) as cluster:
        first, second = asyncio.run(first_decoding_then_second(cluster.router, cluster.metrics["router"], *prompts))
        assert_matches([[t for r in stream for t in r.token_ids] for stream in (first, second)], refs)
        assert (first[-1].timings.prefill_s, first[-1].timings.kv_transfer_bytes) == (0.0, 0)  # colocated
        assert second[-1].timings.prefill_s > 0 and second[-1].timings.kv_transfer_bytes > 0  # moved
        assert counter(cluster.metrics["router"], "pdserve_prompt_routes", "route") == {
            "colocated": 0.0, "prefill_pool": 1.0, "decode_node": 1.0}
        nodes = cluster.wait_all_blocks_free(timeout_s=5)
        assert [(s.used_blocks, s.reserved_blocks) for s in nodes] == [(0, 0), (0, 0)]
        # (prefix-cache hits, KV pushes sent, KV pushes received), the node that computed both first:
        # it found the history's 8 blocks for the next turn, and pushed that turn's KV to the other.
        by_node = sorted(((s.prefix_cache_hits, s.kv_transfer_sent.transfers, s.kv_transfer.transfers)
                          for s in nodes), reverse=True)
        assert by_node == [(FIRST // 8, 1, 0), (0, 0, 1)]
