"""A decode node killed during a served beam search on a real prefill + decode pair (`pdserve
cluster`, one prefill node, two decode nodes): nothing had streamed, so the search runs again on
the other decode node and the client gets the same beams as transformers, best first; every live
node ends with no block used or reserved."""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest

from pdserve.engine.beam_search import BeamSearchParams
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import wait_until
from tests.e2e.cluster import FaultCluster, FaultSettings
from tests.integration.reference import transformers_beams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

PROMPT = [5, 17, 99, 3, 44, 8, 21, 7, 60, 13, 2]
PARAMS = BeamSearchParams(beam_width=2, max_tokens=80, length_penalty=1.0, ignore_eos=True)  # ~4 s of steps
SETTINGS = FaultSettings(decode_step_delay_s=0.05, restart_backoff_s=60.0)


def busy_decode_node(cluster: FaultCluster, timeout_s: float = 60.0) -> str:
    """The decode node running the search, once it runs it."""
    def running() -> str | None:
        for name in (n for n in cluster.live_nodes() if n.startswith("decode")):
            stats = cluster.stats(name)
            if stats.num_running or stats.num_waiting:  # beams wait between their search's steps
                return name
        return None

    return wait_until(running, "a decode node runs the search", timeout_s)


def test_a_decode_node_killed_mid_search_gives_the_same_beams(tiny_llama, tmp_path):
    expected, scores = transformers_beams(str(tiny_llama), PROMPT, PARAMS, None)
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=PROMPT),
        sampling_params=pdserve_pb2.SamplingParams(max_tokens=PARAMS.max_tokens, ignore_eos=True),
        beam_search=pdserve_pb2.BeamSearch(beam_width=PARAMS.beam_width, length_penalty=PARAMS.length_penalty))
    with FaultCluster(str(tiny_llama), tmp_path, 1, 2, SETTINGS) as cluster:

        async def collect():
            async with grpc.aio.insecure_channel(cluster.router) as channel:
                call = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
                task = asyncio.ensure_future(_all(call))
                victim = await asyncio.to_thread(busy_decode_node, cluster)
                cluster.kill(victim)
                return await task, victim

        responses, victim = asyncio.run(collect())
        assert [list(r.token_ids) for r in responses] == expected
        assert [r.beam_score for r in responses] == pytest.approx(scores, rel=1e-5, abs=1e-5)
        held = cluster.wait_no_blocks(30.0)
        assert all(h == (0, 0) for h in held.values()), held
        assert victim not in cluster.live_nodes()


async def _all(call) -> list[pdserve_pb2.GenerateResponse]:
    return [r async for r in call]
