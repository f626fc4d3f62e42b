"""A local cluster with known addresses: router + prefill + decode processes on 127.0.0.1.

For tests and benchmarks that must talk to the nodes themselves (their `GetStats`),
which `pdserve cluster` does not expose. Every process is stopped on exit.
"""

from __future__ import annotations

import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from pdserve.cluster_supervisor import ChildSpec, ClusterSupervisor
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

HOST = "127.0.0.1"
START_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Cluster:
    router: str
    prefill: list[str]
    decode: list[str]

    def stats(self) -> list[node_pb2.NodeStats]:
        out = []
        for addr in self.prefill:
            with grpc.insecure_channel(addr) as ch:
                out.append(node_pb2_grpc.PrefillNodeStub(ch).GetStats(node_pb2.StatsRequest(), timeout=10))
        for addr in self.decode:
            with grpc.insecure_channel(addr) as ch:
                out.append(node_pb2_grpc.DecodeNodeStub(ch).GetStats(node_pb2.StatsRequest(), timeout=10))
        return out

    def wait_all_blocks_free(self, timeout_s: float) -> list[node_pb2.NodeStats]:
        """Every node's used blocks reach zero within timeout_s; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if all(s.used_blocks == 0 for s in stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


@dataclass(frozen=True)
class NodeSettings:
    dtype: str = "float32"
    block_size: int = 8
    num_blocks: int = 256
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    threads: int = 1


def _node_argv(kind: str, model_dir: str, port: int, router: str, index: int, node: NodeSettings) -> tuple[str, ...]:
    return (
        sys.executable, "-m", "pdserve", kind, "--model", model_dir, "--host", HOST, "--port", str(port),
        "--router", router, "--node-id", f"{kind}-{index}", "--kv-host", HOST, "--dtype", node.dtype,
        "--block-size", str(node.block_size), "--num-blocks", str(node.num_blocks),
        "--max-num-batched-tokens", str(node.max_num_batched_tokens),
        "--max-num-seqs", str(node.max_num_seqs), "--threads", str(node.threads),
    )


def _wait_serving(router: str, num_prefill: int, num_decode: int, supervisor: ClusterSupervisor) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            supervisor.raise_if_exited()
            try:
                health = stub.Health(pdserve_pb2.HealthRequest(), timeout=2)
                if health.prefill_nodes >= num_prefill and health.decode_nodes >= num_decode:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise TimeoutError(f"cluster at {router} not serving after {START_TIMEOUT_S}s")


@contextmanager
def running_cluster(model_dir: str, num_prefill: int, num_decode: int, node: NodeSettings = NodeSettings()):
    router = f"{HOST}:{free_port()}"
    prefill = [f"{HOST}:{free_port()}" for _ in range(num_prefill)]
    decode = [f"{HOST}:{free_port()}" for _ in range(num_decode)]
    with ClusterSupervisor() as supervisor:
        supervisor.start(ChildSpec("router", (
            sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--host", HOST,
            "--port", router.rsplit(":", 1)[1], "--block-size", str(node.block_size),
            # Generous: a 2-core machine may run five busy processes here.
            "--heartbeat-timeout-s", "30",
        )))
        for kind, addrs in (("prefill", prefill), ("decode", decode)):
            for i, addr in enumerate(addrs):
                port = int(addr.rsplit(":", 1)[1])
                supervisor.start(ChildSpec(f"{kind}-{i}", _node_argv(kind, model_dir, port, router, i, node)))
        try:
            _wait_serving(router, num_prefill, num_decode, supervisor)
            yield Cluster(router, prefill, decode)
        finally:
            supervisor.stop_all(grace_s=10)
