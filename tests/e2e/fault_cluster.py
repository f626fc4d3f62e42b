"""A cluster whose nodes a test can kill and restart: router + nodes as real processes on 127.0.0.1.

Every process leads its own process group, so `kill` (SIGKILL to the group) takes a
node's gRPC front and its engine-core process down at once, the way a machine dies,
and `restart` runs the very same command again (same port, same node id): the new
process must register and take traffic. Short heartbeat timeout and lease, so that
failures are noticed in seconds. Every process is stopped on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from pdserve.bench.local_cluster import HOST, free_port
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

START_TIMEOUT_S = 240.0  # five processes importing torch on a shared 2-core box


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


@dataclass
class _Proc:
    name: str
    argv: list[str]
    address: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


class FaultCluster:
    def __init__(self, model_dir: str, log_dir: Path, num_prefill: int, num_decode: int,
                 settings: FaultSettings = FaultSettings()) -> None:
        self.settings = settings
        self.router = f"{HOST}:{free_port()}"
        self._procs: dict[str, _Proc] = {}
        router_argv = [sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--host", HOST,
                       "--port", self.router.rsplit(":", 1)[1], "--block-size", str(settings.block_size),
                       "--heartbeat-timeout-s", str(settings.heartbeat_timeout_s)]
        self._procs["router"] = _Proc("router", router_argv, self.router, log_dir / "router.log")
        for kind, count, delay in (("prefill", num_prefill, settings.prefill_step_delay_s),
                                   ("decode", num_decode, settings.decode_step_delay_s)):
            for i in range(count):
                name, address = f"{kind}-{i}", f"{HOST}:{free_port()}"
                argv = [sys.executable, "-m", "pdserve", kind, "--model", model_dir, "--host", HOST,
                        "--port", address.rsplit(":", 1)[1], "--router", self.router, "--node-id", name,
                        "--kv-host", HOST, "--dtype", "float32", "--block-size", str(settings.block_size),
                        "--num-blocks", str(settings.num_blocks),
                        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
                        "--max-num-seqs", str(settings.max_num_seqs), "--threads", "1",
                        "--lease-s", str(settings.lease_s), "--debug-step-delay-s", str(delay)]
                if kind == "prefill":
                    argv += settings.prefill_args
                self._procs[name] = _Proc(name, argv, address, log_dir / f"{name}.log")

    def __enter__(self) -> FaultCluster:
        try:
            for proc in self._procs.values():
                proc.start()
            self.wait_serving(self.count("prefill"), self.count("decode"), START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self._procs.values():
            proc.stop()

    def count(self, kind: str) -> int:
        return sum(1 for name in self._procs if name.startswith(kind))

    def address(self, name: str) -> str:
        return self._procs[name].address

    def log(self, name: str) -> str:
        return self._procs[name].log_path.read_text()

    def kill(self, name: str) -> None:
        """SIGKILL the node's process group: its front and its engine core, at once."""
        self._procs[name].kill()

    def restart(self, name: str) -> None:
        self._procs[name].start()

    def health(self) -> pdserve_pb2.HealthResponse:
        with grpc.insecure_channel(self.router) as channel:
            return pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=5)

    def wait_serving(self, num_prefill: int, num_decode: int, timeout_s: float) -> None:
        """Until the router counts exactly this many live nodes of each kind."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                health = self.health()
                if (health.prefill_nodes, health.decode_nodes) == (num_prefill, num_decode):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router did not see {num_prefill} prefill and {num_decode} decode nodes "
                           f"within {timeout_s}s")

    def stats(self, name: str) -> node_pb2.NodeStats:
        stub_type = node_pb2_grpc.PrefillNodeStub if name.startswith("prefill") else node_pb2_grpc.DecodeNodeStub
        with grpc.insecure_channel(self._procs[name].address) as channel:
            return stub_type(channel).GetStats(node_pb2.StatsRequest(), timeout=10)

    def live_nodes(self) -> list[str]:
        return [n for n, p in self._procs.items() if n != "router" and p.proc is not None and p.proc.poll() is None]

    def wait_no_blocks(self, timeout_s: float) -> dict[str, tuple[int, int]]:
        """Poll every live node until none holds a block; returns (used, reserved) per node."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = {n: (s.used_blocks, s.reserved_blocks) for n in self.live_nodes() for s in [self.stats(n)]}
            if all(h == (0, 0) for h in held.values()) or time.monotonic() > deadline:
                return held
            time.sleep(0.1)
