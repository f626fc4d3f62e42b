"""Chaos: a fixed number of streamed greedy requests while nodes are SIGKILLed and restarted.

Router + 2 prefill + 2 decode processes on 127.0.0.1 (tiny float32 Llama, short lease
and heartbeat timeout). Two waves of requests, each launched open-loop (one every
`LAUNCH_GAP_S`, prompts and lengths varied, a generous client deadline):

    wave 1 ─ kill the busiest decode node mid-wave ─ restart it, wait until it registers
    wave 2 ─ kill the busiest prefill node mid-wave ─ restart it, wait until it registers

Every request must end exactly once, in one of two ways: completed with exactly the
transformers greedy tokens, or failed with a clear status (UNAVAILABLE,
RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, and a message). The test prints and asserts
completed + failed == total, hung == 0 (each request is bounded by its deadline), and
leaked blocks == 0 (every live node ends with zero used and zero reserved blocks). It
also asserts that the decode kill was survived by resuming (the router logged resumes)
and that most requests completed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from dataclasses import dataclass

import grpc
import pytest
import torch
from pdserve.model_factory import make_model
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

from tests.e2e.cluster import FaultCluster, FaultSettings
from tests.integration.reference import NEAR_TIE, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

NUM_REQUESTS = 40  # two waves of 20
LAUNCH_GAP_S = 0.2
KILL_AFTER_S = 1.5  # into a wave: most of its requests are in flight
DEADLINE_S = 180.0
CLEAR_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
SETTINGS = FaultSettings(max_num_batched_tokens=32, lease_s=2.0, heartbeat_timeout_s=3.0,
                         prefill_step_delay_s=0.02, decode_step_delay_s=0.03)


@dataclass
class Outcome:
    tokens: list[int]
    error: grpc.aio.AioRpcError | None = None
    done: bool = False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("chaos") / "llama", "llama", "tiny", dtype=torch.float32))


def workload(model_dir: str):
    rng = random.Random(5)
    lengths = [rng.randrange(1, 160) for _ in range(NUM_REQUESTS)]
    max_tokens = [rng.randrange(8, 64) for _ in range(NUM_REQUESTS)]
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in lengths]
    return prompts, max_tokens, greedy_references(model_dir, prompts, max_tokens)


async def stream(stub, ids: list[int], max_tokens: int, outcome: Outcome) -> None:
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=ids),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    try:
        async for response in stub.Generate(request, timeout=DEADLINE_S):
            outcome.tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as exc:
        outcome.error = exc
    outcome.done = True


def busiest(cluster: FaultCluster, kind: str) -> str:
    names = [n for n in cluster.live_nodes() if n.startswith(kind)]
    stats = {n: cluster.stats(n) for n in names}
    load = {n: s.num_running + s.num_waiting + s.reserved_blocks for n, s in stats.items()}
    return max(names, key=lambda n: (load[n], n))


async def wave(stub, cluster: FaultCluster, kind: str, requests, outcomes: list[Outcome]) -> str:
    """Launch the wave open-loop, kill the busiest node of `kind` mid-wave, restart it."""
    tasks = []
    for ids, max_tokens, outcome in zip(*requests, outcomes):
        tasks.append(asyncio.create_task(stream(stub, ids, max_tokens, outcome)))
        await asyncio.sleep(LAUNCH_GAP_S)
        if len(tasks) == int(KILL_AFTER_S / LAUNCH_GAP_S):
            victim = await asyncio.to_thread(busiest, cluster, kind)
            cluster.kill(victim)
            print(f"killed {victim} with {len(tasks)} requests launched")
    cluster.restart(victim)
    await asyncio.to_thread(cluster.wait_serving, 2, 2, 240.0)
    await asyncio.wait(tasks, timeout=DEADLINE_S + 10)
    return victim


def matches(got: list[int], ref) -> bool:
    mismatch = next((j for j, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
    if mismatch is None:
        return len(got) == len(ref.token_ids)
    return ref.top2_gaps[mismatch] < NEAR_TIE  # the only tolerated divergence


def test_chaos_kill_and_restart_a_decode_and_a_prefill_node(model_dir, tmp_path):
    prompts, max_tokens, refs = workload(model_dir)
    outcomes = [Outcome([]) for _ in range(NUM_REQUESTS)]
    half = NUM_REQUESTS // 2
    with FaultCluster(model_dir, tmp_path, 2, 2, SETTINGS) as cluster:

        async def run() -> None:
            async with grpc.aio.insecure_channel(cluster.router) as channel:
                stub = pdserve_pb2_grpc.GenerationStub(channel)
                await wave(stub, cluster, "decode", (prompts[:half], max_tokens[:half]), outcomes[:half])
                await wave(stub, cluster, "prefill", (prompts[half:], max_tokens[half:]), outcomes[half:])

        asyncio.run(run())
        held = cluster.wait_no_blocks(timeout_s=20.0)
        router_log = cluster.log("router")

    completed = [i for i, o in enumerate(outcomes) if o.done and o.error is None and matches(o.tokens, refs[i])]
    failed = [i for i, o in enumerate(outcomes)
              if o.done and o.error is not None and o.error.code() in CLEAR_FAILURES and o.error.details()]
    hung = [i for i, o in enumerate(outcomes) if not o.done]
    wrong = sorted(set(range(NUM_REQUESTS)) - set(completed) - set(failed) - set(hung))
    leaked = sum(used + reserved for used, reserved in held.values())
    resumes = router_log.count(": resume on ")
    retries = router_log.count(": retry on ")
    print(f"\nchaos: total={NUM_REQUESTS} completed={len(completed)} failed={len(failed)} hung={len(hung)} "
          f"wrong={len(wrong)} leaked_blocks={leaked} resumes={resumes} retries={retries}")
    for i in failed:
        print(f"  request {i} failed: {outcomes[i].error.code().name}: {outcomes[i].error.details()}")
    for i in wrong:
        o = outcomes[i]
        print(f"  request {i} WRONG: error={o.error and (o.error.code(), o.error.details())} "
              f"tokens={o.tokens[:8]}... ref={refs[i].token_ids[:8]}...")
    assert len(completed) + len(failed) == NUM_REQUESTS, f"wrong: {wrong}, hung: {hung}"
    assert hung == [] and wrong == []
    assert leaked == 0, held
    assert resumes >= 1, "no request was resumed after the decode node was killed"
    assert len(completed) >= NUM_REQUESTS // 2
