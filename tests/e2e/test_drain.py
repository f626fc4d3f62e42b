"""Drains: SIGTERM (what Kubernetes sends a pod it scales down) with streams in flight, on a
`pdserve cluster --prefill 2 --decode 2` started as users start it. The scenarios run in order on
one cluster, each leaving it a node smaller:

- a decode node streaming greedy requests: it leaves placement, finishes them and exits 0; the
  launcher says it left and serves on; every stream is exactly transformers' float32 greedy
  output, `pdserve_resumes_total` did not move (nothing was computed again), no live node holds
  a block, and a new request is served, exactly, by the other decode node;
- a prefill node with a queue of prompts: it computes them and pushes their KV before it leaves,
  the same checks;
- the router: a new request is refused UNAVAILABLE while the streams in flight finish exactly;
  the router exits 0, and the launcher, its router drained, drains the nodes and exits 0.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until, wait_until
from tests.e2e.cluster import FaultCluster, FaultSettings, assert_no_blocks_held
from pdserve.testing.metrics import counter
from tests.e2e.streams import Stream, greedy, prompt
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

NUM_STREAMS = 4
STREAM_TOKENS = 60  # ~3 s at the decode step delay: time to drain mid-stream
PROMPT_TOKENS = 96  # 6 chunks of 16 at the prefill step delay: a queue to drain mid-prefill
BLOCKS_FREED_S = 15.0  # bounds the poll for the last frees
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=20.0, heartbeat_timeout_s=5.0,
                         prefill_step_delay_s=0.1, decode_step_delay_s=0.05, metrics=True)
LEFT_S = 60.0  # bounds the wait for a drained node's exit (its drain timeout is 25 s)


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with FaultCluster(model_dir, tmp_path_factory.mktemp("logs"), 2, 2, SETTINGS) as running:
        yield running


def resumes(cluster: FaultCluster) -> dict[str, float]:
    """The router's `pdserve_resumes_total` by reason."""
    return resumes_at(cluster.metrics_url("router"))


def resumes_at(metrics_url: str) -> dict[str, float]:
    return counter(metrics_url, "pdserve_resumes", "reason")


def busy(cluster: FaultCluster, kind: str, holds) -> str | None:
    """The live node of `kind` whose stats `holds` accepts, if any."""
    for name in (n for n in cluster.live_nodes() if n.startswith(kind)):
        if holds(cluster.stats(name)):
            return name
    return None


def wait_left(cluster: FaultCluster, name: str) -> None:
    """Until the launcher has said `name` drained and left (it exited 0)."""
    line = f"pdserve cluster: {name} drained and left the cluster; serving on without it"
    wait_until(lambda: line in cluster.log("launcher"), lambda: f"{line!r} in {cluster.log('launcher')[-2000:]}",
               LEFT_S, interval_s=0.1)
    assert name not in cluster.live_nodes()


async def run_streams(cluster: FaultCluster, prompts: list[list[int]], max_tokens: int, drain) -> list[Stream]:
    """Start one stream per prompt, call `drain()` once it returns a node name (polled), and
    return the finished streams."""
    streams = [Stream(cluster.router, greedy(ids, max_tokens)) for ids in prompts]
    await until(drain, timeout_s=60.0, interval_s=0.02)
    return [await s.done() for s in streams]


def test_a_decode_node_drains_its_streams_and_leaves(cluster, model_dir):
    prompts = [prompt(24, seed=i) for i in range(NUM_STREAMS)]
    refs = greedy_references(model_dir, [*prompts, prompt(20, seed=99)], [STREAM_TOKENS] * (NUM_STREAMS + 1))
    before = resumes(cluster)
    drained: list[str] = []

    def drain_once_streaming() -> str | None:
        name = busy(cluster, "decode", lambda s: s.num_running >= 2)
        if name is not None:
            cluster.terminate(name)
            drained.append(name)
        return name

    streams = asyncio.run(run_streams(cluster, prompts, STREAM_TOKENS, drain_once_streaming))
    assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * NUM_STREAMS
    assert_matches([s.tokens for s in streams], refs[:NUM_STREAMS])
    wait_left(cluster, drained[0])
    assert resumes(cluster) == before  # a drain is not a failover: nothing computed again
    cluster.wait_serving(2, 1, timeout_s=30.0)
    after = asyncio.run(_served(cluster.router, greedy(prompt(20, seed=99), STREAM_TOKENS)))
    assert after.code is grpc.StatusCode.OK
    assert_matches([after.tokens], refs[NUM_STREAMS:])
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)


def test_a_prefill_node_drains_its_queue_and_leaves(cluster, model_dir):
    prompts = [prompt(PROMPT_TOKENS, seed=10 + i) for i in range(NUM_STREAMS)]
    refs = greedy_references(model_dir, prompts, [8] * NUM_STREAMS)
    before = resumes(cluster)
    drained: list[str] = []

    def drain_once_queued() -> str | None:
        # Mid-queue: prompts waiting or partly computed, their KV still to push.
        name = busy(cluster, "prefill", lambda s: s.queued_prefill_tokens >= PROMPT_TOKENS)
        if name is not None:
            cluster.terminate(name)
            drained.append(name)
        return name

    streams = asyncio.run(run_streams(cluster, prompts, 8, drain_once_queued))
    assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * NUM_STREAMS
    assert_matches([s.tokens for s in streams], refs)
    wait_left(cluster, drained[0])
    assert resumes(cluster) == before
    cluster.wait_serving(1, 1, timeout_s=30.0)
    assert_no_blocks_held(cluster, BLOCKS_FREED_S)


def test_the_router_drains_its_streams_refusing_new_ones_and_the_cluster_stops(cluster, model_dir):
    prompts = [prompt(24, seed=20 + i) for i in range(2)]
    refs = greedy_references(model_dir, prompts, [STREAM_TOKENS] * 2)
    refused: list[grpc.aio.AioRpcError] = []

    async def scenario() -> list[Stream]:
        streams = [Stream(cluster.router, greedy(ids, STREAM_TOKENS)) for ids in prompts]
        await until(lambda: all(len(s.tokens) >= 2 for s in streams), timeout_s=60.0, interval_s=0.02)
        cluster.terminate("router")
        refused.append(await until(_refused_new_request(cluster.router), timeout_s=10.0, interval_s=0.02))
        return [await s.done() for s in streams]

    streams = asyncio.run(scenario())
    assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * 2
    assert_matches([s.tokens for s in streams], refs)
    assert (refused[0].code(), refused[0].details()) == (
        grpc.StatusCode.UNAVAILABLE, "the router is draining (stopping) and takes no new request; retry on another "
                                     "router")
    assert cluster.process.wait_exit(timeout_s=LEFT_S) == 0
    launcher = cluster.log("launcher")
    assert "the router drained and stopped; draining the nodes and stopping the cluster" in launcher
    assert "failed" not in launcher


def _refused_new_request(router: str):
    async def refused() -> grpc.aio.AioRpcError | None:
        async with grpc.aio.insecure_channel(router) as channel:
            try:
                async for _ in pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy([1, 2, 3], 2), timeout=10.0):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc if exc.code() is grpc.StatusCode.UNAVAILABLE else None
        return None  # served: the router has not heard the signal yet

    return refused


async def _served(router: str, request: pdserve_pb2.GenerateRequest) -> Stream:
    return await Stream(router, request).done()
