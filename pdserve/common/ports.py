"""The ports a command listens on, named by the flag that set them: the check before a bind,
and the one-line error when a port cannot be had.

Owns `Listen` (flag, host, port), `PortUnavailable` — whose text is what the command prints
after its own name, e.g. `--port 50051: 127.0.0.1:50051 is already in use`, with exit status 2
(pdserve/common/lifecycle.py) — and `check_free`, the probe a command runs on its ports before its
slow start (a node loads its model before it binds gRPC), so a busy port fails in a moment
and before gRPC writes its own log line about it. A probe is only a forecast: the real bind
can still lose a race, and `unavailable` turns that failure into the same error.

Must never: keep a socket open, pick a port, or print.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Listen:
    """One port a command listens on: the flag that set it and the address it binds."""

    flag: str  # e.g. "--port"
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class PortUnavailable(Exception):
    """A port the command was told to listen on cannot be had; a usage error, not a crash."""

    def __init__(self, listen: Listen, reason: str) -> None:
        self.listen = listen
        super().__init__(f"{listen.flag} {listen.port}: {listen.address} {reason}")


def check_free(listen: Listen) -> None:
    """Raise PortUnavailable when something already listens on the port (port 0 always passes).

    Other bind failures (a host that is not this machine's, a privileged port) are left to
    the real bind, which reports them through `unavailable`.
    """
    if listen.port == 0:
        return
    error = _bind_error(listen)
    if error is not None and error.errno == errno.EADDRINUSE:
        raise unavailable(listen, error)


def unavailable(listen: Listen, error: OSError | None = None) -> PortUnavailable:
    """The error for a bind that failed; without `error` (gRPC says only that it failed) a
    probe of the same address finds out why."""
    if error is None:
        error = _bind_error(listen)
    if error is None:
        return PortUnavailable(listen, "could not be bound")
    if error.errno == errno.EADDRINUSE:
        return PortUnavailable(listen, "is already in use")
    return PortUnavailable(listen, f"cannot be bound: {error.strerror or error}")


def _bind_error(listen: Listen) -> OSError | None:
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # As every listener here does: a connection of a previous process still in
            # TIME_WAIT is no obstacle, a live listener is.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((listen.host.strip("[]"), listen.port))
    except OSError as err:
        return err
    return None
