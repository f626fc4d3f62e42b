"""A drain that runs out of time: a decode node given SIGTERM with `--drain-timeout-s 1` while a
long greedy stream runs on it. It leaves placement, waits its second, deregisters and stops; the
router resumes the stream on the other decode node from the tokens the client already has, so
the client's stream is still exactly transformers' float32 greedy output, counted once as
`pdserve_resumes_total{reason="drain_timeout"}` (and under no other reason); the node exits 0,
the launcher says it left, and no live node holds a block.
"""

from __future__ import annotations

import asyncio
import importlib.util

import grpc
import pytest

from pdserve.testing.waiting import until
from tests.e2e.cluster import FaultCluster, FaultSettings, assert_no_blocks_held
from tests.e2e.test_drain import BLOCKS_FREED_S, Stream, busy, greedy, prompt, resumes, wait_left
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

LONG_STREAM = 120  # tokens: ~6 s at the decode step delay, well past the drain timeout
SETTINGS = FaultSettings(max_num_batched_tokens=16, lease_s=20.0, heartbeat_timeout_s=5.0,
                         decode_step_delay_s=0.05, decode_args=("--drain-timeout-s", "1"), metrics=True)


def test_what_outlives_the_drain_timeout_resumes_on_another_node(model_dir_llama, tmp_path):
    ids = prompt(24, seed=5)
    [ref] = greedy_references(model_dir_llama, [ids], [LONG_STREAM])
    with FaultCluster(model_dir_llama, tmp_path, 1, 2, SETTINGS) as cluster:
        drained: list[str] = []

        async def scenario() -> Stream:
            stream = Stream(cluster.router, greedy(ids, LONG_STREAM))
            await until(lambda: len(stream.tokens) >= 10, timeout_s=60.0, interval_s=0.02)
            name = busy(cluster, "decode", lambda s: s.num_running == 1)
            drained.append(name)
            cluster.terminate(name)
            return await stream.done()

        stream = asyncio.run(scenario())
        assert (stream.code, stream.details) == (grpc.StatusCode.OK, "")
        assert_matches([stream.tokens], [ref])
        wait_left(cluster, drained[0])
        assert resumes(cluster) == {"node_failed": 0.0, "node_gone": 0.0, "kv_lost": 0.0, "drain_timeout": 1.0}
        assert_no_blocks_held(cluster, BLOCKS_FREED_S)


@pytest.fixture
def model_dir_llama(tiny_llama) -> str:
    return str(tiny_llama)
