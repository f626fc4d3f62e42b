"""The planner's load mode on a real `pdserve cluster --rebalance`: a decode node moves to the
prefill pool while requests stream, and every request still ends with the exact tokens.

What the planner sees is set by the test: a synthetic profile in the cache where a prompt token
costs 10 ms (one prefill node cannot keep up with the offered rate, two can), and prefill nodes
slowed to 1.1 s a step (`--debug-step-delay-s`), so the real TTFT misses the 1 s SLO for certain
and the load mode must act. The move itself — the node retired, its drain, a prefill node started
on its cores and registering, the requests around it — is all real.
"""

from __future__ import annotations

import asyncio
import random

import grpc

from pdserve.planner.profile import NodeSetup, ProfileCache, machine_facts, model_hash, profile_key
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import START_TIMEOUT_S, NodeSettings, running_cluster
from tests.unit.planner_profiles import synthetic_profile

from ..integration.reference import assert_matches, greedy_references

REQUESTS, RATE, PROMPT_LEN, NEW_TOKENS = 40, 5.0, 24, 4


async def generate(router: str, prompt: list[int], delay_s: float) -> list[int]:
    await asyncio.sleep(delay_s)  # the open-loop schedule: request i is due at i / RATE
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return [t async for r in stub.Generate(request, timeout=120) for t in r.token_ids]


async def offered_load(router: str, prompts: list[list[int]]) -> list[list[int]]:
    return await asyncio.gather(*(generate(router, p, i / RATE) for i, p in enumerate(prompts)))


def test_the_load_mode_moves_a_decode_node_to_the_prefill_pool_while_serving(tiny_llama, tmp_path):
    profiles = ProfileCache(tmp_path / "profiles")
    profiles.store(profile_key(model_hash(tiny_llama), machine_facts(), NodeSetup(1, "float32", 8)),
                   synthetic_profile(base_s=0.001, per_token_s=0.01))
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 900) for _ in range(PROMPT_LEN)] for _ in range(REQUESTS)]
    refs = greedy_references(str(tiny_llama), prompts, [NEW_TOKENS] * REQUESTS)
    load_mode = ("--threads-per-node", "1", "--rebalance", "--rebalance-ttft-slo", "1.0",
                 "--rebalance-interval-s", "3", "--rebalance-cooldown-s", "600", "--rebalance-min-samples", "3",
                 "--rebalance-profile-dir", str(profiles.folder))
    with running_cluster(str(tiny_llama), 1, 2, NodeSettings(), prefill_args=("--debug-step-delay-s", "1.1"),
                         launcher_args=load_mode) as cluster:
        outputs = asyncio.run(offered_load(cluster.router, prompts))
        assert_matches(outputs, refs)

        cluster.wait_serving(2, 1, timeout_s=START_TIMEOUT_S)  # the moved node registered as a prefill node
        state = cluster.refresh()
        assert sorted(n for n in state.children if n != "router") == ["decode-0", "prefill-0", "prefill-1"]
        launcher = cluster.log("launcher")
        assert "load mode: a decode node becomes a prefill node (1P2D toward 2P1D" in launcher
        assert "decode-1 drains and leaves" in launcher and "prefill-1 started on its cores: now 2P1D" in launcher
        assert asyncio.run(offered_load(cluster.router, prompts[:4])) == outputs[:4]  # the new node serves
        held = cluster.wait_all_blocks_free(timeout_s=30)
        assert [(s.used_blocks, s.reserved_blocks) for s in held] == [(0, 0)] * 3
