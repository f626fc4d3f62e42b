"""Local clusters for the e2e suite, started the way users start them: `pdserve cluster`.

`running_cluster(...)` (a cluster to serve requests) and `FaultCluster` (one to kill
nodes in) both run the real launcher through `pdserve.cluster_process.ClusterProcess`:
the same command lines, ports, pinning, supervision and restarts users get. What the
tests add here is only the knobs they share (tiny pools, float32, a short lease) and
helpers that read the nodes' own stats.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve.cluster_process import ClusterProcess
from pdserve.cluster_plan import resolve_port
from pdserve.testing.waiting import settled
from pdserve.proto import node_pb2

HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0  # five processes importing torch on a shared 2-core box
# Per process, in a failed test's report: enough for the lines around a failed call, short
# enough to read in a CI log.
LOG_TAIL_LINES = 30


def free_port() -> int:
    """A port free on HOST now (for the tests that start a single process by hand), picked as the
    launcher picks its children's."""
    return resolve_port(HOST, 0)


@dataclass(frozen=True)
class NodeSettings:
    """Flags every node of a test cluster gets (before the pool's own extra flags)."""

    dtype: str = "float32"
    block_size: int = 8
    num_blocks: int = 256
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16

    def node_args(self) -> tuple[str, ...]:
        return ("--num-blocks", str(self.num_blocks), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--max-num-seqs", str(self.max_num_seqs))


def cluster_flags(num_prefill: int, num_decode: int, node: NodeSettings, num_colocated: int = 0,
                  router_args=(), prefill_args=(), decode_args=(), colocated_args=(),
                  metrics: bool = False) -> list[str]:
    """The `pdserve cluster` command line of a test cluster."""
    pools = (["--colocated", str(num_colocated)] if num_colocated
             else ["--prefill", str(num_prefill), "--decode", str(num_decode)])
    # Generous: a 2-core machine may run five busy processes here (the router's own flag wins).
    router = ("--heartbeat-timeout-s", "30", *router_args)
    flags = [*pools, "--dtype", node.dtype, "--block-size", str(node.block_size),
             "--router-args", shlex.join(router), "--http-port", "0"]  # HTTP on a free port: no clash between tests
    for kind, extra in (("prefill", prefill_args), ("decode", decode_args), ("colocated", colocated_args)):
        flags += [f"--{kind}-args", shlex.join((*node.node_args(), *extra))]
    if metrics:
        flags += ["--metrics-port", "0"]
    return flags


class Cluster(ClusterProcess):
    """A `ClusterProcess` with the address lists and stats order the e2e tests read."""

    @property
    def prefill(self) -> list[str]:
        return self.addresses("prefill")

    @property
    def decode(self) -> list[str]:
        return self.addresses("decode")

    @property
    def colocated(self) -> list[str]:
        return self.addresses("colocated")

    @property
    def pids(self) -> dict[str, int]:
        return {name: child.pid for name, child in self.state.children.items()}

    @property
    def metrics(self) -> dict[str, str]:
        return {name: child.metrics_url for name, child in self.state.children.items() if child.metrics_url}

    def stats(self, name: str | None = None) -> node_pb2.NodeStats | list[node_pb2.NodeStats]:
        """One node's stats; without a name, every node's: prefill, then decode, then colocated."""
        if name is not None:
            return super().stats(name)
        return [super(Cluster, self).stats(n) for kind in ("prefill", "decode", "colocated")
                for n in self.names(kind)]

    def wait_all_blocks_free(self, timeout_s: float = 30.0) -> list[node_pb2.NodeStats]:
        """Every node's stats once none holds a block (or as they stand at the timeout)."""
        super().wait_all_blocks_free(timeout_s)
        return self.stats()

    def log_tails(self) -> str:
        """The last lines of the launcher's log and of every child's: what a failed test shows
        of its cluster, whose logs are in a folder removed when it stops (tests/conftest.py)."""
        paths = [self.workdir / "launcher.log", *sorted((self.workdir / "logs").glob("*.log"))]
        parts = []
        for path in (p for p in paths if p.exists()):
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            parts.append(f"--- {path.name}, last {len(lines)} lines ---\n" + "\n".join(lines))
        return "\n".join(parts)


@contextmanager
def running_cluster(model_dir: str, num_prefill: int, num_decode: int, node: NodeSettings = NodeSettings(),
                    metrics: bool = False, router_args=(), prefill_args=(), decode_args=(), num_colocated: int = 0,
                    colocated_args=(), auth_token: str | None = None, launcher_args=()) -> Iterator[Cluster]:
    """`*_args`: extra flags for the router / every node of a pool (they win over the defaults);
    `launcher_args`: more `pdserve cluster` flags."""
    flags = [*cluster_flags(num_prefill, num_decode, node, num_colocated, router_args, prefill_args, decode_args,
                            colocated_args, metrics), *launcher_args]
    with tempfile.TemporaryDirectory(prefix="pdserve-cluster-") as workdir:
        with Cluster([*flags, "--model", model_dir], workdir, auth_token=auth_token,
                         ready_timeout_s=START_TIMEOUT_S) as cluster:
            try:
                yield cluster
            except (Exception, pytest.fail.Exception):  # a test failing inside `with running_cluster(...)`
                print(cluster.log_tails(), file=sys.stderr)  # shown with the failure; the folder goes
                raise


@dataclass(frozen=True)
class FaultSettings:
    block_size: int = 8
    num_blocks: int = 256
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    lease_s: float = 4.0
    heartbeat_timeout_s: float = 3.0
    prefill_step_delay_s: float = 0.0  # fault drills: slow a pool down so a kill lands mid-request
    decode_step_delay_s: float = 0.0
    prefill_args: tuple[str, ...] = ()  # more flags for every prefill node (e.g. queue bounds)
    decode_args: tuple[str, ...] = ()  # more flags for every decode node (e.g. --tp 2)
    # The launcher restarts a killed node after this long: long enough that a test sees the
    # cluster without it first (the router notices a kill within a heartbeat timeout).
    restart_backoff_s: float = 5.0
    router_args: tuple[str, ...] = ()  # more router flags
    metrics: bool = False  # /metrics on the router and every node (`--metrics-port 0`)


class FaultCluster:
    """A cluster to kill nodes in: `kill` SIGKILLs a node's process group (front and engine
    core at once, the way a machine dies); the launcher starts it again on the same command
    line after `restart_backoff_s`, and `restart` waits for that."""

    def __init__(self, model_dir: str, log_dir: Path, num_prefill: int, num_decode: int,
                 settings: FaultSettings = FaultSettings()) -> None:
        node = NodeSettings("float32", settings.block_size, settings.num_blocks, settings.max_num_batched_tokens,
                            settings.max_num_seqs)
        lease = ("--lease-s", str(settings.lease_s))
        flags = cluster_flags(
            num_prefill, num_decode, node,
            router_args=("--heartbeat-timeout-s", str(settings.heartbeat_timeout_s), *settings.router_args),
            prefill_args=(*lease, "--debug-step-delay-s", str(settings.prefill_step_delay_s), *settings.prefill_args),
            decode_args=(*lease, "--debug-step-delay-s", str(settings.decode_step_delay_s), *settings.decode_args),
            metrics=settings.metrics)
        flags += ["--restart-backoff-s", str(settings.restart_backoff_s),
                  "--restart-max-backoff-s", str(settings.restart_backoff_s), "--model", model_dir]
        self.settings = settings
        self._process = Cluster(flags, log_dir, ready_timeout_s=START_TIMEOUT_S)
        self._killed: dict[str, int] = {}  # name -> pid killed, until the launcher restarts it

    def __enter__(self) -> FaultCluster:
        self._process.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.stop()

    @property
    def router(self) -> str:
        return self._process.router

    def log_tails(self) -> str:
        return self._process.log_tails()

    def count(self, kind: str) -> int:
        return len(self._process.names(kind))

    def address(self, name: str) -> str:
        return self._process.state.children[name].address

    def log(self, name: str) -> str:
        return self._process.log(name)

    def health(self):
        return self._process.health()

    def stats(self, name: str) -> node_pb2.NodeStats:
        return self._process.stats(name)

    def kill(self, name: str) -> None:
        self._killed[name] = self._process.kill(name, signal.SIGKILL)

    def terminate(self, name: str) -> int:
        """SIGTERM to the child's own process (a scale-down): it drains and exits 0, and stays gone."""
        return self._process.terminate(name)

    @property
    def process(self) -> Cluster:
        return self._process

    def metrics_url(self, name: str) -> str:
        return self._process.state.children[name].metrics_url

    def freeze(self, name: str) -> None:
        """SIGSTOP the node's process group: it holds its calls open and answers nothing."""
        self._process.kill(name, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        self._process.kill(name, signal.SIGCONT)

    def restart(self, name: str) -> None:
        """Until the launcher has started the killed node again (it registers on its own)."""
        self._process.wait_restarted(name, self._killed.pop(name), timeout_s=START_TIMEOUT_S)

    def wait_serving(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        self._process.wait_serving(num_prefill, num_decode, timeout_s=timeout_s)

    def pids(self) -> dict[str, int]:
        """Every child's pid (its process group) as the launcher last wrote them."""
        return {name: child.pid for name, child in self._process.refresh().children.items()}

    def live_nodes(self) -> list[str]:
        state = self._process.refresh()
        return [name for name, child in state.children.items()
                if name != "router" and name not in self._killed and _alive(child.pid)]

    def wait_no_blocks(self, timeout_s: float) -> dict[str, tuple[int, int]]:
        """Poll every live node until none holds a block; returns (used, reserved) per node."""
        return _poll_held(self, timeout_s)


def busy_node(cluster: FaultCluster, kind: str) -> str:
    """The node of `kind` that is running a request right now."""
    names = [n for n in cluster.live_nodes() if n.startswith(kind)]
    for name in names:
        stats = cluster.stats(name)
        if stats.num_running or stats.num_waiting:
            return name
    raise AssertionError(f"no {kind} node is busy: {[cluster.stats(n) for n in names]}")


def assert_no_blocks_held(cluster: FaultCluster, timeout_s: float) -> None:
    """No live node of `cluster` holds a block, used or reserved (polled up to `timeout_s`)."""
    held = cluster.wait_no_blocks(timeout_s)
    assert all(h == (0, 0) for h in held.values()), f"blocks still held (used, reserved): {held}"


def _poll_held(cluster: FaultCluster, timeout_s: float) -> dict[str, tuple[int, int] | None]:
    """(used, reserved) of every live node once none holds a block; None for a node that does not
    answer its stats yet (one the launcher just started again: its core may still be loading),
    which keeps the poll going until it does."""
    return settled(lambda: {n: _held(cluster, n) for n in cluster.live_nodes()},
                   lambda held: all(h == (0, 0) for h in held.values()), timeout_s, interval_s=0.1)


def _held(cluster: FaultCluster, name: str) -> tuple[int, int] | None:
    try:
        stats = cluster.stats(name)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return None
        raise
    return stats.used_blocks, stats.reserved_blocks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_every_block_free(cluster: Cluster, timeout_s: float = 30.0) -> None:
    """No node of `cluster` holds a block, used or reserved (waiting up to `timeout_s` for the last
    frees to land)."""
    held = cluster.wait_all_blocks_free(timeout_s=timeout_s)
    assert [(s.used_blocks, s.reserved_blocks) for s in held] == [(0, 0)] * len(held)
