"""How a pdserve process lives and ends: its exit statuses, a server's phases, its stop signals.

Owns the exit statuses every command shares (`ExitStatus`), the phases of a server process
(`ServerPhase`: what its `/health` reports while it is not serving), and `StopSignals`, which
turns SIGINT and SIGTERM into one asyncio event and remembers which came first: Ctrl-C ends a
command with 130 (128 + SIGINT, what a shell reports for a command Ctrl-C ended), SIGTERM — a
supervisor's stop — with 0.

Must never: exit the process, print, or install a handler outside `StopSignals.install`.
"""

from __future__ import annotations

import asyncio
import enum
import signal


class ExitStatus(enum.IntEnum):
    OK = 0  # done, or stopped by SIGTERM
    FAILED = 1
    USAGE = 2  # a bad flag value, a port that cannot be had: one line on stderr, nothing started
    INTERRUPTED = 130  # Ctrl-C (SIGINT)


class ServerPhase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


def status_after(signum: int | None) -> ExitStatus:
    """How a command that ran until a stop signal ends (None: it ended on its own)."""
    return ExitStatus.INTERRUPTED if signum == signal.SIGINT else ExitStatus.OK


class StopSignals:
    """SIGINT and SIGTERM set `event` on the running loop; `received` is the first of them."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.received: int | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)

    @property
    def exit_status(self) -> ExitStatus:
        return status_after(self.received)

    def _on_signal(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
        self.event.set()
