"""`pdserve cluster`: a whole local cluster (router + N prefill + M decode nodes) from one command.

`--colocated N` starts N colocated nodes instead (each runs both phases: the baseline),
behind the same router and API. The launcher's config and flags are in cluster_config.py,
every child's command line, ports and cores in cluster_plan.py, the processes themselves
(start, pinning, logs, restart, stop) in cluster_supervisor.py.

Lifecycle: start the router and every node at once → wait until serving with
N prefill + M decode (or N colocated) → print the addresses → serve until SIGINT/SIGTERM.
SIGTERM drains (`_drain`): the router first (it refuses new requests and finishes its streams
within `--drain-timeout-s`), then every node (each leaves placement, finishes what it holds,
deregisters), then exit 0; Ctrl-C stops every child at once (130).
A node that exits 0 has drained and left (someone sent it SIGTERM: a scale-down): the cluster
serves on without it and does not start it again (unless `--restart-mode always`); a router
that exits 0 has drained, and the cluster stops, draining its nodes.
While serving, a child that exits is started again with the same command line (same
port, same node id) after a backoff (`--restart-*`, cluster_supervisor.RestartPolicy): a
node registers again and takes traffic, while the router resumes its streams on the
others; a crash-looping node is given up on (said so), and the cluster serves on without
it, as is at once a node that exits with a code the same command line would repeat (a usage
error, or the router refusing its fingerprint: pdserve/common/refusal.py); a crash-looping router, a
router that exits so, or any exit under `--restart-mode never`, stops the cluster.
A child that dies before the cluster first serves fails the launch with its last lines.
Every exit path stops every child (SIGTERM, then SIGKILL of its process group after a
grace period). `--state-file` keeps each child's pid and addresses for programs. Exit
status: 130 after Ctrl-C, 0 after SIGTERM, 1 when the cluster failed, 2 for a bad flag or a
busy `--port` / `--metrics-port` (one line naming it, checked before anything starts).

Must never: run model code in the launcher (it only builds the demo model when none is
given), bind anything but the configured host, or leave a child process behind.
"""

from __future__ import annotations

import itertools
import os
import queue
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pdserve.cluster_config import ClusterConfig, ClusterError, config_from_args
from pdserve.cluster_load_mode import LoadWatcher, build_rebalancer, scrape_url
from pdserve.cluster_plan import ClusterPlan, NodeSite, build_plan, check_cores, node_spec, resolve_port
from pdserve.cluster_state import ChildState, ClusterState, write_state
from pdserve.cluster_supervisor import ChildExited, ChildSpec, ClusterSupervisor
from pdserve.cluster_tls import client_flags, with_cluster_tls
from pdserve.common.api_keys import ApiKeys
from pdserve.common.auth import TOKEN_ENV, token_from_cli
from pdserve.common.lifecycle import PARENT_CHECK_S, ExitStatus, status_after, supervisor_of
from pdserve.common.paths import DEMO_MODEL_NAME, cached_model
from pdserve.common.ports import Listen, PortUnavailable, check_free
from pdserve.healthcheck import HealthcheckConfig, Verdict, check
from pdserve.common.affinity import format_cpu_list

if TYPE_CHECKING:
    from pdserve.planner.load_mode import Move, Rebalancer, Split

__all__ = ["ClusterConfig", "ClusterError", "ClusterPlan", "build_plan", "config_from_args", "main", "resolve_port",
           "run_cluster"]
EXAMPLE_PROMPT = "The quick brown fox"

Probe = Callable[[], Verdict]  # one Health probe of the router


def run_cluster(config: ClusterConfig, plan: ClusterPlan, supervisor: ClusterSupervisor,
                probe: Probe, stop: threading.Event, out: TextIO | None = None,
                rebalancer: Rebalancer | None = None,
                drain_asked: Callable[[], bool] = lambda: False) -> int:
    """Start, wait until ready, serve until `stop` is set (or the router drained); stop every child
    on every path, draining them first when `drain_asked()` says so (SIGTERM) or the router drained.
    `rebalancer`: the load mode's (config.rebalance), which moves nodes between the pools."""
    out = out or sys.stdout
    drain = False
    try:
        deadline = time.monotonic() + config.ready_timeout_s
        # The router and the nodes start together: each process spends seconds importing torch,
        # and a node registers whenever the router comes up (it retries an unreachable router).
        for spec in (plan.router, *plan.nodes):
            supervisor.start(spec)
        if not _wait_until_serving(probe, supervisor, stop, deadline, config):
            return 0
        _print_ready(config, plan, out)
        keeper = _Keeper(config, plan, supervisor, out)
        if rebalancer is not None:
            keeper.watch_load(rebalancer, stop)
        router_left = keeper.serve(stop)
        drain = router_left or drain_asked()
        return 0
    except ChildExited as err:
        _print_failure(str(err), err.tail, out)
        return 1
    except ClusterError as err:
        _print_failure(str(err), (), out)
        return 1
    finally:
        if drain:
            _drain(config, plan, supervisor, out)
        supervisor.stop_all(config.stop_grace_s)


def _drain(config: ClusterConfig, plan: ClusterPlan, supervisor: ClusterSupervisor, out: TextIO) -> None:
    """SIGTERM the router, wait for it, then every node: the router finishes its streams while
    the nodes still serve them, and the nodes then hold nothing more."""
    wait_s = config.drain_timeout_s + config.stop_grace_s
    print(f"pdserve cluster: draining (up to {config.drain_timeout_s:g}s for the router, then for the nodes)",
          file=out, flush=True)
    supervisor.signal_and_wait([plan.router.name], signal.SIGTERM, wait_s)
    supervisor.signal_and_wait([spec.name for spec in plan.nodes], signal.SIGTERM, wait_s)


def _wait_until_serving(probe: Probe, supervisor: ClusterSupervisor, stop: threading.Event, deadline: float,
                        config: ClusterConfig) -> bool:
    """True once the probe says the cluster serves; False when asked to stop; raises on a dead
    child, or at the deadline naming what the probe last found missing."""
    while not stop.is_set():
        supervisor.raise_if_exited()
        verdict = probe()
        if verdict.healthy:
            return True
        if time.monotonic() >= deadline:
            raise ClusterError(f"timed out after {config.ready_timeout_s:g}s waiting for the cluster to serve "
                               f"({verdict.reason})")
        stop.wait(config.poll_interval_s)
    return False


class _Keeper:
    """Keeps a serving cluster up: restarts children that exit, per the restart policy; in the
    load mode, carries out the moves of nodes between the pools."""

    def __init__(self, config: ClusterConfig, plan: ClusterPlan, supervisor: ClusterSupervisor, out: TextIO):
        self._config, self._plan, self._supervisor, self._out = config, plan, supervisor, out
        self._policy = config.restart
        self._due: dict[str, float] = {}  # child name -> when to start it again
        self._recent: dict[str, deque[float]] = {}  # child name -> its restart times inside the window
        self._restarts: dict[str, int] = {}  # child name -> restarts so far
        self._watcher: LoadWatcher | None = None
        self._moving: tuple[Move, str] | None = None  # a move under way, and the node it retires
        self._write_state()

    def watch_load(self, rebalancer: Rebalancer, stop: threading.Event) -> None:
        url = self._plan.metrics_urls(self._config.host)["router"]
        self._watcher = LoadWatcher(rebalancer, self._config.rebalance, scrape_url(url), self.split,
                                    lambda: self._moving is not None, self._say)
        self._watcher.start(stop)
        self._say(f"load mode: watching {url} every {self._config.rebalance.interval_s:g}s")

    def split(self) -> Split:
        from pdserve.planner.load_mode import Split

        # A node that drained and left on its own (SIGTERM from outside) is no longer in a pool.
        kinds = [spec.name.rsplit("-", 1)[0] for spec in self._plan.nodes
                 if self._supervisor.running(spec.name)]
        return Split(kinds.count("prefill"), kinds.count("decode"))

    def serve(self, stop: threading.Event) -> bool:
        """Until `stop` (False) or the router drained and left (True)."""
        while not stop.wait(self._config.poll_interval_s):
            now = time.monotonic()
            if self._watcher is not None:
                self._carry_out_moves()
            for exited in self._supervisor.exits():
                if self._left(exited) and exited.name == "router":
                    self._say("the router drained and stopped; draining the nodes and stopping the cluster")
                    return True
                if self._left(exited):
                    self._say(f"{exited.name} drained and left the cluster; serving on without it")
                    continue
                self._on_exit(exited, now)
            for name in [n for n, due in self._due.items() if due <= now]:
                del self._due[name]
                self._supervisor.restart(name)
                self._restarts[name] = self._restarts.get(name, 0) + 1
                self._say(f"{name} started again (restart {self._restarts[name]})")
                self._write_state()
        return False

    def _left(self, exited: ChildExited) -> bool:
        """A child exits 0 only after SIGTERM, i.e. drained: leaving, not failing (it is started
        again only under `--restart-mode always`)."""
        return exited.returncode == 0 and self._policy.mode != "always"

    def _on_exit(self, exited: ChildExited, now: float) -> None:
        """Schedule a restart, give up on a crash-looping or refused node, or raise to stop the cluster."""
        if self._policy.final(exited.returncode) and exited.name != "router":
            self._give_up(exited, f"{exited}, which restarting cannot help")
            return
        if not self._policy.wants(exited.returncode):
            raise exited
        recent = self._recent.setdefault(exited.name, deque())
        while recent and recent[0] < now - self._policy.window_s:
            recent.popleft()
        if len(recent) >= self._policy.max_restarts:
            message = f"{exited} after {len(recent)} restarts in {self._policy.window_s:g}s"
            if exited.name == "router":
                raise ClusterError(f"{message}; stopping the cluster")
            self._give_up(exited, message)
            return
        delay = self._policy.delay(len(recent))
        recent.append(now + delay)
        self._due[exited.name] = now + delay
        self._say(f"{exited}; starting it again in {delay:g}s")

    def _carry_out_moves(self) -> None:
        """Retire a node of the move's source pool; once it is gone, start one of the target pool
        on its cores (a new name and port: the router sees a node leave and another join)."""
        for spec, code in self._supervisor.retired():
            self._replace(spec, code)
        if self._moving is None:
            self._start_move()

    def _start_move(self) -> None:
        try:
            move, split = self._watcher.moves.get_nowait()
        except queue.Empty:
            return
        if split != self.split():
            return  # decided on a split that is no longer the cluster's
        leaving = [s.name for s in self._plan.nodes if s.name.rsplit("-", 1)[0] == move.source
                   and self._supervisor.running(s.name)][-1]
        self._say(f"load mode: {move.describe(split)}; {leaving} drains and leaves")
        self._supervisor.retire(leaving, self._config.rebalance.retire_grace_s)
        self._moving = (move, leaving)

    def _replace(self, left: ChildSpec, code: int) -> None:
        move, _ = self._moving
        taken = {s.name for s in self._plan.nodes}
        name = next(f"{move.target}-{i}" for i in itertools.count() if f"{move.target}-{i}" not in taken)
        metrics_port = resolve_port(self._config.host, 0) if self._plan.metrics_ports else None
        joined = node_spec(self._config, NodeSite(self._plan.model_dir, self._plan.router_addr), move.target, name,
                           left.cpus, resolve_port(self._config.host, 0), metrics_port)
        self._supervisor.start(joined)
        self._plan = self._plan.with_node_replaced(left.name, joined, self._config.host, metrics_port)
        self._moving = None
        self._watcher.moved()
        self._say(f"load mode: {left.name} left (exit code {code}); {name} started on its cores: "
                  f"now {self.split().describe()}")
        self._write_state()

    def _give_up(self, exited: ChildExited, message: str) -> None:
        self._say(f"giving up on {exited.name}: {message}; serving on without it")
        for line in exited.tail:
            print(f"  | {line}", file=self._out)

    def _say(self, line: str) -> None:
        print(f"pdserve cluster: {line}", file=self._out, flush=True)

    def _write_state(self) -> None:
        if self._config.state_file:
            write_state(self._config.state_file, cluster_state(self._config, self._plan, self._supervisor.pids,
                                                               self._restarts))


def cluster_state(config: ClusterConfig, plan: ClusterPlan, pids: dict[str, int],
                  restarts: dict[str, int]) -> ClusterState:
    urls = plan.metrics_urls(config.host)
    addresses = {"router": plan.router_addr, **plan.addresses}
    children = {name: ChildState(kind=name.rsplit("-", 1)[0], pid=pid, address=addresses[name],
                                 metrics_url=urls.get(name), restarts=restarts.get(name, 0))
                for name, pid in pids.items()}
    tls = plan.tls
    files = (tls.ca_file, tls.cert_file, tls.key_file) if tls is not None else (None, None, None)
    return ClusterState(plan.router_addr, children, plan.http_url(config.host), *files, config.auth_token_file)


def _print_ready(config: ClusterConfig, plan: ClusterPlan, out: TextIO) -> None:
    print(f"pdserve cluster ready at {plan.router_addr} ({config.node_counts})", file=out)
    if plan.http_port is not None:
        print(f"OpenAI-compatible HTTP API at {plan.http_url(config.host)}", file=out)
    pinned = [f"{spec.name} on cpus {format_cpu_list(spec.cpus)}" for spec in (plan.router, *plan.nodes) if spec.cpus]
    if pinned:
        print(f"pinned: {', '.join(pinned)}", file=out)
    for name, url in plan.metrics_urls(config.host).items():
        print(f"metrics: {name} {url}", file=out)
    flags = "".join(shlex.quote(arg) + " " for arg in client_flags(config))
    print(f"try: pdserve generate --addr {plan.router_addr} {flags}--max-tokens 32 {shlex.quote(EXAMPLE_PROMPT)}",
          file=out)
    print("stop with Ctrl-C", file=out, flush=True)


def _print_failure(message: str, tail: Sequence[str], out: TextIO) -> None:
    print(f"pdserve cluster failed: {message}", file=out)
    for line in tail:
        print(f"  | {line}", file=out)
    out.flush()


@dataclass
class _StopSignals:
    """SIGINT/SIGTERM set `stop` instead of raising, the first one is kept in `received`; the
    previous handlers come back on exit."""

    stop: threading.Event
    supervisor_pid: int | None = None  # a program that started this launcher: stop once it is gone
    previous: dict[int, object] = field(default_factory=dict)
    received: int | None = None
    orphaned: bool = False  # the program that started it is gone: stop at once, no drain

    def drain(self) -> bool:
        return self.received == signal.SIGTERM and not self.orphaned

    def __enter__(self) -> _StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._on_signal)
        if self.supervisor_pid is not None:
            threading.Thread(target=self._watch_parent, name="parent-watch", daemon=True).start()
        return self

    def _watch_parent(self) -> None:
        while not self.stop.wait(PARENT_CHECK_S):
            if os.getppid() != self.supervisor_pid:
                self.orphaned = True
                self._on_signal(signal.SIGTERM, None)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
        self.stop.set()


def _check_ports(config: ClusterConfig) -> None:
    """The launcher's own ports (the nodes' are picked free): a busy one fails before anything starts."""
    check_free(Listen("--port", config.host, config.port))
    if config.metrics_port is not None:
        check_free(Listen("--metrics-port", config.host, config.metrics_port))
    if config.http_port:
        check_free(Listen("--http-port", config.host, config.http_port))


def _model_dir(config: ClusterConfig, python: str = sys.executable) -> str:
    if config.model is not None:
        if not (Path(config.model) / "config.json").is_file():
            raise ClusterError(f"--model {config.model}: no config.json there")
        return str(Path(config.model).resolve())
    print("using the built-in demo model (built on first use, then cached)", flush=True)
    cached = cached_model(DEMO_MODEL_NAME)
    if cached is not None:
        return str(cached.resolve())
    # In a child process: the launcher itself never loads torch or transformers.
    code = "from pdserve.model_factory import ensure_demo_model; print(ensure_demo_model())"
    try:
        done = subprocess.run([python, "-c", code], stdout=subprocess.PIPE, text=True,
                              timeout=config.ready_timeout_s, check=False)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"building the demo model took over {config.ready_timeout_s:g}s") from err
    if done.returncode != 0 or not done.stdout.strip():
        raise ClusterError(f"building the demo model failed (exit code {done.returncode})")
    return done.stdout.strip().splitlines()[-1]


def _make_node_credential() -> str:
    """Client keys without a node credential: one made for this cluster's children, handed over in
    their environment ($PDSERVE_AUTH_TOKEN, which every child reads), never printed."""
    token = secrets.token_urlsafe(32)
    os.environ[TOKEN_ENV] = token
    print("node join credential: made for this cluster (API keys open only the public API)", flush=True)
    return token


def main(argv: list[str] | None = None) -> int:
    with ExitStack() as cleanup:  # what the launcher made for this run only (a --tls directory)
        return _main(argv, cleanup)


def _main(argv: list[str] | None, cleanup: ExitStack) -> int:
    try:
        config = config_from_args(argv)
        token = token_from_cli(config.auth_token_file, os.environ)  # the launcher's own probe
        if config.api_keys_file:
            ApiKeys(config.api_keys_file)  # unreadable or keyless: a usage error before anything starts
            token = token or _make_node_credential()
        check_cores(config, None)  # before the demo model is built: a typo fails at once
        _check_ports(config)
        config = with_cluster_tls(config, cleanup, token)
        token = token or token_from_cli(config.auth_token_file, os.environ)
        plan = build_plan(config, _model_dir(config), resolve_port(config.host, config.port))
        rebalancer = None if config.rebalance is None else build_rebalancer(
            config.rebalance, [spec.argv for spec in plan.nodes], plan.router.argv,
            log=lambda line: print(line, flush=True))
    except (ValueError, ClusterError, PortUnavailable, subprocess.CalledProcessError) as err:
        print(f"pdserve cluster: {err}", file=sys.stderr)
        return ExitStatus.USAGE
    except KeyboardInterrupt:  # Ctrl-C while the demo model builds: nothing started yet
        return ExitStatus.INTERRUPTED
    probe_config = HealthcheckConfig(timeout_s=config.probe_timeout_s, min_prefill=config.num_prefill,
                                     min_decode=config.num_decode, min_colocated=config.num_colocated,
                                     auth_token=token, tls=config.tls)
    supervisor = ClusterSupervisor(log_dir=Path(config.log_dir) if config.log_dir else None)
    if config.log_dir:
        print(f"logs in {config.log_dir}/<name>.log", flush=True)
    stop = threading.Event()
    with _StopSignals(stop, supervisor_of(os.environ)) as signals:
        status = run_cluster(config, plan, supervisor, lambda: check(plan.router_addr, "router", probe_config), stop,
                             rebalancer=rebalancer, drain_asked=signals.drain)
    return status_after(signals.received) if status == ExitStatus.OK else status


if __name__ == "__main__":
    sys.exit(main())
