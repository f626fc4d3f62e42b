"""Child processes of a local cluster: start, watch, log, stop — and never leave one behind.

Owns: one subprocess per `ChildSpec`, each the leader of its own process group (so a
signal reaches whatever it spawns, e.g. a node's engine-core process, and a Ctrl-C in
the terminal reaches only the launcher, which then stops the children in order); one
reader thread per child that prefixes its output lines with the child's name (console)
or writes them to `<log_dir>/<name>.log`, and keeps the last lines for error reports.
A child with `cpus` is pinned to them as it starts (cores as devices): right after its
exec, before its interpreter has imported anything, so every thread and process it
starts later inherits the mask.

Stop: SIGINT to every child (the group leader only, so a node can shut its own engine
core down in order; SIGINT: at once), wait up to the grace period for them, then SIGKILL
every group — a child that ignored the signal, and whatever a child left behind (once the
leader is gone, anything left in its group is an orphan). `signal_and_wait` sends some children
a signal and waits for them (the launcher's drain: SIGTERM, stage by stage).

Must never: know what the children are (router, node, or `sleep` in a test), signal a
process group it did not create, or block longer than the grace period plus a moment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from pdserve.common.lifecycle import PARENT_PID_ENV
from pdserve.common.refusal import FINAL_EXIT_CODES

READER_JOIN_S = 1.0  # how long to wait for a reader to drain an exited child's pipe
RESTART_MODES = ("on-failure", "always", "never")


@dataclass(frozen=True)
class RestartPolicy:
    """Which children that exit on their own start again, and how soon (docker's modes).

    A child is started again `backoff_s` after it exits, doubling with each restart inside
    `window_s` up to `max_backoff_s`; after `max_restarts` restarts inside `window_s` it is
    crash-looping, and the launcher gives up on it.
    """

    mode: str = field(default="on-failure", metadata={
        "choices": RESTART_MODES,
        "help": "on-failure: restart a child that exits with a non-zero code or a signal; "
                "never: any exit stops the whole cluster"})
    backoff_s: float = field(default=1.0, metadata={"help": "wait before the first restart"})
    max_backoff_s: float = field(default=30.0, metadata={"help": "the longest wait between restarts"})
    max_restarts: int = field(default=5, metadata={"help": "restarts within --restart-window-s before giving up"})
    window_s: float = field(default=60.0, metadata={"help": "the window of --restart-max-restarts"})

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"--restart-mode must be one of {RESTART_MODES}, got {self.mode!r}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("--restart-backoff-s must be > 0 and <= --restart-max-backoff-s")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("--restart-max-restarts must be >= 0 and --restart-window-s > 0")

    def wants(self, returncode: int) -> bool:
        """Start a child that exited with `returncode` again? Never after an exit in
        `FINAL_EXIT_CODES` (pdserve/common/refusal.py), whatever the mode: 2, a usage error such as a model
        folder no engine can serve, and 78 (EXIT_REFUSED), a node whose fingerprint the router
        refused (another block size, dtype or model). The same command line would be refused again,
        so restarting would only crash-loop until given up on (see `final`)."""
        if returncode in FINAL_EXIT_CODES:
            return False
        return self.mode == "always" or (self.mode == "on-failure" and returncode != 0)

    def final(self, returncode: int) -> bool:
        """An exit the same command line would repeat: the launcher gives up on such a node at
        once (a router that exits so stops the cluster), unless `never` stops the cluster anyway."""
        return self.mode != "never" and returncode in FINAL_EXIT_CODES

    def delay(self, recent_restarts: int) -> float:
        """Wait before restart number `recent_restarts + 1` of the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent_restarts)


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)  # added to the launcher's environment
    cpus: tuple[int, ...] | None = None  # pin the child to these cores; None: leave it


class ChildExited(RuntimeError):
    """A child ended while the cluster needed it."""

    def __init__(self, name: str, returncode: int, tail: list[str]) -> None:
        self.name = name
        self.returncode = returncode
        self.tail = tail
        super().__init__(f"{name} exited with code {returncode}")


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen
    tail: deque[str]
    reader: threading.Thread
    killed: bool = False  # the supervisor stopped it (not an exit to report)
    reported: bool = False  # its exit was handed out by `exits()`
    retire_by: float | None = None  # retiring (`retire`): SIGKILL of its group if it still runs then


class ClusterSupervisor:
    def __init__(self, log_dir: Path | None = None, console: TextIO | None = None,
                 tail_lines: int = 40) -> None:
        self._log_dir = log_dir
        self._console = console
        self._tail_lines = tail_lines
        self._children: list[_Child] = []
        self._write_lock = threading.Lock()
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def pids(self) -> dict[str, int]:
        return {c.spec.name: c.proc.pid for c in self._children}

    def start(self, spec: ChildSpec) -> int:
        """Start `spec` in its own process group; returns its pid."""
        if any(c.spec.name == spec.name for c in self._children):
            raise ValueError(f"a child named {spec.name!r} is already supervised")
        # PARENT_PID_ENV: a child stops by itself once this process is gone, even SIGKILLed.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid()), **spec.env}
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        tail: deque[str] = deque(maxlen=self._tail_lines)
        reader = threading.Thread(target=self._pump, args=(spec.name, proc.stdout, tail),
                                  name=f"log-{spec.name}", daemon=True)
        self._children.append(_Child(spec, proc, tail, reader))  # from here on, stop_all stops it
        reader.start()
        if spec.cpus is not None:
            # Not a preexec_fn (unsafe beside the reader threads): the child has only just
            # exec'd and runs a single thread, which is all that needs the mask now.
            _pin(proc.pid, spec.cpus)
        return proc.pid

    def first_exit(self) -> ChildExited | None:
        """The first child (in start order) that has exited on its own, or None."""
        for child in self._children:
            if child.killed or child.proc.poll() is None:
                continue
            child.reader.join(READER_JOIN_S)  # let its last lines reach the tail
            return ChildExited(child.spec.name, child.proc.returncode, list(child.tail))
        return None

    def exits(self) -> list[ChildExited]:
        """Children that exited on their own since the last call, each reported once."""
        out = []
        for child in self._children:
            if child.killed or child.reported or child.proc.poll() is None:
                continue
            child.reader.join(READER_JOIN_S)
            child.reported = True
            out.append(ChildExited(child.spec.name, child.proc.returncode, list(child.tail)))
        return out

    def restart(self, name: str) -> int:
        """Start child `name` again with the same spec (it must have exited); returns its new pid."""
        child = next(c for c in self._children if c.spec.name == name)
        if child.proc.poll() is None:
            raise ValueError(f"{name} is still running")
        _signal_group(child.proc.pid, signal.SIGKILL)  # whatever it left behind in its group
        child.reader.join(READER_JOIN_S)
        self._children.remove(child)
        return self.start(child.spec)

    def retire(self, name: str, grace_s: float) -> None:
        """Ask child `name` to leave: SIGTERM (a node drains what it holds, deregisters and exits),
        its exit no failure to report; `retired()` hands it back once gone, SIGKILLed after `grace_s`."""
        child = next(c for c in self._children if c.spec.name == name)
        child.killed = True
        child.retire_by = time.monotonic() + grace_s
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)

    def retired(self) -> list[tuple[ChildSpec, int]]:
        """Retiring children that are gone, each with its exit code, no longer supervised."""
        gone = []
        for child in [c for c in self._children if c.retire_by is not None]:
            if child.proc.poll() is None and time.monotonic() >= child.retire_by:
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait()
            if child.proc.poll() is None:
                continue
            _signal_group(child.proc.pid, signal.SIGKILL)  # whatever it left behind in its group
            child.reader.join(READER_JOIN_S)
            self._children.remove(child)
            gone.append((child.spec, child.proc.returncode))
        return gone

    def raise_if_exited(self) -> None:
        exited = self.first_exit()
        if exited is not None:
            raise exited

    def returncode(self, name: str) -> int | None:
        """How child `name` ended (negative: the signal that ended it); None while it runs."""
        return next(c.proc.poll() for c in self._children if c.spec.name == name)

    def running(self, name: str) -> bool:
        """Child `name` is supervised and has not exited (safe to ask from another thread)."""
        return any(c.spec.name == name and c.proc.poll() is None for c in list(self._children))

    def tail(self, name: str) -> list[str]:
        """The last output lines of child `name` (KeyError if there is none)."""
        for child in self._children:
            if child.spec.name == name:
                return list(child.tail)
        raise KeyError(name)

    def signal_and_wait(self, names: Collection[str], signum: signal.Signals, timeout_s: float) -> None:
        """Send `signum` to the named children still running (each counts as stopped by the
        supervisor from now on) and wait up to `timeout_s` for them to exit."""
        chosen = [c for c in self._children if c.spec.name in names]
        for child in chosen:
            child.killed = True
            if child.proc.poll() is None:
                child.proc.send_signal(signum)
        deadline = time.monotonic() + timeout_s
        for child in chosen:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def stop_all(self, grace_s: float, signum: signal.Signals = signal.SIGINT) -> None:
        """`signum` to every child, wait up to `grace_s` for them, then SIGKILL every group."""
        self.signal_and_wait([c.spec.name for c in self._children], signum, grace_s)
        for child in self._children:
            _signal_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
        for child in self._children:
            child.reader.join(READER_JOIN_S)

    def __enter__(self) -> ClusterSupervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all(grace_s=0.0)

    def _pump(self, name: str, stream: IO[bytes], tail: deque[str]) -> None:
        sink = open(self._log_dir / f"{name}.log", "a", encoding="utf-8") if self._log_dir else None
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                tail.append(line)
                self._write(name, line, sink)
        finally:
            stream.close()
            if sink is not None:
                sink.close()

    def _write(self, name: str, line: str, sink: IO[str] | None) -> None:
        if sink is not None:
            sink.write(line + "\n")
            sink.flush()
            return
        console = self._console or sys.stdout
        with self._write_lock:
            console.write(f"[{name}] {line}\n")
            console.flush()


def _pin(pid: int, cpus: tuple[int, ...]) -> None:
    try:
        os.sched_setaffinity(pid, set(cpus))
    except ProcessLookupError:
        pass  # it exited already; first_exit() reports it


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    # The child called setsid, so its pid is its group id; a group with no members left
    # is already gone. Stopping runs in `finally` blocks: it must not raise.
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
