"""How a pdserve process lives and ends: its exit statuses, a server's phases, its stop signals.

Owns the exit statuses every command shares (`ExitStatus`), the phases of a server process
(`ServerPhase`: what its `/health` reports while it is not serving), the default drain time
(`DEFAULT_DRAIN_TIMEOUT_S`) and `StopSignals`, which turns SIGINT and SIGTERM into one asyncio
event and remembers which came first: Ctrl-C ends a command with 130 (128 + SIGINT, what a shell
reports for a command Ctrl-C ended), SIGTERM — a supervisor's stop, what Kubernetes sends — with
0. SIGTERM asks a server to *drain* (`StopSignals.drain`: take nothing new, finish what it holds
within `--drain-timeout-s`, then stop); Ctrl-C stops it at once. A process a supervisor started
(`PARENT_PID_ENV` names the supervisor) also stops, at once, when that supervisor is gone, even
killed outright: nothing is left behind a launcher that could not stop its children itself.

Must never: exit the process, print, or install a handler outside `StopSignals.install`.
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
from collections.abc import Callable, Mapping

# Set by a supervisor in its children's environment: the pid they stop without.
PARENT_PID_ENV = "PDSERVE_PARENT_PID"
PARENT_CHECK_S = 1.0  # how often a supervised process looks for its supervisor
# How long a server given SIGTERM may take to finish what it holds (`--drain-timeout-s` of the
# router, every node and the launcher): under Kubernetes' default 30 s termination grace.
DEFAULT_DRAIN_TIMEOUT_S = 25.0


class ExitStatus(enum.IntEnum):
    OK = 0  # done, or stopped by SIGTERM
    FAILED = 1
    USAGE = 2  # a bad flag value, a port that cannot be had: one line on stderr, nothing started
    INTERRUPTED = 130  # Ctrl-C (SIGINT)


class ServerPhase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"  # SIGTERM: takes nothing new, finishes what it holds
    STOPPING = "stopping"


def supervisor_of(environ: Mapping[str, str]) -> int | None:
    """The pid of the supervisor that started this process, if one did."""
    value = environ.get(PARENT_PID_ENV, "")
    return int(value) if value.isdigit() else None


def status_after(signum: int | None) -> ExitStatus:
    """How a command that ran until a stop signal ends (None: it ended on its own)."""
    return ExitStatus.INTERRUPTED if signum == signal.SIGINT else ExitStatus.OK


class StopSignals:
    """SIGINT and SIGTERM set `event` on the running loop; `received` is the first of them."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.received: int | None = None
        self.orphaned = False  # the supervisor is gone: stop at once, there is no one to drain for

    def install(self, loop: asyncio.AbstractEventLoop, supervisor_pid: int | None = None,
                parent_pid: Callable[[], int] = os.getppid) -> None:
        """Stop on SIGINT/SIGTERM; and, given `supervisor_pid`, once this process's parent is
        no longer that supervisor (it died: the process was handed to another parent), as SIGTERM."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        if supervisor_pid is not None:
            self._watch_parent(loop, supervisor_pid, parent_pid)

    def _watch_parent(self, loop: asyncio.AbstractEventLoop, supervisor_pid: int,
                      parent_pid: Callable[[], int]) -> None:
        if parent_pid() != supervisor_pid:
            self.orphaned = True
            self._on_signal(signal.SIGTERM)
            return
        loop.call_later(PARENT_CHECK_S, self._watch_parent, loop, supervisor_pid, parent_pid)

    @property
    def drain(self) -> bool:
        """Did the stop come as SIGTERM (finish what is held first) rather than Ctrl-C or an orphaning?"""
        return self.received == signal.SIGTERM and not self.orphaned

    @property
    def exit_status(self) -> ExitStatus:
        return status_after(self.received)

    def _on_signal(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
        self.event.set()
