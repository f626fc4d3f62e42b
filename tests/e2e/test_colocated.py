"""The colocated baseline end to end, and cores as devices: real router and node processes on 127.0.0.1.

A router with 2 colocated nodes (each runs both phases) serves concurrent greedy
streams token-identical to transformers; Health reports the colocated nodes; a node
refuses at once (RESOURCE_EXHAUSTED) a request it can never hold; a cancelled stream
frees every block; a conversation's next turn goes to the node that holds its history in its
prefix cache; every node ends with zero blocks in use. A node started with
`--cpus 0` runs its front and its engine core on core 0 only, with one torch thread.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.e2e.cluster import HOST, NodeSettings, free_port, running_cluster
from pdserve.testing.metrics import gauge
from pdserve.cluster_supervisor import ChildSpec, ClusterSupervisor
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import wait_until

from ..integration.reference import assert_matches, greedy_references

BLOCK_SIZE = 8
NUM_BLOCKS = 256
PROMPT_LENS = [1, 9, 17, 30, 47, 64, 90, 150, 33, 120]
NEW_TOKENS = [12, 20, 8, 16, 24, 5, 20, 12, 16, 1]
HELD_TOKENS = 1500  # a stream that runs seconds, held open while the router's view catches up (196 of 256 blocks)


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, greedy_references(model_dir, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def cluster(model_dir):
    settings = NodeSettings(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    with running_cluster(model_dir, 0, 0, settings, num_colocated=2, metrics=True) as running:
        yield running


def greedy(prompt: list[int], max_tokens: int) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=prompt),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )


async def run_concurrently(router: str, prompts, new_tokens) -> list[list[pdserve_pb2.GenerateResponse]]:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one(prompt, n):
            return [r async for r in stub.Generate(greedy(prompt, n), timeout=120)]

        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, new_tokens)))


def health(router: str) -> pdserve_pb2.HealthResponse:
    with grpc.insecure_channel(router) as channel:
        return pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=10)


def test_colocated_greedy_is_token_exact(cluster, workload):
    prompts, refs = workload
    status = health(cluster.router)
    assert (status.serving, status.colocated_nodes, status.prefill_nodes, status.decode_nodes) == (True, 2, 0, 0)

    streams = asyncio.run(run_concurrently(cluster.router, prompts, NEW_TOKENS))
    assert_matches([[t for r in stream for t in r.token_ids] for stream in streams], refs)
    for prompt, n, stream in zip(prompts, NEW_TOKENS, streams):
        last = stream[-1]
        assert last.finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), n)
        assert last.timings.kv_transfer_bytes == 0  # nothing moved between nodes

    stats = cluster.wait_all_blocks_free(timeout_s=5)
    assert [s.kind for s in stats] == ["colocated", "colocated"]
    assert [s.used_blocks for s in stats] == [0, 0]
    assert all(s.prefix_cache_queries > 0 for s in stats), "both nodes served requests"
    assert all(s.kv_transfer.transfers == 0 for s in stats)


def test_a_node_refuses_at_once_what_it_can_never_hold(cluster):
    """RESOURCE_EXHAUSTED (not queued forever): the router would try a node with more blocks."""
    too_long = NUM_BLOCKS * BLOCK_SIZE  # prompt + max_tokens need more blocks than the node has
    params = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=too_long, ignore_eos=True)
    request = node_pb2.SampleRequest(request_id="too-long", prompt_token_ids=[5, 6, 7], sampling_params=params,
                                     seed=1)
    with grpc.insecure_channel(cluster.colocated[0]) as channel, pytest.raises(grpc.RpcError) as err:
        list(node_pb2_grpc.ColocatedNodeStub(channel).Generate(request, timeout=30))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == f"prompt + max_tokens need {NUM_BLOCKS + 1} KV blocks; this node has {NUM_BLOCKS}"
    assert [s.used_blocks for s in cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]


def test_cancel_mid_stream_frees_every_block(cluster, workload):
    prompts, _ = workload

    async def cancel_after_three():
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            call = pdserve_pb2_grpc.GenerationStub(channel).Generate(greedy(prompts[7], 1000), timeout=120)
            seen = 0
            async for _ in call:
                seen += 1
                if seen == 3:
                    call.cancel()
                    break
            return seen

    assert asyncio.run(cancel_after_three()) == 3
    stats = cluster.wait_all_blocks_free(timeout_s=5)
    assert [s.used_blocks for s in stats] == [0, 0]
    assert [s.num_running + s.num_waiting for s in stats] == [0, 0]


# ---- cores as devices ----------------------------------------------------------------


def cpus_allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def wait_for_line(supervisor: ClusterSupervisor, name: str, needle: str, timeout_s: float = 240) -> str:
    def line() -> str | None:
        supervisor.raise_if_exited()
        return next((line for line in supervisor.tail(name) if needle in line), None)

    return wait_until(line, lambda: f"{name} prints {needle!r}: {supervisor.tail(name)}", timeout_s, interval_s=0.1)


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_a_conversation_returns_to_the_node_that_holds_its_prefix(cluster):
    """Two conversations start at once and are spread over the two nodes; each next turn (its
    history plus new tokens) goes back to the node that holds the history in its prefix cache,
    though both nodes are idle and by load alone the same node would take every turn."""
    rng = random.Random(11)
    before = cluster.stats()
    opened_ns = time.time_ns()
    histories = open_on_both_nodes(cluster, rng)
    for history in histories:  # a conversation's two turns in a row: load alone would alternate them
        for _ in range(2):
            new_tokens = [rng.randrange(1, 900) for _ in range(BLOCK_SIZE)]
            asyncio.run(run_concurrently(cluster.router, [history + new_tokens], [1]))
    stats = cluster.wait_all_blocks_free(timeout_s=5)
    assert [s.used_blocks for s in stats] == [0, 0]
    # Every later turn found its whole 8-block history on its node: 2 turns x 8 blocks each.
    assert [s.prefix_cache_hits - b.prefix_cache_hits for s, b in zip(stats, before)] == [16, 16]
    # Each node's stats name the router's placement stamp of the last request it took in (wall-clock
    # nanoseconds at the latest, and after the first turns were sent): how the router tells which
    # stats show what it sent.
    assert all(opened_ns < s.placed_through <= time.time_ns() for s in stats), [s.placed_through for s in stats]


def test_a_node_pinned_to_one_core_runs_there_with_one_torch_thread(model_dir):
    argv = (sys.executable, "-m", "pdserve", "colocated", "--model", model_dir, "--host", HOST, "--port", "0",
            "--router", f"{HOST}:{free_port()}", "--dtype", "float32", "--num-blocks", "64", "--cpus", "0")
    with ClusterSupervisor(console=io.StringIO()) as supervisor:
        front = supervisor.start(ChildSpec("colocated-0", argv))
        # The core logs its cpus and threads before the front starts listening.
        wait_for_line(supervisor, "colocated-0", "pdserve colocated node listening on")
        core_line = wait_for_line(supervisor, "colocated-0", "engine core on cpus")
        assert core_line.endswith("engine core on cpus 0 with 1 torch threads")
        assert cpus_allowed(front) == "0"
        children = descendants(front)
        cores = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(cores) == 1, children
        assert {pid: cpus_allowed(pid) for pid in children} == {pid: "0" for pid in children}


def open_on_both_nodes(cluster, rng: random.Random, attempts: int = 3) -> list[list[int]]:
    """Two conversations' first turns, one on each node. Once the router's view of the nodes
    (their stats, as its metrics show them) holds no block and no queued prompt — a heartbeat can
    still show what an earlier test freed — the first is sent and held open (a long stream,
    cancelled once the second is done) until that view has its blocks in use; placement, which
    ranks by queued prompt tokens and then free blocks, then sends the second to the other node.
    On a loaded machine the view can catch up only after the held stream has ended: then nothing
    in it held the first node's blocks when the second was placed, and two new conversations
    are opened instead. Two CI runs on 2 loaded cores also saw both land on one node with the
    held stream still open (cause not found yet); that, too, is tried again, and fails the test
    only if every try does it."""
    opened: list[int] = []
    for _ in range(attempts):
        histories = [[rng.randrange(1, 900) for _ in range(8 * BLOCK_SIZE)] for _ in range(2)]
        before = cluster.stats()
        held_throughout = asyncio.run(_second_while_first_streams(cluster, histories))
        after = cluster.stats()
        cluster.wait_all_blocks_free(timeout_s=5)  # the cancelled stream's blocks are back
        opened = [s.prefix_cache_queries - b.prefix_cache_queries for s, b in zip(after, before)]
        if held_throughout and all(q > 0 for q in opened):
            return histories
    pytest.fail(f"in each of {attempts} tries the held stream ended before the second conversation was done, "
                f"or both conversations started on one node (prefix queries per node, last try: {opened})")


async def _second_while_first_streams(cluster, histories: list[list[int]]) -> bool:
    """Whether the first conversation's stream was still open when the second's had ended."""
    first, second = histories

    def view(family: str) -> list[float]:
        return list(gauge(cluster.metrics["router"], f"pdserve_node_{family}", "node").values())

    def blocks_in_use() -> list[float]:
        return view("kv_blocks_used")

    def idle() -> bool:  # placement ranks by queued prompt tokens, then free blocks: both even
        return not any(blocks_in_use()) and not any(view("queued_prefill_tokens"))

    async def read_to_the_end(call) -> None:
        while await call.read() is not grpc.aio.EOF:
            pass

    await asyncio.to_thread(wait_until, idle, "the router's stats show no block in use and no prompt queued", 30)
    async with grpc.aio.insecure_channel(cluster.router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        held = stub.Generate(greedy(first, HELD_TOKENS), timeout=120)
        await held.read()  # token 1: the first conversation's prompt is computed and holds its blocks
        reading = asyncio.create_task(read_to_the_end(held))
        await asyncio.to_thread(wait_until, lambda: reading.done() or any(blocks_in_use()),
                                "the router's stats show blocks in use", 30)
        if not reading.done():
            _ = [r async for r in stub.Generate(greedy(second, 1), timeout=120)]
        held_throughout = not reading.done()
        held.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        return held_throughout
