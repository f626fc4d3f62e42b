"""A pool of decode nodes that serve prefill loses one mid-request, on a real `pdserve cluster
--prefill 0 --decode 2 --decode-args --serve-prefill` with the router on `--disaggregation
always`: every prompt is computed on one node and decoded on the other.

Whichever node is lost, the survivor is then the only decode node and the only prefill node
left, and never feeds itself: the sample falls back to the local route, the survivor computing
prompt + streamed tokens itself.

- The node decoding a long greedy stream is SIGKILLed: the stream, concatenated, is exactly
  transformers' (no gap, no duplicate), and the survivor moved no KV after.
- The node computing a long prompt is SIGKILLed mid-prompt: the node that was to decode it
  computes it, exact tokens.
- The node decoding is frozen (SIGSTOP): its streams move to the other once the router stops
  hearing from it, exact; woken, it registers again.
After each: no block held on any live node.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from pdserve.proto.node_pb2 import NodeStats
from pdserve.testing.waiting import until
from tests.e2e.cluster import FaultCluster, FaultSettings, assert_no_blocks_held, busy_node
from tests.e2e.streams import Stream, greedy, prompt
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LONG_STREAM = 160  # tokens: ~8 s at the step delay, time to lose a node mid-stream
LONG_PROMPT = 320  # tokens: 20 chunks of 16 at the step delay
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=6.0, heartbeat_timeout_s=5.0, decode_step_delay_s=0.05,
                         decode_args=("--serve-prefill",), router_args=("--disaggregation", "always"))
BLOCKS_FREED_S = 10.0


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with FaultCluster(model_dir, tmp_path_factory.mktemp("logs"), 0, 2, SETTINGS) as running:
        yield running


def computing_a_prompt(cluster: FaultCluster) -> str | None:
    """The node part-way through the long prompt (three chunks done at least), if one is."""
    chunk = SETTINGS.max_num_batched_tokens
    for name in cluster.live_nodes():
        stats = cluster.stats(name)
        if 0 < stats.queued_prefill_tokens <= LONG_PROMPT - 3 * chunk:
            return name
    return None


def test_the_survivor_computes_a_resumed_stream_itself_when_its_decoding_node_is_killed(cluster, model_dir):
    ids = prompt(40, seed=3)
    ref = greedy_references(model_dir, [ids], [LONG_STREAM])

    async def scenario() -> tuple[Stream, str, str, NodeStats]:
        stream = Stream(cluster.router, greedy(ids, LONG_STREAM))
        await stream.until(lambda: len(stream.tokens) >= 20)
        victim = busy_node(cluster, "decode")
        [survivor] = [n for n in cluster.live_nodes() if n != victim]
        before = cluster.stats(survivor)
        cluster.kill(victim)
        return await stream.done(), victim, survivor, before

    stream, victim, survivor, before = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert_matches([stream.tokens], ref)  # the whole stream: no gap, no duplicate
    assert stream.responses[-1].usage.completion_tokens == LONG_STREAM
    after = cluster.stats(survivor)
    # It computed the resumed prompt itself: no KV moved either way.
    assert after.kv_transfer_sent.transfers == before.kv_transfer_sent.transfers
    assert after.kv_transfer.transfers == before.kv_transfer.transfers
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)
    cluster.restart(victim)
    cluster.wait_serving(2, 2, timeout_s=240)


def test_the_decode_node_computes_a_prompt_whose_computing_node_is_killed(cluster, model_dir):
    ids = prompt(LONG_PROMPT, seed=4)
    ref = greedy_references(model_dir, [ids], [12])

    async def scenario() -> tuple[Stream, str]:
        stream = Stream(cluster.router, greedy(ids, 12))
        victim = await until(lambda: computing_a_prompt(cluster), 60, interval_s=0.05)
        cluster.kill(victim)
        return await stream.done(), victim

    stream, victim = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert_matches([stream.tokens], ref)
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)
    cluster.restart(victim)
    cluster.wait_serving(2, 2, timeout_s=240)


def test_a_frozen_decoding_node_moves_its_streams_to_the_other_and_rejoins_when_it_wakes(cluster, model_dir):
    ids = [prompt(30, seed=20 + i) for i in range(2)]
    refs = greedy_references(model_dir, ids, [LONG_STREAM] * 2)

    async def scenario() -> list[Stream]:
        # A client deadline far beyond the heartbeat timeout: a stream that waited on the frozen
        # node would end DEADLINE_EXCEEDED.
        streams = [Stream(cluster.router, greedy(p, LONG_STREAM), timeout_s=600) for p in ids]
        await streams[0].until(lambda: len(streams[0].tokens) >= 10)
        victim = busy_node(cluster, "decode")
        cluster.freeze(victim)
        try:
            return [await s.done() for s in streams]
        finally:
            cluster.thaw(victim)

    streams = asyncio.run(scenario())
    assert [s.error for s in streams] == [None, None]
    assert_matches([s.tokens for s in streams], refs)  # moved: no gap, no duplicate
    cluster.wait_serving(2, 2, timeout_s=120)  # awake: it registered again
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)
