"""Chaos under `pdserve cluster --prefill 2 --decode 2`: nodes killed, frozen and the router killed.

Router + 2 prefill + 2 decode processes started by the launcher (tiny float32 Llama, short
lease and heartbeat timeout). Five waves of 16 concurrent streamed greedy requests
(prompts and lengths varied, a generous deadline), each with one fault once its streams
flow:

    kill the busiest decode node     the launcher restarts it; the test waits for 2P2D again
    kill the busiest prefill node    likewise
    freeze the busiest decode node   SIGSTOP until the router has dropped it, then SIGCONT
    freeze the busiest prefill node  likewise
    kill the router                  the launcher restarts it; nodes register again

Every stream of a node wave must end with exactly the transformers greedy tokens; in the
router wave, exactly those or UNAVAILABLE. A stream that ends by its deadline counts as
hung: nothing may wait on a dead or frozen node. Afterwards every node holds zero used
and zero reserved blocks, the cluster serves an exact request, and once the launcher is
stopped (Ctrl-C) no process of the cluster is left.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
from dataclasses import dataclass

import grpc
import pytest
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until

from tests.e2e.cluster import FaultCluster, FaultSettings
from tests.integration.reference import NEAR_TIE, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

WAVE = 16  # concurrent streams per wave, in flight when its fault lands
DEADLINE_S = 240.0
SETTINGS = FaultSettings(num_blocks=1024, max_num_batched_tokens=32, lease_s=2.0, heartbeat_timeout_s=3.0,
                         prefill_step_delay_s=0.02, decode_step_delay_s=0.03)
WAVES = (("kill", "decode"), ("kill", "prefill"), ("freeze", "decode"), ("freeze", "prefill"), ("kill", "router"))


@dataclass
class Outcome:
    tokens: list[int]
    error: grpc.aio.AioRpcError | None = None
    done: bool = False


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def workload(model_dir: str):
    rng = random.Random(5)
    total = WAVE * len(WAVES)
    lengths = [rng.randrange(1, 160) for _ in range(total)]
    max_tokens = [rng.randrange(8, 64) for _ in range(total)]
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
    if kind == "router":
        return "router"
    names = [n for n in cluster.live_nodes() if n.startswith(kind)]
    stats = {n: cluster.stats(n) for n in names}
    load = {n: s.num_running + s.num_waiting + s.reserved_blocks for n, s in stats.items()}
    return max(names, key=lambda n: (load[n], n))


def strike(cluster: FaultCluster, fault: str, victim: str) -> None:
    if fault == "kill":
        cluster.kill(victim)
        return
    cluster.freeze(victim)
    try:  # frozen until the router has dropped it: its streams must have moved on by then
        counts = (1, 2) if victim.startswith("prefill") else (2, 1)
        cluster.wait_serving(*counts, timeout_s=60.0)
    finally:
        cluster.thaw(victim)


def recover(cluster: FaultCluster, fault: str, victim: str) -> None:
    if fault == "kill":
        cluster.restart(victim)  # the launcher starts it again; this waits for that
    cluster.wait_serving(2, 2, timeout_s=240.0)  # and it registered (again)


async def wave(cluster: FaultCluster, fault: str, kind: str, requests, outcomes: list[Outcome]) -> str:
    """Launch the wave's streams at once, strike the busiest `kind` once the first tokens flow
    (every stream in flight), wait for its streams, then for the cluster to be whole again."""
    async with grpc.aio.insecure_channel(cluster.router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        tasks = [asyncio.create_task(stream(stub, ids, max_tokens, outcome))
                 for ids, max_tokens, outcome in zip(*requests, outcomes)]
        await until(lambda: any(o.tokens for o in outcomes), 120, interval_s=0.02)
        victim = await asyncio.to_thread(busiest, cluster, kind)
        in_flight = sum(not o.done for o in outcomes)
        print(f"{fault} {victim} with {in_flight} of {len(outcomes)} streams in flight")
        await asyncio.to_thread(strike, cluster, fault, victim)
        await asyncio.wait(tasks, timeout=DEADLINE_S + 10)
    await asyncio.to_thread(recover, cluster, fault, victim)
    return victim


def matches(got: list[int], ref) -> bool:
    mismatch = next((j for j, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
    if mismatch is None:
        return len(got) == len(ref.token_ids)
    return ref.top2_gaps[mismatch] < NEAR_TIE  # the only tolerated divergence


def test_chaos_kill_and_freeze_each_kind_then_the_router(model_dir, tmp_path):
    prompts, max_tokens, refs = workload(model_dir)
    outcomes = [Outcome([]) for _ in prompts]
    with FaultCluster(model_dir, tmp_path, 2, 2, SETTINGS) as cluster:

        async def run() -> None:
            for w, (fault, kind) in enumerate(WAVES):
                part = slice(w * WAVE, (w + 1) * WAVE)
                await wave(cluster, fault, kind, (prompts[part], max_tokens[part]), outcomes[part])

        asyncio.run(run())
        held = cluster.wait_no_blocks(timeout_s=20.0)
        router_log = "\n".join(cluster.log(name) for name in ("router",))
        after = asyncio.run(_one_exact(cluster.router, prompts[0], max_tokens[0]))
        pids = cluster.pids()
    left = [name for name, pid in pids.items() if _alive(pid)]

    router_wave = range(WAVE * (len(WAVES) - 1), WAVE * len(WAVES))
    completed = [i for i, o in enumerate(outcomes) if o.done and o.error is None and matches(o.tokens, refs[i])]
    unavailable = [i for i in router_wave
                   if outcomes[i].done and outcomes[i].error is not None
                   and outcomes[i].error.code() is grpc.StatusCode.UNAVAILABLE]
    hung = [i for i, o in enumerate(outcomes)
            if not o.done or (o.error is not None and o.error.code() is grpc.StatusCode.DEADLINE_EXCEEDED)]
    wrong = sorted(set(range(len(outcomes))) - set(completed) - set(unavailable) - set(hung))
    leaked = sum(used + reserved for used, reserved in held.values())
    resumes = router_log.count(": resume on ")
    print(f"\nchaos: total={len(outcomes)} completed={len(completed)} unavailable(router wave)={len(unavailable)} "
          f"hung={len(hung)} wrong={len(wrong)} leaked_blocks={leaked} resumes={resumes}")
    for i in wrong + hung:
        o = outcomes[i]
        print(f"  request {i}: error={o.error and (o.error.code(), o.error.details())} "
              f"tokens={o.tokens[:8]}... ref={refs[i].token_ids[:8]}...")
    assert hung == [] and wrong == [], f"wrong: {wrong}, hung: {hung}"
    assert leaked == 0, held
    assert resumes >= 1, "no request was resumed after a decode node was lost"
    assert after == refs[0].token_ids or matches(after, refs[0])  # the cluster serves afterwards
    assert left == [], f"processes left after the launcher stopped: {left}"


async def _one_exact(router: str, ids: list[int], max_tokens: int) -> list[int]:
    outcome = Outcome([])
    # A channel of its own: gRPC shares connection state between a process's channels to one
    # address, and the waves' channels saw the old router die (a reconnect backoff, not a refusal).
    async with grpc.aio.insecure_channel(router, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        await stream(pdserve_pb2_grpc.GenerationStub(channel), ids, max_tokens, outcome)
    assert outcome.error is None, outcome.error
    return outcome.tokens


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
