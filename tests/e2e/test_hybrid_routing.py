"""Conditional disaggregation on a real `pdserve cluster`: a prefill node and a decode node started
with `--local-prefill`, the router on `--disaggregation auto --local-prefill-max-tokens 48` and a
prompt budget that does not refill within the test (`--local-prefill-tokens-per-s 0.001`: 48
tokens at once, then next to nothing).

A prompt the decode node can absorb (≤ 48 tokens, its queue empty) is computed there: no prefill
time, no KV moved. A longer one goes to the idle prefill pool, whose KV lands in the decode node.
The long prompt's next turn (it, plus 10 new tokens) is computed on the decode node again: the
router counts only the tokens that node does not hold in its prefix cache (14), which leaves 14
of the budget's 48. So a last short prompt, within the bound and the node idle, goes to the
prefill pool. All four are token-exact against transformers, the router's
`pdserve_prompt_routes_total` counts them, and every block is free after.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.testing.metrics import counter

from ..integration.reference import assert_matches, greedy_references

SHORT, LONG = 20, 60  # 60: 7 full blocks of 8, which the decode node caches when their KV arrives
NEW_TOKENS = 8
NEXT_TURN = 10  # new tokens: 70 in all, 14 of them not cached (4 of the long prompt's, these 10)


async def generate(router: str, prompt: list[int]) -> list[pdserve_pb2.GenerateResponse]:
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    async with grpc.aio.insecure_channel(router) as channel:
        return [r async for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]


def test_auto_prefills_short_prompts_on_the_decode_node_within_its_budget_and_long_ones_on_the_pool(tiny_llama):
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in (SHORT, LONG)]
    prompts.append(prompts[1] + [rng.randrange(1, 900) for _ in range(NEXT_TURN)])
    prompts.append([rng.randrange(1, 900) for _ in range(SHORT)])
    refs = greedy_references(str(tiny_llama), prompts, [NEW_TOKENS] * 4)
    router_args = ("--disaggregation", "auto", "--local-prefill-max-tokens", "48",
                   "--local-prefill-tokens-per-s", "0.001")
    with running_cluster(str(tiny_llama), 1, 1, NodeSettings(), router_args=router_args,
                         decode_args=("--local-prefill",), metrics=True) as cluster:
        short, long = (asyncio.run(generate(cluster.router, p)) for p in prompts[:2])
        hits_before = cluster.stats("decode-0").prefix_cache_hits
        next_turn, over_budget = (asyncio.run(generate(cluster.router, p)) for p in prompts[2:])
        assert_matches([[t for r in stream for t in r.token_ids] for stream in (short, long, next_turn, over_budget)],
                       refs)
        assert (short[-1].timings.prefill_s, short[-1].timings.kv_transfer_bytes) == (0.0, 0)  # on the decode node
        assert long[-1].timings.prefill_s > 0 and long[-1].timings.kv_transfer_bytes > 0  # on the prefill node
        assert (next_turn[-1].timings.prefill_s, next_turn[-1].timings.kv_transfer_bytes) == (0.0, 0)  # decode node
        assert over_budget[-1].timings.kv_transfer_bytes > 0  # on the prefill node: 20 > the 14 left
        assert counter(cluster.metrics["router"], "pdserve_prompt_routes", "route") == {
            "colocated": 0.0, "prefill_pool": 2.0, "decode_node": 2.0}
        prefill, decode = cluster.wait_all_blocks_free(timeout_s=5)
        assert decode.prefix_cache_hits - hits_before == LONG // 8  # the long prompt's 7 blocks, found
        assert (prefill.used_blocks, decode.used_blocks, decode.reserved_blocks) == (0, 0, 0)
        assert prefill.kv_transfer.transfers == 2  # the long prompt's and the last one's
