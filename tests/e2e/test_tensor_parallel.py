"""Tensor-parallel pools in real clusters: `pdserve cluster` plus nodes started by hand with
`pdserve prefill|decode --tp N`, the way a user grows a cluster.

- Mixed pools: prefill nodes of TP=1 and TP=2 and decode nodes of TP=2 and TP=1 behind one
  router, so every pairing happens (1P(TP=2)→1D(TP=1), 1P(TP=1)→1D(TP=2), TP=2→TP=2, 1→1),
  the launcher's nodes on the native model path and the hand-started ones on transformers':
  24 concurrent greedy float32 streams are token-identical to transformers; each request moved
  exactly its prompt's blocks; a TP=2 node's ranks each moved exactly half of its bytes (its
  KV heads), the prefill ranks' sum equals the decode ranks' sum equals the expected total;
  every node ends with zero blocks in use or reserved (counted once per node).
- A colocated node of TP=2: exact, zero blocks, and its stats say two ranks.
- SIGKILL of a decode node's worker rank mid-stream: the node goes down at once (its engine
  core and every rank gone, no orphan), the stream resumes on the other decode node and ends
  with exactly the reference tokens, and nothing is left held anywhere.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import FaultCluster, FaultSettings, NodeSettings, busy_node, free_port, running_cluster
from tests.e2e.streams import Stream, greedy
from tests.integration.reference import assert_matches, greedy_references
from pdserve.testing.waiting import wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

BLOCK_SIZE = 8
NODE = NodeSettings(block_size=BLOCK_SIZE)
PROMPT_LENS = [1, 5, 8, 9, 17, 30, 47, 64, 65, 90, 120, 33, 2, 77, 40, 16, 3, 25, 50, 70, 12, 7, 100, 60]
# No request of one token: its decode reservation ends at token 1, so whatever of its KV is still on
# the way is dropped on arrival, by each rank on its own timing (tests/e2e/test_cluster.py covers that).
NEW_TOKENS = [8, 12, 6, 10, 8, 5, 12, 8, 10, 2, 12, 8, 10, 12, 8, 6, 9, 7, 11, 5, 8, 10, 6, 9]
STUBS = {"prefill": node_pb2_grpc.PrefillNodeStub, "decode": node_pb2_grpc.DecodeNodeStub}


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def workload(model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 900) for _ in range(n)] for n in PROMPT_LENS]
    return prompts, greedy_references(model_dir, prompts, NEW_TOKENS)


def block_bytes() -> int:
    """One block of the tiny model's KV, all heads, K and V, every layer (float32)."""
    return 2 * 3 * 2 * BLOCK_SIZE * 16 * 4  # layers, KV heads, head dim


class HandStartedNode:
    """`pdserve <kind> --tp N` joining a running cluster's router, as a user would start it."""

    def __init__(self, kind: str, tp: int, router: str, model_dir: str, log: Path, model_impl: str = "auto") -> None:
        self.kind, self.log = kind, log
        self.port = free_port()
        command = [sys.executable, "-m", "pdserve", kind, "--router", router, "--model", model_dir,
                   "--dtype", NODE.dtype, "--block-size", str(BLOCK_SIZE), "--port", str(self.port),
                   "--tp", str(tp), "--model-impl", model_impl, *NODE.node_args()]
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stats(self) -> node_pb2.NodeStats:
        with grpc.insecure_channel(self.address) as channel:
            return STUBS[self.kind](channel).GetStats(node_pb2.StatsRequest(), timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)


async def stream_all(router: str, prompts, new_tokens) -> list[list[pdserve_pb2.GenerateResponse]]:
    async def one(stub, prompt, n):
        request = greedy(prompt, n)
        return [r async for r in stub.Generate(request, timeout=180)]

    async with grpc.aio.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return await asyncio.gather(*(one(stub, p, n) for p, n in zip(prompts, new_tokens)))


def serving(cluster, prefill: int, decode: int) -> bool:
    try:
        health = cluster.health()
    except grpc.RpcError:
        return False
    return (health.prefill_nodes, health.decode_nodes) == (prefill, decode)


def test_mixed_tensor_parallel_pools_are_token_exact_and_move_each_ranks_heads(model_dir, workload, tmp_path):
    prompts, refs = workload
    with running_cluster(model_dir, 1, 1, NODE, decode_args=("--tp", "2")) as cluster:
        # The hand-started nodes run transformers' own modeling (and its TP plan): their KV heads
        # must land in the native nodes' ranks, and the native nodes' in theirs, all the same.
        extra = [HandStartedNode("prefill", 2, cluster.router, model_dir, tmp_path / "prefill-tp2.log",
                                 "transformers"),
                 HandStartedNode("decode", 1, cluster.router, model_dir, tmp_path / "decode-tp1.log", "transformers")]
        try:
            wait_until(lambda: serving(cluster, 2, 2), "the hand-started nodes register", timeout_s=240.0,
                       interval_s=0.2)
            streams = asyncio.run(stream_all(cluster.router, prompts, NEW_TOKENS))
            outputs = [[t for r in stream for t in r.token_ids] for stream in streams]
            assert_matches(outputs, refs)
            for prompt, stream in zip(prompts, streams):
                assert stream[-1].timings.kv_transfer_bytes == -(-len(prompt) // BLOCK_SIZE) * block_bytes()

            cluster.wait_all_blocks_free()
            nodes = {**cluster.node_stats(), "prefill-tp2": extra[0].stats(), "decode-tp1": extra[1].stats()}
            assert {name: s.tensor_parallel_size for name, s in nodes.items()} == {
                "prefill-0": 1, "decode-0": 2, "prefill-tp2": 2, "decode-tp1": 1}
            assert {name: (s.used_blocks, s.reserved_blocks) for name, s in nodes.items()} == dict.fromkeys(
                nodes, (0, 0))
            expected = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) * block_bytes()
            for name, s in nodes.items():
                ranks = [r.bytes for r in s.kv_transfer_ranks]
                assert len(ranks) == s.tensor_parallel_size and sum(ranks) == s.kv_transfer.bytes > 0, name
                assert len(set(ranks)) == 1, f"{name}: each rank moves its half of the heads, got {ranks}"
            sent = sum(s.kv_transfer.bytes for n, s in nodes.items() if n.startswith("prefill"))
            received = sum(s.kv_transfer.bytes for n, s in nodes.items() if n.startswith("decode"))
            assert sent == received == expected
        finally:
            for node in extra:
                node.stop()


def test_a_colocated_node_of_two_ranks_is_token_exact(model_dir, workload):
    prompts, refs = workload
    with running_cluster(model_dir, 0, 0, NODE, num_colocated=1, colocated_args=("--tp", "2")) as cluster:
        streams = asyncio.run(stream_all(cluster.router, prompts[:8], NEW_TOKENS[:8]))
        assert_matches([[t for r in s for t in r.token_ids] for s in streams], refs[:8])
        stats = cluster.wait_all_blocks_free()
        assert [(s.tensor_parallel_size, s.used_blocks, s.reserved_blocks) for s in stats] == [(2, 0, 0)]


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def test_a_decode_worker_rank_killed_mid_stream_takes_its_node_down_and_the_stream_resumes_exactly(
        model_dir, tmp_path_factory):
    settings = FaultSettings(block_size=BLOCK_SIZE, max_num_batched_tokens=16, lease_s=6.0, heartbeat_timeout_s=3.0,
                             decode_step_delay_s=0.05, decode_args=("--tp", "2"))
    prompt = [random.Random(5).randrange(1, 900) for _ in range(40)]
    ref = greedy_references(model_dir, [prompt], [120])
    with FaultCluster(model_dir, tmp_path_factory.mktemp("tp-logs"), 1, 2, settings) as cluster:
        async def scenario():
            stream = Stream(cluster.router, greedy(prompt, 120))
            await stream.until(lambda: len(stream.tokens) >= 15)
            victim = busy_node(cluster, "decode")
            node_pid = cluster.pids()[victim]
            processes = descendants(node_pid)  # its engine core (rank 0) and rank 1 below it
            os.kill(worker_rank(node_pid, processes), signal.SIGKILL)
            return await stream.done(), node_pid, processes

        stream, node_pid, processes = asyncio.run(scenario())
        assert stream.error is None, stream.error
        assert_matches([stream.tokens], ref)  # resumed on the other decode node: no gap, no duplicate
        wait_until(lambda: not any(_alive(p) for p in processes | {node_pid}),
                   "every process of the node whose rank died is gone", 60, interval_s=0.2)
        held = cluster.wait_no_blocks(60.0)  # the launcher starts the node again meanwhile: it answers once loaded
        assert all(h == (0, 0) for h in held.values()), f"blocks still held (used, reserved): {held}"


def worker_rank(node_pid: int, processes: set[int]) -> int:
    """The node's rank 1: a process spawned by its engine core, itself spawned by the front
    (multiprocessing's resource trackers are children too, and are not ranks)."""
    def spawned(pid: int) -> bool:
        cmdline = _cmdline(pid)
        return "multiprocessing.spawn" in cmdline and "resource_tracker" not in cmdline

    cores = [p for p in processes if node_pid in _parents(p) and spawned(p)]
    workers = [p for p in processes if _parents(p) & set(cores) and spawned(p)]
    assert len(cores) == 1 and len(workers) == 1, f"engine cores {cores}, worker ranks {workers}"
    return workers[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _parents(pid: int) -> set[int]:
    try:
        return {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])}
    except (OSError, IndexError, ValueError):
        return set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
