"""Every node kind drains the same way: SIGTERM to one of two colocated nodes while greedy streams
run on both. It leaves placement, finishes its streams, exits 0 and the launcher says it left;
every stream is exactly transformers' float32 greedy output, `pdserve_resumes_total` did not
move, and the other node holds no block and serves a new request exactly. Then SIGTERM to the
launcher with a stream in flight: the stream finishes exactly, the launcher drains the router and
the node and exits 0.
"""

from __future__ import annotations

import asyncio

import grpc

from pdserve.testing.waiting import settled, until, wait_until
from tests.e2e.cluster import NodeSettings, running_cluster
from tests.e2e.test_drain import Stream, greedy, prompt, resumes_at
from tests.integration.reference import assert_matches, greedy_references

STREAM_TOKENS = 40


def test_a_colocated_node_drains_its_streams_and_leaves(tiny_llama):
    model_dir = str(tiny_llama)
    prompts = [prompt(24, seed=30 + i) for i in range(4)]
    refs = greedy_references(model_dir, [*prompts, prompt(16, seed=39)], [STREAM_TOKENS] * 5)
    with running_cluster(model_dir, 0, 0, NodeSettings(max_num_batched_tokens=16), num_colocated=2, metrics=True,
                         colocated_args=("--debug-step-delay-s", "0.05")) as cluster:
        before = resumes_at(cluster.metrics["router"])
        busy_node: list[str] = []

        def drain_once_streaming() -> bool:
            for name in cluster.names("colocated"):
                if cluster.stats(name).num_running >= 1:
                    cluster.terminate(name)
                    busy_node.append(name)
                    return True
            return False

        async def scenario() -> list[Stream]:
            streams = [Stream(cluster.router, greedy(ids, STREAM_TOKENS)) for ids in prompts]
            await until(lambda: all(s.tokens for s in streams), timeout_s=60.0, interval_s=0.02)
            await until(drain_once_streaming, timeout_s=10.0, interval_s=0.02)
            return [await s.done() for s in streams]

        streams = asyncio.run(scenario())
        assert [(s.code, s.details) for s in streams] == [(grpc.StatusCode.OK, "")] * 4
        assert_matches([s.tokens for s in streams], refs[:4])
        line = f"pdserve cluster: {busy_node[0]} drained and left the cluster; serving on without it"
        wait_until(lambda: line in cluster.log("launcher"), line, 60.0, interval_s=0.1)
        assert resumes_at(cluster.metrics["router"]) == before
        cluster.wait_serving(0, 0, 1, timeout_s=30.0)
        after = asyncio.run(_served(cluster.router, greedy(prompt(16, seed=39), STREAM_TOKENS)))
        assert after.code is grpc.StatusCode.OK
        assert_matches([after.tokens], refs[4:])
        [other] = [n for n in cluster.names("colocated") if n != busy_node[0]]
        stats = settled(lambda: cluster.stats(other), lambda s: (s.used_blocks, s.reserved_blocks) == (0, 0), 15.0)
        assert (stats.used_blocks, stats.reserved_blocks) == (0, 0)
        _launcher_sigterm_drains_a_stream_in_flight(cluster, prompts[0], refs[0])


def _launcher_sigterm_drains_a_stream_in_flight(cluster, ids: list[int], ref) -> None:
    async def scenario() -> Stream:
        stream = Stream(cluster.router, greedy(ids, STREAM_TOKENS))
        await until(lambda: len(stream.tokens) >= 3, timeout_s=60.0, interval_s=0.02)
        cluster.terminate_launcher()
        return await stream.done()

    stream = asyncio.run(scenario())
    assert (stream.code, stream.details) == (grpc.StatusCode.OK, "")
    assert_matches([stream.tokens], [ref])
    assert cluster.wait_exit(timeout_s=120.0) == 0
    assert "pdserve cluster: draining" in cluster.log("launcher")


async def _served(router: str, request) -> Stream:
    return await Stream(router, request).done()
