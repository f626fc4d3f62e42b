"""A local cluster with known addresses: router + prefill + decode (or colocated) processes on 127.0.0.1.

For tests and benchmarks that must talk to the nodes themselves (their `GetStats`),
which `pdserve cluster` does not expose. `num_colocated` starts the colocated baseline
(pass 0 prefill and 0 decode nodes); `cores` pins each pool to its cores (split evenly
across its nodes, one torch thread per core), so that both architectures can be
compared on the same cores. `auth_token` starts every child with that shared secret
(through `$PDSERVE_AUTH_TOKEN` in its environment) and sends it on the harness's own
calls (health wait, `GetStats`); without it the children run with authentication off,
whatever the caller's environment holds. Every process is stopped on exit.
"""

from __future__ import annotations

import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from pdserve.common.auth import TOKEN_ENV, call_metadata
from pdserve.cluster_supervisor import ChildSpec, ClusterSupervisor
from pdserve.node.affinity import format_cpu_list, split_cpus
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
    # Process name ("router", "prefill-0", "decode-0", ...) -> its /metrics URL; empty
    # unless running_cluster was asked for metrics.
    metrics: dict[str, str] = field(default_factory=dict)
    # Process name -> pid, which is also its process group (fault drills signal the group).
    pids: dict[str, int] = field(default_factory=dict)
    colocated: list[str] = field(default_factory=list)
    auth_token: str | None = field(default=None, repr=False)  # sent on every call to the cluster

    def stats(self) -> list[node_pb2.NodeStats]:
        """Every node's stats: prefill, then decode, then colocated nodes."""
        out = []
        for stub_type, addrs in ((node_pb2_grpc.PrefillNodeStub, self.prefill),
                                 (node_pb2_grpc.DecodeNodeStub, self.decode),
                                 (node_pb2_grpc.ColocatedNodeStub, self.colocated)):
            for addr in addrs:
                with grpc.insecure_channel(addr) as ch:
                    out.append(stub_type(ch).GetStats(node_pb2.StatsRequest(), timeout=10,
                                                      metadata=call_metadata(self.auth_token)))
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
    threads: int = 1  # of an unpinned node; a pinned one runs one per core


@dataclass(frozen=True)
class PoolCores:
    """Cores as devices: each pool's cores (split evenly across its nodes) and the router's; None: not pinned."""

    prefill: tuple[int, ...] | None = None
    decode: tuple[int, ...] | None = None
    colocated: tuple[int, ...] | None = None
    router: tuple[int, ...] | None = None

    def per_node(self, kind: str, count: int) -> list[tuple[int, ...] | None]:
        cores = getattr(self, kind)
        return split_cpus(cores, count, f"{kind} cores") if cores else [None] * count


def _node_argv(kind: str, model_dir: str, port: int, router: str, index: int, node: NodeSettings,
               cpus: tuple[int, ...] | None = None) -> tuple[str, ...]:
    kv = ("--kv-host", HOST) if kind != "colocated" else ()  # a colocated node moves no KV
    threads = ("--cpus", format_cpu_list(cpus)) if cpus else ("--threads", str(node.threads))
    return (
        sys.executable, "-m", "pdserve", kind, "--model", model_dir, "--host", HOST, "--port", str(port),
        "--router", router, "--node-id", f"{kind}-{index}", *kv, "--dtype", node.dtype,
        "--block-size", str(node.block_size), "--num-blocks", str(node.num_blocks),
        "--max-num-batched-tokens", str(node.max_num_batched_tokens),
        "--max-num-seqs", str(node.max_num_seqs), *threads,
    )


def _metrics_argv(metrics_ports: dict[str, int], name: str) -> tuple[str, ...]:
    return ("--metrics-port", str(metrics_ports[name])) if name in metrics_ports else ()


def _wait_serving(router: str, num_prefill: int, num_decode: int, num_colocated: int,
                  supervisor: ClusterSupervisor, auth_token: str | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with grpc.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            supervisor.raise_if_exited()
            try:
                health = stub.Health(pdserve_pb2.HealthRequest(), timeout=2, metadata=call_metadata(auth_token))
                if (health.prefill_nodes >= num_prefill and health.decode_nodes >= num_decode
                        and health.colocated_nodes >= num_colocated):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise TimeoutError(f"cluster at {router} not serving after {START_TIMEOUT_S}s")


@contextmanager
def running_cluster(model_dir: str, num_prefill: int, num_decode: int, node: NodeSettings = NodeSettings(),
                    metrics: bool = False, router_args: tuple[str, ...] = (), prefill_args: tuple[str, ...] = (),
                    decode_args: tuple[str, ...] = (), num_colocated: int = 0, colocated_args: tuple[str, ...] = (),
                    cores: PoolCores = PoolCores(), auth_token: str | None = None):
    """`*_args`: extra flags for the router / each node of a pool (they win over the defaults).

    `num_colocated`: colocated nodes (the baseline; with 0 prefill and 0 decode nodes the
    router serves through them alone). `cores`: pin pools to cores (cores as devices).
    `auth_token`: the cluster's shared secret (None: no authentication).
    """
    router = f"{HOST}:{free_port()}"
    prefill = [f"{HOST}:{free_port()}" for _ in range(num_prefill)]
    decode = [f"{HOST}:{free_port()}" for _ in range(num_decode)]
    colocated = [f"{HOST}:{free_port()}" for _ in range(num_colocated)]
    pools = (("prefill", prefill, prefill_args), ("decode", decode, decode_args),
             ("colocated", colocated, colocated_args))
    names = ["router", *(f"{kind}-{i}" for kind, addrs, _ in pools for i in range(len(addrs)))]
    metrics_ports = {name: free_port() for name in names} if metrics else {}
    env = {TOKEN_ENV: auth_token or ""}  # an empty variable turns authentication off
    with ClusterSupervisor() as supervisor:
        supervisor.start(ChildSpec("router", (
            sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--host", HOST,
            "--port", router.rsplit(":", 1)[1], "--block-size", str(node.block_size),
            # Generous: a 2-core machine may run five busy processes here.
            "--heartbeat-timeout-s", "30",
        ) + _metrics_argv(metrics_ports, "router") + tuple(router_args), env=env, cpus=cores.router))
        for kind, addrs, extra in pools:
            for i, (addr, cpus) in enumerate(zip(addrs, cores.per_node(kind, len(addrs)))):
                port = int(addr.rsplit(":", 1)[1])
                argv = (_node_argv(kind, model_dir, port, router, i, node, cpus)
                        + _metrics_argv(metrics_ports, f"{kind}-{i}") + tuple(extra))
                supervisor.start(ChildSpec(f"{kind}-{i}", argv, env=env))
        try:
            _wait_serving(router, num_prefill, num_decode, num_colocated, supervisor, auth_token)
            yield Cluster(router, prefill, decode,
                          {name: f"http://{HOST}:{port}/metrics" for name, port in metrics_ports.items()},
                          supervisor.pids, colocated, auth_token)
        finally:
            supervisor.stop_all(grace_s=10)
