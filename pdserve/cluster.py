"""`pdserve cluster`: a whole local cluster (router + N prefill + M decode nodes) from one command.

`--colocated N` starts N colocated nodes instead (each runs both phases: the baseline),
behind the same router and API. Owns: the launcher's config, the command line of every
child (`python -m pdserve <kind> ...`, each pool tuned by its own pass-through flags),
the cores of each child when pools are pinned (`--prefill-cores` etc.: each pool's cores
split evenly across its nodes, passed as `--cpus`; on CPU a pool's size is its cores,
the analogue of GPUs per pool), the start order (router, then the nodes once the router
answers), the wait until the router's Health reports the expected node counts, and the
launcher's lifecycle. The processes themselves (start, pinning, logs, stop) belong to
`pdserve.cluster_supervisor.ClusterSupervisor`.

Lifecycle: start router → wait until it answers → start nodes → wait until serving with
N prefill + M decode (or N colocated) → print the address and the pinning → serve until
SIGINT/SIGTERM or until a child exits → stop every child (SIGTERM, then SIGKILL of its
process group after a grace period). Every exit path, the launcher's own failures
included, goes through that stop.

Must never: run model code in the launcher (it only builds the demo model when none is
given), bind anything but the configured host, or leave a child process behind.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pdserve.common.auth import add_auth_args, token_from_cli
from pdserve.cluster_supervisor import ChildExited, ChildSpec, ClusterSupervisor
from pdserve.healthcheck import HealthcheckConfig, Verdict, check
from pdserve.common.config_flags import add_config_args
from pdserve.engine.config import AUTO_DTYPE, DEFAULT_BLOCK_SIZE, EngineConfig
from pdserve.node.affinity import available_cpus, check_available, cpu_list_arg, format_cpu_list, split_cpus

# Flags the launcher sets itself on every node / on the router; pass-through args must not.
NODE_OWNED_FLAGS = ("--model", "--host", "--port", "--router", "--node-id", "--kv-host", "--kv-port",
                    "--dtype", "--block-size", "--auth-token-file", "--cpus")
ROUTER_OWNED_FLAGS = ("--host", "--port", "--model", "--prefill", "--decode", "--block-size", "--auth-token-file")
EXAMPLE_PROMPT = "The quick brown fox"
THREADS_FLAGS = ("--num-threads", "--threads")


class ClusterError(RuntimeError):
    """The cluster could not be started or kept up."""


@dataclass(frozen=True)
class ClusterConfig:
    """Every knob of the launcher, with its default in one place."""

    model: str | None = None  # None: the built-in demo model (built once, cached)
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0  # > 0: a colocated cluster, with no prefill or decode pool
    host: str = "127.0.0.1"
    port: int = 50051  # router port; 0 picks a free one
    # Cluster-wide engine facts, handed to every node: both pools' KV layouts must match.
    dtype: str = AUTO_DTYPE  # each node resolves it for its machine (engine/dtype_choice)
    block_size: int = DEFAULT_BLOCK_SIZE
    threads_per_node: int | None = None  # None: the machine's cores split over the nodes
    router_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    colocated_args: tuple[str, ...] = ()
    # Cores as devices: a pool's cores, split evenly across its nodes; None: not pinned.
    prefill_cores: tuple[int, ...] | None = None
    decode_cores: tuple[int, ...] | None = None
    colocated_cores: tuple[int, ...] | None = None
    router_cores: tuple[int, ...] | None = None
    ready_timeout_s: float = 180.0
    stop_grace_s: float = 10.0
    poll_interval_s: float = 0.25
    probe_timeout_s: float = 1.0
    log_dir: str | None = None  # None: logs go to the console, prefixed by child name
    # Handed to every child; without it, children inherit $PDSERVE_AUTH_TOKEN (if set).
    auth_token_file: str | None = None

    def __post_init__(self) -> None:
        if self.num_colocated < 0:
            raise ValueError(f"--colocated must be >= 0, got {self.num_colocated}")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ValueError("--colocated runs both phases on every node; do not combine it with "
                             "prefill or decode nodes")
        if not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a cluster needs at least 1 prefill and 1 decode node (or --colocated N)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port out of range: {self.port}")
        if self.host in ("0.0.0.0", "::", ""):
            raise ValueError("the local cluster needs a concrete host address (default 127.0.0.1), "
                             f"not {self.host!r}: nodes register it as the address to dial")
        for name in ("ready_timeout_s", "stop_grace_s", "poll_interval_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        _reject_owned_flags("--router-args", self.router_args, ROUTER_OWNED_FLAGS)
        for pool in self.pools:
            _reject_owned_flags(f"--{pool.kind}-args", pool.args, NODE_OWNED_FLAGS)
            if pool.cores is not None and pool.count == 0:
                raise ValueError(f"{pool.cores_flag} given, but the cluster has no {pool.kind} nodes")
            if pool.cores is not None:
                split_cpus(pool.cores, pool.count, pool.cores_flag)  # raises when too few

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def pools(self) -> tuple[Pool, ...]:
        """Every pool, in start order (a pool of 0 nodes included: its flags are still checked)."""
        return (Pool("prefill", self.num_prefill, self.prefill_args, self.prefill_cores),
                Pool("decode", self.num_decode, self.decode_args, self.decode_cores),
                Pool("colocated", self.num_colocated, self.colocated_args, self.colocated_cores))

    @property
    def node_counts(self) -> str:
        """"1 prefill, 2 decode" or "2 colocated": what the ready banner says."""
        return ", ".join(f"{pool.count} {pool.kind}" for pool in self.pools if pool.count)


@dataclass(frozen=True)
class Pool:
    """The nodes of one kind: how many, their pass-through flags, their cores (None: not pinned)."""

    kind: str
    count: int
    args: tuple[str, ...]
    cores: tuple[int, ...] | None

    @property
    def cores_flag(self) -> str:
        return f"--{self.kind}-cores"


def _reject_owned_flags(option: str, args: Sequence[str], owned: Sequence[str]) -> None:
    for arg in args:
        if arg.split("=", 1)[0] in owned:
            raise ValueError(f"{option} must not set {arg.split('=', 1)[0]}: the launcher sets it")


@dataclass(frozen=True)
class ClusterPlan:
    """What to start: the router, then the nodes; and the router address to probe."""

    router: ChildSpec
    nodes: tuple[ChildSpec, ...]
    router_addr: str


def build_plan(config: ClusterConfig, model_dir: str, router_port: int, python: str = sys.executable,
               usable_cpus: Collection[int] | None = None) -> ClusterPlan:
    """The command line (and cores) of every child of the cluster.

    `usable_cpus`: the cores pinned children may use (None: this process's own affinity).
    Raises ValueError naming the flag when a pool's cores are not on this machine.
    """
    _check_cores(config, usable_cpus)
    base = (python, "-m", "pdserve")
    router_addr = f"{config.host}:{router_port}"
    router = ChildSpec("router", (*base, "router", "--host", config.host, "--port", str(router_port),
                                  "--model", model_dir, "--block-size", str(config.block_size),
                                  *_auth_args(config), *config.router_args), cpus=config.router_cores)
    nodes = []
    for pool in config.pools:
        cores = split_cpus(pool.cores, pool.count, pool.cores_flag) if pool.cores else [None] * pool.count
        for index, cpus in enumerate(cores):
            name = f"{pool.kind}-{index}"
            # A colocated node moves no KV between nodes: it has no transfer listener to place.
            kv = ("--kv-host", config.host, "--kv-port", "0") if pool.kind != "colocated" else ()
            pin = ("--cpus", format_cpu_list(cpus)) if cpus else ()
            argv = (*base, pool.kind, "--model", model_dir, "--host", config.host, "--port", "0",
                    "--router", router_addr, "--node-id", name, *kv, "--dtype", config.dtype,
                    "--block-size", str(config.block_size), *_auth_args(config), *pin,
                    *_threads_args(config, pool.args, pinned=cpus is not None), *pool.args)
            nodes.append(ChildSpec(name, argv, cpus=cpus))
    return ClusterPlan(router, tuple(nodes), router_addr)


def _check_cores(config: ClusterConfig, usable_cpus: Collection[int] | None) -> None:
    flags = [(pool.cores_flag, pool.cores) for pool in config.pools] + [("--router-cores", config.router_cores)]
    pinned = [(flag, cores) for flag, cores in flags if cores is not None]
    if not pinned:
        return
    usable = available_cpus() if usable_cpus is None else usable_cpus
    for flag, cores in pinned:
        check_available(cores, flag, usable)


def _auth_args(config: ClusterConfig) -> tuple[str, ...]:
    return ("--auth-token-file", config.auth_token_file) if config.auth_token_file else ()


def _threads_args(config: ClusterConfig, extra: Sequence[str], pinned: bool) -> tuple[str, ...]:
    # Nodes on one machine share its cores; torch's default (all cores each) oversubscribes.
    # A pinned node runs one thread per core of its own unless told otherwise.
    if any(arg.split("=", 1)[0] in THREADS_FLAGS for arg in extra):
        return ()
    if pinned and config.threads_per_node is None:
        return ()
    threads = config.threads_per_node or max(1, (os.cpu_count() or 1) // config.num_nodes)
    return ("--num-threads", str(threads))


def resolve_port(host: str, port: int) -> int:
    """`port`, checked free on `host`; 0 → a free port the OS picks."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # SO_REUSEADDR so a TIME_WAIT leftover does not count as busy; a live listener
        # still does (gRPC servers set SO_REUSEPORT, which would otherwise share the port).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ClusterError(f"cannot use {host}:{port} for the router ({err.strerror}); "
                               "pass --port 0 to pick a free port") from err
        return int(sock.getsockname()[1])


Probe = Callable[[], Verdict]  # one Health probe of the router


def run_cluster(config: ClusterConfig, plan: ClusterPlan, supervisor: ClusterSupervisor,
                probe: Probe, stop: threading.Event, out: TextIO | None = None) -> int:
    """Start, wait until ready, serve until `stop` is set; stop every child on every path."""
    out = out or sys.stdout
    try:
        deadline = time.monotonic() + config.ready_timeout_s
        supervisor.start(plan.router)
        if not _wait_for(lambda: probe().reachable, "the router to answer", supervisor, stop, deadline, config):
            return 0
        for spec in plan.nodes:
            supervisor.start(spec)
        if not _wait_for(lambda: probe().healthy, "the cluster to serve", supervisor, stop, deadline, config):
            return 0
        _print_ready(config, plan, out)
        _serve(supervisor, stop, config)
        return 0
    except ChildExited as err:
        _print_failure(str(err), err.tail, out)
        return 1
    except ClusterError as err:
        _print_failure(str(err), (), out)
        return 1
    finally:
        supervisor.stop_all(config.stop_grace_s)


def _wait_for(ready: Callable[[], bool], what: str, supervisor: ClusterSupervisor, stop: threading.Event,
              deadline: float, config: ClusterConfig) -> bool:
    """True once `ready()`; False when asked to stop; raises on a dead child or the deadline."""
    while not stop.is_set():
        supervisor.raise_if_exited()
        if ready():
            return True
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {config.ready_timeout_s:g}s waiting for {what}")
        stop.wait(config.poll_interval_s)
    return False


def _serve(supervisor: ClusterSupervisor, stop: threading.Event, config: ClusterConfig) -> None:
    while not stop.wait(config.poll_interval_s):
        supervisor.raise_if_exited()


def _print_ready(config: ClusterConfig, plan: ClusterPlan, out: TextIO) -> None:
    print(f"pdserve cluster ready at {plan.router_addr} ({config.node_counts})", file=out)
    pinned = [f"{spec.name} on cpus {format_cpu_list(spec.cpus)}" for spec in (plan.router, *plan.nodes) if spec.cpus]
    if pinned:
        print(f"pinned: {', '.join(pinned)}", file=out)
    print(f"try: pdserve generate --addr {plan.router_addr} --max-tokens 32 "
          f"{shlex.quote(EXAMPLE_PROMPT)}", file=out)
    print("stop with Ctrl-C", file=out, flush=True)


def _print_failure(message: str, tail: Sequence[str], out: TextIO) -> None:
    print(f"pdserve cluster failed: {message}", file=out)
    for line in tail:
        print(f"  | {line}", file=out)
    out.flush()


@dataclass
class _StopSignals:
    """SIGINT/SIGTERM set `stop` instead of raising; the previous handlers come back on exit."""

    stop: threading.Event
    previous: dict[int, object] = field(default_factory=dict)

    def __enter__(self) -> _StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, lambda *_: self.stop.set())
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _parser() -> argparse.ArgumentParser:
    d = ClusterConfig()
    p = argparse.ArgumentParser(prog="pdserve cluster", description="Run a local pdserve cluster: "
                                "a router, N prefill nodes and M decode nodes (or N colocated nodes), "
                                "until Ctrl-C.")
    p.add_argument("--model", default=d.model, help="model directory (default: the built-in demo model)")
    # None: 1 each, or 0 each with --colocated.
    p.add_argument("--prefill", type=int, default=None, metavar="N", help=f"prefill nodes (default {d.num_prefill})")
    p.add_argument("--decode", type=int, default=None, metavar="M", help=f"decode nodes (default {d.num_decode})")
    p.add_argument("--colocated", type=int, default=d.num_colocated, metavar="N",
                   help="run N colocated nodes (both phases each: the baseline) instead of prefill and decode pools")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="router port (0: pick a free one)")
    add_config_args(p, EngineConfig, only=("dtype", "block_size"))  # every node's, the router's block size
    p.add_argument("--threads-per-node", type=int, default=d.threads_per_node)
    p.add_argument("--router-args", default="", metavar='"ARGS"', help="extra router flags")
    for pool in d.pools:
        p.add_argument(f"--{pool.kind}-args", default="", metavar='"ARGS"',
                       help=f"extra flags for every {pool.kind} node (one quoted string), "
                            f"e.g. \"--max-num-seqs 32 --num-blocks 1024\"")
    for pool in d.pools:
        p.add_argument(pool.cores_flag, type=cpu_list_arg(pool.cores_flag), default=None, metavar="LIST",
                       help=f"pin the {pool.kind} nodes to these cores (e.g. 0-3), split evenly among them; "
                            "each node runs one torch thread per core")
    p.add_argument("--router-cores", type=cpu_list_arg("--router-cores"), default=None, metavar="LIST",
                   help="pin the router to these cores")
    p.add_argument("--ready-timeout-s", type=float, default=d.ready_timeout_s)
    p.add_argument("--stop-grace-s", type=float, default=d.stop_grace_s)
    p.add_argument("--log-dir", default=d.log_dir, help="write one log file per child here instead of the console")
    add_auth_args(p)
    return p


def config_from_args(argv: Sequence[str] | None) -> ClusterConfig:
    args = _parser().parse_args(argv)
    default_pool_size = 0 if args.colocated else 1
    return ClusterConfig(
        model=args.model, host=args.host, port=args.port, dtype=args.dtype, block_size=args.block_size,
        num_prefill=default_pool_size if args.prefill is None else args.prefill,
        num_decode=default_pool_size if args.decode is None else args.decode,
        num_colocated=args.colocated, threads_per_node=args.threads_per_node,
        router_args=tuple(shlex.split(args.router_args)), prefill_args=tuple(shlex.split(args.prefill_args)),
        decode_args=tuple(shlex.split(args.decode_args)), colocated_args=tuple(shlex.split(args.colocated_args)),
        prefill_cores=args.prefill_cores, decode_cores=args.decode_cores, colocated_cores=args.colocated_cores,
        router_cores=args.router_cores, ready_timeout_s=args.ready_timeout_s, stop_grace_s=args.stop_grace_s,
        log_dir=args.log_dir, auth_token_file=args.auth_token_file)


def _model_dir(config: ClusterConfig, python: str = sys.executable) -> str:
    if config.model is not None:
        if not (Path(config.model) / "config.json").is_file():
            raise ClusterError(f"--model {config.model}: no config.json there")
        return str(Path(config.model).resolve())
    # In a child process: the launcher itself never loads torch or transformers.
    print("using the built-in demo model (built on first use, then cached)", flush=True)
    code = "from pdserve.model_factory import ensure_demo_model; print(ensure_demo_model())"
    try:
        done = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, text=True,
                              timeout=config.ready_timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"building the demo model took over {config.ready_timeout_s:g}s") from err
    if done.returncode != 0 or not done.stdout.strip():
        raise ClusterError(f"building the demo model failed (exit code {done.returncode})")
    return done.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    try:
        config = config_from_args(argv)
        token = token_from_cli(config.auth_token_file, os.environ)  # the launcher's own probe
        _check_cores(config, None)  # before the demo model is built: a typo fails at once
        plan = build_plan(config, _model_dir(config), resolve_port(config.host, config.port))
    except (ValueError, ClusterError) as err:
        print(f"pdserve cluster: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the demo model builds: nothing started yet
        return 130
    probe_config = HealthcheckConfig(timeout_s=config.probe_timeout_s, min_prefill=config.num_prefill,
                                     min_decode=config.num_decode, min_colocated=config.num_colocated,
                                     auth_token=token)
    supervisor = ClusterSupervisor(log_dir=Path(config.log_dir) if config.log_dir else None)
    if config.log_dir:
        print(f"logs in {config.log_dir}/<name>.log", flush=True)
    stop = threading.Event()
    with _StopSignals(stop):
        return run_cluster(config, plan, supervisor, lambda: check(plan.router_addr, "router", probe_config), stop)


if __name__ == "__main__":
    sys.exit(main())
