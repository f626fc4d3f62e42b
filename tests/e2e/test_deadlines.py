"""The client's deadline bounds every stage, end to end, through real processes.

Router + 1 prefill + 1 decode node on 127.0.0.1, both nodes slowed on purpose
(`--debug-step-delay-s`: every engine step takes at least that long) so that a short
deadline lands in a known stage: waiting in the prefill node's queue, prefilling, or
decoding. Each time the client gets exactly DEADLINE_EXCEEDED, no node keeps a used or
reserved block, and the cluster still serves an exact greedy request afterwards.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import pdserve_pb2_grpc
from pdserve.testing.waiting import until

from ..integration.reference import assert_matches, greedy_references
from .outcomes import greedy_request, held_blocks, outcome_of, wait_idle

BLOCK_SIZE = 8
STEP_DELAY_S = "0.25"
CHUNK = 16  # tokens per prefill step: a 240-token prompt takes 15 slowed steps
LONG_PROMPT = 240
SHORT_PROMPT = 16
DEADLINE_S = 1.5  # well inside the long prefill; well after a short prompt's single step


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    node = NodeSettings(block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK)
    # One request at a time on the prefill node, so a second one waits in its queue.
    prefill_args = ("--debug-step-delay-s", STEP_DELAY_S, "--max-num-seqs", "1")
    decode_args = ("--debug-step-delay-s", STEP_DELAY_S)
    with running_cluster(model_dir, 1, 1, node, prefill_args=prefill_args, decode_args=decode_args) as cluster:
        yield cluster


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


async def prefill_stats(cluster):
    stats = await asyncio.to_thread(cluster.stats)
    return next(s for s in stats if s.kind == "prefill")


async def until_prefill(cluster, predicate, timeout_s: float = 30.0):
    """Poll the prefill node's stats until `predicate` holds; returns those stats."""
    async def matching():
        stats = await prefill_stats(cluster)
        return stats if predicate(stats) else None

    return await until(matching, timeout_s, interval_s=0.05)


def assert_idle(cluster) -> None:
    assert held_blocks(wait_idle(cluster)) == [("prefill", 0, 0), ("decode", 0, 0)]


def test_deadline_while_prefilling(cluster):
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            call = pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt(LONG_PROMPT, 1), 8),
                                                                      timeout=DEADLINE_S)
            ending = asyncio.create_task(outcome_of(call))
            busy = await until_prefill(cluster, lambda s: s.num_running == 1 or ending.done())
            return busy, await ending

    busy, outcome = asyncio.run(scenario())
    assert outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED, outcome.details
    assert outcome.responses == []  # token 1 never came: the deadline hit the prefill
    assert busy.num_running == 1 and busy.used_blocks > 0
    assert_idle(cluster)


def test_deadline_while_waiting_in_the_prefill_nodes_queue(cluster, model_dir):
    first_prompt, queued_prompt = prompt(LONG_PROMPT, 2), prompt(SHORT_PROMPT, 3)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            first = asyncio.create_task(outcome_of(stub.Generate(greedy_request(first_prompt, 4), timeout=120)))
            await until_prefill(cluster, lambda s: s.num_running == 1)
            queued = asyncio.create_task(outcome_of(stub.Generate(greedy_request(queued_prompt, 4),
                                                                  timeout=DEADLINE_S)))
            waiting = await until_prefill(cluster, lambda s: s.num_waiting == 1 or queued.done())
            return waiting, await queued, await first

    waiting, queued, first = asyncio.run(scenario())
    assert waiting.num_waiting == 1 and waiting.num_running == 1
    assert queued.code is grpc.StatusCode.DEADLINE_EXCEEDED and queued.responses == [], queued.details
    assert first.code is grpc.StatusCode.OK, first.details
    assert_matches([first.token_ids], greedy_references(model_dir, [first_prompt], [4]))
    assert_idle(cluster)


def test_deadline_while_decoding(cluster):
    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            call = pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt(SHORT_PROMPT, 4), 500),
                                                                      timeout=4.0)
            return await outcome_of(call)

    outcome = asyncio.run(scenario())
    assert outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED, outcome.details
    # Token 1 (prefill node) and at least one decode-node token came before the deadline.
    assert len(outcome.token_ids) >= 2
    assert all(r.finish_reason == 0 for r in outcome.responses)
    assert_idle(cluster)


def test_the_cluster_still_serves_exactly_after_the_deadlines(cluster, model_dir):
    p = prompt(30, 5)

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            return await outcome_of(pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy_request(p, 6),
                                                                                       timeout=120))

    outcome = asyncio.run(scenario())
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert_matches([outcome.token_ids], greedy_references(model_dir, [p], [6]))
    assert_idle(cluster)
