"""Clients that cancel at random moments leave nothing behind on any node.

Router + prefill + decode processes on 127.0.0.1 (1P1D and 2P2D), every engine step
slowed a little (`--debug-step-delay-s`) so that a prompt's prefill spans several steps
and the moments a client can cancel at are spread over every stage: before the decode
node's READY, during the prefill and its KV pushes, right after token 1, mid-decode and
just before the last token. The plan of every request comes from a seeded RNG. Every
request ends OK or CANCELLED; what the client saw is a prefix of the greedy reference
(the whole of it when OK); afterwards no node has a used or reserved block and the
cluster still serves an exact greedy request.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest

from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.proto import pdserve_pb2_grpc

from ..integration.reference import assert_matches, greedy_references
from .outcomes import Outcome, greedy_request, held_blocks, outcome_of, wait_idle

BLOCK_SIZE = 8
NUM_REQUESTS = 24
CONCURRENCY = 8
MAX_TOKENS = 16
# Long: a reservation cancelled at any stage is freed at once (its write permit revoked
# first), so no block waits for a lease.
LEASE_S = 30.0
NODE_ARGS = ("--debug-step-delay-s", "0.02", "--lease-s", str(LEASE_S))


@dataclass(frozen=True)
class CancelPlan:
    stage: str
    after_s: float | None = None  # cancel this long after sending
    after_tokens: int | None = None  # cancel once this many tokens arrived

    @staticmethod
    def draw(rng: random.Random) -> CancelPlan:
        stage = rng.choice(["before-ready", "prefill-or-transfer", "after-token-1", "mid-decode", "at-the-end"])
        if stage == "before-ready":
            return CancelPlan(stage, after_s=rng.uniform(0.0, 0.005))
        if stage == "prefill-or-transfer":
            return CancelPlan(stage, after_s=rng.uniform(0.01, 0.12))
        if stage == "after-token-1":
            return CancelPlan(stage, after_tokens=1)
        if stage == "mid-decode":
            return CancelPlan(stage, after_tokens=rng.randrange(2, MAX_TOKENS - 1))
        return CancelPlan(stage, after_tokens=MAX_TOKENS - 1)


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(2024)
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randrange(1, 200))] for _ in range(NUM_REQUESTS)]
    plans = [CancelPlan.draw(rng) for _ in range(NUM_REQUESTS)]
    return prompts, plans, greedy_references(model_dir, prompts, [MAX_TOKENS] * NUM_REQUESTS)


async def cancelled(stub, prompt: list[int], plan: CancelPlan) -> Outcome:
    call = stub.Generate(greedy_request(prompt, MAX_TOKENS), timeout=120)
    if plan.after_s is not None:
        reading = asyncio.ensure_future(outcome_of(call))
        await asyncio.sleep(plan.after_s)
        call.cancel()
        return await reading
    outcome = Outcome(grpc.StatusCode.OK)
    try:
        async for response in call:
            outcome.responses.append(response)
            if len(outcome.token_ids) >= plan.after_tokens:
                call.cancel()
                outcome.code = grpc.StatusCode.CANCELLED
                break
    except grpc.aio.AioRpcError as exc:
        outcome.code, outcome.details = exc.code(), exc.details() or ""
    return outcome


async def run_all(router: str, prompts, plans) -> list[Outcome]:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(prompt, plan):
        async with limit:
            return await cancelled(stub, prompt, plan)

    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one(p, plan) for p, plan in zip(prompts, plans)))


async def one_greedy(router: str, prompt: list[int], max_tokens: int) -> Outcome:
    async with grpc.aio.insecure_channel(router) as channel:
        return await outcome_of(pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt, max_tokens),
                                                                                   timeout=120))


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 1), (2, 2)])
def test_random_cancellation_at_every_stage_frees_every_block(model_dir, workload, num_prefill, num_decode):
    prompts, plans, refs = workload
    node = NodeSettings(block_size=BLOCK_SIZE, max_num_batched_tokens=64)
    with running_cluster(model_dir, num_prefill, num_decode, node, prefill_args=NODE_ARGS,
                         decode_args=NODE_ARGS) as cluster:
        outcomes = asyncio.run(run_all(cluster.router, prompts, plans))
        idle = wait_idle(cluster)
        after = asyncio.run(one_greedy(cluster.router, prompts[0], MAX_TOKENS))
        idle_again = wait_idle(cluster)

    assert {o.code for o in outcomes} <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}, \
        [(o.code, o.details) for o in outcomes]
    for outcome, ref in zip(outcomes, refs):
        seen = outcome.token_ids
        if outcome.code is grpc.StatusCode.OK:
            assert len(seen) == MAX_TOKENS
        assert_matches([seen], [ref.__class__(ref.token_ids[: len(seen)], ref.top2_gaps[: len(seen)])])
    stages = Counter((plan.stage, outcome.code.name, min(len(outcome.token_ids), 2))
                     for plan, outcome in zip(plans, outcomes))
    print("(stage, status, tokens seen: 0 / 1 / 2+) ->", dict(sorted(stages.items())))
    # Every stage of the plan was exercised, and some cancels landed before any token.
    assert {plan.stage for plan in plans} == {"before-ready", "prefill-or-transfer", "after-token-1", "mid-decode",
                                              "at-the-end"}
    assert any(o.code is grpc.StatusCode.CANCELLED and not o.token_ids for o in outcomes)
    expected_idle = [("prefill", 0, 0)] * num_prefill + [("decode", 0, 0)] * num_decode
    assert held_blocks(idle) == expected_idle
    assert after.code is grpc.StatusCode.OK, after.details
    assert_matches([after.token_ids], [refs[0]])
    assert held_blocks(idle_again) == expected_idle
