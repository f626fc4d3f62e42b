"""`pdserve cluster` as a program's child: how benchmarks and tests start a local cluster.

`ClusterProcess(flags, workdir)` runs `python -m pdserve cluster --port 0 --state-file ...
--log-dir ... <flags>` — the command users run — waits until it serves, and reads the
state file for what a program needs besides the router's address: each node's address
(`GetStats`, block counts), its pid (fault drills signal its process group), its
metrics URL, and with `--tls` the files its own calls use (`state.tls()`, `.token`).
Leaving the `with` block stops the launcher, which stops every child.

Must never: start a router or a node itself (the launcher does, with the command lines
users get), or outlive its `with` block.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from pdserve.cluster_state import ClusterState, read_state
from pdserve.common.auth import TOKEN_ENV, call_metadata, read_token_file
from pdserve.common.lifecycle import PARENT_PID_ENV
from pdserve.common.channels import sync_probe_channel
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

T = TypeVar("T")
_NODE_STUBS = {"prefill": node_pb2_grpc.PrefillNodeStub, "decode": node_pb2_grpc.DecodeNodeStub,
               "colocated": node_pb2_grpc.ColocatedNodeStub}
POLL_S = 0.05  # how often a wait looks at its condition again
STOP_GRACE_S = 30.0  # the launcher's own grace plus a margin


class ClusterProcess:
    def __init__(self, flags: Sequence[str], workdir: str | os.PathLike, auth_token: str | None = None,
                 ready_timeout_s: float = 300.0, python: str = sys.executable) -> None:
        """`auth_token`: the cluster's shared secret, given to the launcher in its environment
        and sent on this object's own calls (None: authentication off, whatever the caller's
        environment holds)."""
        self.workdir = Path(workdir)
        self.auth_token = auth_token
        self._state_file = self.workdir / "cluster-state.json"
        self._argv = (python, "-m", "pdserve", "cluster", "--port", "0", "--state-file", str(self._state_file),
                      "--log-dir", str(self.workdir / "logs"), *flags)
        self._ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen | None = None
        self._state: ClusterState | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> ClusterProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._state_file.unlink(missing_ok=True)
        with open(self.workdir / "launcher.log", "a") as log:
            self._proc = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          # PARENT_PID_ENV: the launcher (and so every child)
                                          # stops by itself if this program dies without stopping it.
                                          env={**os.environ, TOKEN_ENV: self.auth_token or "",
                                               PARENT_PID_ENV: str(os.getpid())},
                                          start_new_session=True)
        try:
            self._state = self._wait(lambda: read_state(self._state_file), "to serve", self._ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Ctrl-C to the launcher (it stops every child); SIGKILL of its group if it hangs."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()

    # -- what the launcher says -----------------------------------------------------------

    @property
    def state(self) -> ClusterState:
        """The state file as of the last `refresh()` (or start)."""
        assert self._state is not None, "the cluster is not running"
        return self._state

    def refresh(self) -> ClusterState:
        self._state = read_state(self._state_file) or self._state
        return self.state

    @property
    def token(self) -> str | None:
        """The node join credential this object's calls carry: the one it was given, else the one
        in the launcher's token file (`--tls` makes one when none is given)."""
        if self.auth_token is not None or self.state.auth_token_file is None:
            return self.auth_token
        return read_token_file(self.state.auth_token_file)

    @property
    def router(self) -> str:
        return self.state.router

    @property
    def pid(self) -> int:
        """The launcher's: every child of the cluster is under it."""
        assert self._proc is not None, "the cluster is not running"
        return self._proc.pid

    def addresses(self, kind: str) -> list[str]:
        return self.state.addresses(kind)

    def names(self, kind: str) -> list[str]:
        return self.state.names(kind)

    def log(self, name: str) -> str:
        """A child's log so far ("launcher" for the launcher's own output)."""
        path = self.workdir / ("launcher.log" if name == "launcher" else f"logs/{name}.log")
        return path.read_text() if path.exists() else ""

    # -- talking to the cluster -----------------------------------------------------------

    def health(self, timeout_s: float = 5.0) -> pdserve_pb2.HealthResponse:
        with sync_probe_channel(self.router, self.state.tls()) as channel:
            return pdserve_pb2_grpc.GenerationStub(channel).Health(
                pdserve_pb2.HealthRequest(), timeout=timeout_s, metadata=call_metadata(self.token))

    def stats(self, name: str, timeout_s: float = 10.0) -> node_pb2.NodeStats:
        child = self.state.children[name]
        with sync_probe_channel(child.address, self.state.tls()) as channel:
            return _NODE_STUBS[child.kind](channel).GetStats(node_pb2.StatsRequest(), timeout=timeout_s,
                                                             metadata=call_metadata(self.token))

    def node_stats(self) -> dict[str, node_pb2.NodeStats]:
        """Every node's stats, by name."""
        return {name: self.stats(name) for name, child in self.state.children.items() if child.kind != "router"}

    def wait_serving(self, num_prefill: int, num_decode: int, num_colocated: int = 0,
                     timeout_s: float = 120.0) -> None:
        """Until the router counts exactly this many live nodes of each kind."""
        want = (num_prefill, num_decode, num_colocated)

        def serving() -> bool:
            try:
                health = self.health()
            except grpc.RpcError:
                return False
            return (health.prefill_nodes, health.decode_nodes, health.colocated_nodes) == want

        self._wait(serving, f"to serve {want} (prefill, decode, colocated) nodes", timeout_s)

    def wait_all_blocks_free(self, timeout_s: float = 30.0) -> dict[str, tuple[int, int]]:
        """Every node's (used, reserved) blocks once all are zero, or as they stand at the timeout."""
        def held() -> dict[str, tuple[int, int]]:
            return {name: (s.used_blocks, s.reserved_blocks) for name, s in self.node_stats().items()}

        deadline = time.monotonic() + timeout_s
        while True:
            now_held = held()
            if all(h == (0, 0) for h in now_held.values()) or time.monotonic() > deadline:
                return now_held
            time.sleep(POLL_S)

    # -- fault drills ---------------------------------------------------------------------

    def kill(self, name: str, signum: int = signal.SIGKILL) -> int:
        """Signal a child's process group (a node's front and engine core at once, the way a
        machine dies); returns the pid signalled. The launcher restarts it per its policy."""
        pid = self.state.children[name].pid
        os.killpg(pid, signum)
        return pid

    def terminate(self, name: str) -> int:
        """SIGTERM to a child's own process, not its group (what Kubernetes sends a pod's main
        process): it drains, then exits 0. Returns the pid signalled."""
        pid = self.state.children[name].pid
        os.kill(pid, signal.SIGTERM)
        return pid

    def terminate_launcher(self) -> None:
        """SIGTERM to the launcher: it drains the router, then every node, then exits 0."""
        assert self._proc is not None, "the cluster is not running"
        self._proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> int:
        """The launcher's exit status once it has exited (TimeoutExpired past `timeout_s`)."""
        assert self._proc is not None, "the cluster is not running"
        return self._proc.wait(timeout=timeout_s)

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 120.0) -> None:
        """Until the launcher has started `name` again (a new pid in the state file)."""
        def restarted() -> bool:
            child = self.refresh().children[name]
            return child.pid != old_pid

        self._wait(restarted, f"to restart {name}", timeout_s)

    def _wait(self, ready: Callable[[], T], what: str, timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        while True:
            value = ready()
            if value:
                return value
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"pdserve cluster exited with code {self._proc.returncode} while waiting "
                                   f"{what}:\n{self.log('launcher')[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve cluster did not get {what} within {timeout_s:g}s:\n"
                                   f"{self.log('launcher')[-4000:]}")
            time.sleep(POLL_S)
