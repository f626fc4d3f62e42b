"""Node failures, one at a time: router + 2 prefill + 2 decode processes on 127.0.0.1.

- A decode node SIGKILLed while a long greedy request streams on it: the request resumes
  on the other decode node and the client's stream, concatenated, is exactly the
  transformers reference (no gap, no duplicate).
- The same with a constrained (regex) stream: the nodes it resumes on replay the grammar over the
  tokens already streamed, and the stream is transformers' under xgrammar's logits processor.
- A prefill node SIGKILLed while it prefills a long prompt: retried on the other one,
  exact tokens.
- Every decode node killed: the request in flight and a new one end UNAVAILABLE with a
  clear message within seconds; restarted (same command), the nodes register again and
  serve exact tokens.
After each: zero used and zero reserved blocks on every live node.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

import grpc
import pytest
from pdserve.engine.structured_output import StructuredOutput
from pdserve.proto import pdserve_pb2
from pdserve.proto.convert import structured_to_proto
from pdserve.testing.waiting import until

from tests.e2e.cluster import FaultCluster, FaultSettings, assert_no_blocks_held, busy_node
from tests.e2e.streams import Stream, greedy, prompt
from tests.integration.reference import assert_matches, constrained_references, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LONG_STREAM = 160  # tokens: ~8 s at the decode nodes' step delay, time to kill one mid-stream
LONG_PROMPT = 320  # tokens: 20 prefill chunks of 16 at the prefill nodes' step delay
BLOCKS_FREED_S = 10.0  # bounds the poll: a reservation whose prefill node died is freed at once
# The router's default heartbeat timeout: on a 2-core machine running two test clusters, a
# restarting node's torch import beside them has starved a surviving node's front for 3 s.
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=6.0, heartbeat_timeout_s=5.0,
                         prefill_step_delay_s=0.1, decode_step_delay_s=0.05)


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with FaultCluster(model_dir, tmp_path_factory.mktemp("logs"), 2, 2, SETTINGS) as running:
        yield running


def mid_prefill(cluster: FaultCluster, num_chunks_done: int) -> str | None:
    """The prefill node that has computed at least `num_chunks_done` chunks of the long
    prompt and not all of them yet, if there is one."""
    chunk = SETTINGS.max_num_batched_tokens
    for name in (n for n in cluster.live_nodes() if n.startswith("prefill")):
        stats = cluster.stats(name)
        if stats.num_running and 0 < stats.queued_prefill_tokens <= LONG_PROMPT - num_chunks_done * chunk:
            return name
    return None


def test_decode_node_killed_mid_stream_resumes_on_the_other(cluster, model_dir):
    ids = prompt(40, seed=1)
    ref = greedy_references(model_dir, [ids], [LONG_STREAM])

    async def scenario() -> tuple[Stream, str, int]:
        stream = Stream(cluster.router, greedy(ids, LONG_STREAM))
        await stream.until(lambda: len(stream.tokens) >= 20)
        victim = busy_node(cluster, "decode")
        cluster.kill(victim)
        streamed_before_kill = len(stream.tokens)
        return await stream.done(), victim, streamed_before_kill

    stream, victim, before = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert before < LONG_STREAM
    assert_matches([stream.tokens], ref)  # the whole stream: no gap, no duplicate
    assert stream.responses[-1].usage.completion_tokens == LONG_STREAM
    assert stream.responses[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)

    cluster.restart(victim)
    cluster.wait_serving(2, 2, timeout_s=240)
    before = cluster.stats(victim).kv_transfer.transfers
    ids = [prompt(24, seed=10 + i) for i in range(4)]
    refs = greedy_references(model_dir, ids, [8] * 4)

    async def four() -> list[Stream]:
        streams = [Stream(cluster.router, greedy(p, 8)) for p in ids]
        return [await s.done() for s in streams]

    streams = asyncio.run(four())
    assert [s.error for s in streams] == [None] * 4
    assert_matches([s.tokens for s in streams], refs)
    assert cluster.stats(victim).kv_transfer.transfers > before, "the restarted decode node took traffic"
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)


def test_constrained_stream_survives_its_decode_node_killed(cluster, model_dir):
    """The sample resumes on the other pair, whose nodes replay the grammar over the tokens already
    streamed: the whole stream is transformers' under xgrammar's processor, no gap, no duplicate."""
    ids = prompt(30, seed=2)
    structured = StructuredOutput.regex("[a-z]{1000}")  # cannot finish: max_tokens ends it
    (expected,) = constrained_references(model_dir, [ids], structured, LONG_STREAM)
    params = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=LONG_STREAM,
                                        structured_output=structured_to_proto(structured))
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=ids), sampling_params=params)

    async def scenario() -> tuple[Stream, str, int]:
        stream = Stream(cluster.router, request)
        await stream.until(lambda: len(stream.tokens) >= 20)
        victim = busy_node(cluster, "decode")
        cluster.kill(victim)
        streamed_before_kill = len(stream.tokens)
        return await stream.done(), victim, streamed_before_kill

    stream, victim, before = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert before < LONG_STREAM
    assert stream.tokens == expected
    assert stream.responses[-1].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)
    cluster.restart(victim)
    cluster.wait_serving(2, 2, timeout_s=240)


def test_prefill_node_killed_mid_prefill_is_retried_on_the_other(cluster, model_dir):
    ids = prompt(LONG_PROMPT, seed=2)
    ref = greedy_references(model_dir, [ids], [12])

    async def scenario() -> tuple[Stream, str]:
        stream = Stream(cluster.router, greedy(ids, 12))
        found: dict[str, str] = {}

        def prefilling() -> bool:
            if "victim" not in found and (name := mid_prefill(cluster, num_chunks_done=3)) is not None:
                found["victim"] = name
            return "victim" in found

        await stream.until(prefilling)
        victim = found["victim"]
        cluster.kill(victim)
        return await stream.done(), victim

    stream, victim = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert_matches([stream.tokens], ref)
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)
    cluster.restart(victim)
    cluster.wait_serving(2, 2, timeout_s=240)


def test_no_decode_node_left_is_unavailable_promptly_and_a_restart_serves(cluster, model_dir):
    ids = prompt(30, seed=3)

    async def scenario() -> tuple[Stream, float, grpc.aio.AioRpcError, float]:
        stream = Stream(cluster.router, greedy(ids, LONG_STREAM))
        await stream.until(lambda: len(stream.tokens) >= 5)
        killed_at = time.monotonic()
        for name in ("decode-0", "decode-1"):
            cluster.kill(name)
        await stream.done()
        started = time.monotonic()
        late = await Stream(cluster.router, greedy(ids, 4)).done()
        return stream, stream.ended_at - killed_at, late.error, time.monotonic() - started

    stream, in_flight_s, late, new_s = asyncio.run(scenario())
    assert stream.error is not None and stream.error.code() is grpc.StatusCode.UNAVAILABLE
    assert "no decode node is available" in stream.error.details(), stream.error.details()
    assert late is not None and late.code() is grpc.StatusCode.UNAVAILABLE
    assert "no decode node is available" in late.details(), late.details()
    print(f"in flight: UNAVAILABLE {in_flight_s:.2f}s after the kill; new request: {new_s:.2f}s")
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)

    for name in ("decode-0", "decode-1"):
        cluster.restart(name)
    cluster.wait_serving(2, 2, timeout_s=240)
    ref = greedy_references(model_dir, [ids], [10])
    stream = asyncio.run(_one(cluster.router, greedy(ids, 10)))
    assert stream.error is None, stream.error
    assert_matches([stream.tokens], ref)
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)


def test_a_frozen_decode_node_moves_its_streams_and_rejoins_when_it_wakes(cluster, model_dir):
    ids = [prompt(30, seed=20 + i) for i in range(4)]
    refs = greedy_references(model_dir, ids, [LONG_STREAM] * 4)

    async def scenario() -> tuple[list[Stream], str]:
        # A client deadline far beyond the heartbeat timeout: a stream that waited on the
        # frozen node would end DEADLINE_EXCEEDED, and the test would see it.
        streams = [Stream(cluster.router, greedy(p, LONG_STREAM), timeout_s=600) for p in ids]
        await streams[0].until(lambda: len(streams[0].tokens) >= 10)
        victim = busy_node(cluster, "decode")
        cluster.freeze(victim)
        try:
            return [await s.done() for s in streams], victim
        finally:
            cluster.thaw(victim)

    streams, victim = asyncio.run(scenario())
    assert [s.error for s in streams] == [None] * 4
    assert_matches([s.tokens for s in streams], refs)  # moved: no gap, no duplicate
    cluster.wait_serving(2, 2, timeout_s=120)  # awake: it registered again
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)  # and freed what its cancelled streams held


def test_a_frozen_prefill_node_moves_its_prefills(cluster, model_dir):
    ids = prompt(LONG_PROMPT, seed=30)
    ref = greedy_references(model_dir, [ids], [12])

    async def scenario() -> Stream:
        stream = Stream(cluster.router, greedy(ids, 12), timeout_s=600)
        victim = await _prefilling_node(cluster)
        cluster.freeze(victim)
        try:
            return await stream.done()
        finally:
            cluster.thaw(victim)

    stream = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert_matches([stream.tokens], ref)
    cluster.wait_serving(2, 2, timeout_s=120)
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)


async def _prefilling_node(cluster: FaultCluster) -> str:
    """The prefill node with the prompt part-way computed."""
    return await until(lambda: mid_prefill(cluster, num_chunks_done=3), 60, interval_s=0.05)


async def _one(router: str, request: pdserve_pb2.GenerateRequest) -> Stream:
    return await Stream(router, request).done()
