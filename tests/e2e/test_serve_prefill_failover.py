"""A pool of decode nodes that serve prefill loses one mid-stream, on a real `pdserve cluster
--prefill 0 --decode 2 --decode-args --serve-prefill` with the router on `--disaggregation
always`: every prompt is computed on one node and decoded on the other.

The node decoding a long greedy stream is SIGKILLed. The survivor is then the only decode node
and the only prefill node left, and never feeds itself: the resumed sample falls back to the
local route, the survivor computing prompt + streamed tokens itself. The client's stream,
concatenated, is exactly transformers' (no gap, no duplicate); the survivor sent no new KV and
holds no block after.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from pdserve.proto.node_pb2 import NodeStats

from tests.e2e.cluster import FaultCluster, FaultSettings, busy_node
from tests.e2e.streams import Stream, greedy, prompt
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LONG_STREAM = 160  # tokens: ~8 s at the step delay, time to kill the node mid-stream
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=6.0, heartbeat_timeout_s=5.0, decode_step_delay_s=0.05,
                         decode_args=("--serve-prefill",), router_args=("--disaggregation", "always"))


def test_the_last_node_of_a_serve_prefill_pool_computes_a_resumed_prompt_itself(tiny_llama, tmp_path):
    ids = prompt(40, seed=3)
    ref = greedy_references(str(tiny_llama), [ids], [LONG_STREAM])
    with FaultCluster(str(tiny_llama), tmp_path, 0, 2, SETTINGS) as cluster:

        async def scenario() -> tuple[Stream, str, NodeStats]:
            stream = Stream(cluster.router, greedy(ids, LONG_STREAM))
            await stream.until(lambda: len(stream.tokens) >= 20)
            victim = busy_node(cluster, "decode")
            [survivor] = [n for n in cluster.live_nodes() if n != victim]
            before = cluster.stats(survivor)
            cluster.kill(victim)
            return await stream.done(), survivor, before

        stream, survivor, before = asyncio.run(scenario())
        assert stream.error is None, stream.error
        assert_matches([stream.tokens], ref)  # the whole stream: no gap, no duplicate
        assert stream.responses[-1].usage.completion_tokens == LONG_STREAM
        after = cluster.stats(survivor)
        # It computed the resumed prompt itself: no KV moved either way.
        assert after.kv_transfer_sent.transfers == before.kv_transfer_sent.transfers
        assert after.kv_transfer.transfers == before.kv_transfer.transfers
        held = cluster.wait_no_blocks(10.0)
        assert held[survivor] == (0, 0), held
