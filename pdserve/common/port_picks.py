"""The ports picked on this machine for a child that has not bound them yet, in one ledger that
every picker shares, so two picks never hand out the same port.

A launcher picks a node's port (free at that moment) and the node binds it seconds later, after
it imports torch. Until then a probe from anyone else finds the port free too: a second launcher,
a test picking a port for a process it starts by hand, or the same launcher's next pick. Each
such pick is written here, under a lock, and held for `HOLD_S`; a picker passes over a held port.
The ledger is one small JSON file in the temp directory (`{port: time the hold ends}`), pruned of
ended holds on every write, so it stays as small as the picks of the last few minutes.

A ledger that cannot be opened (another user's file, a read-only temp directory) only loses
this guard: the pick falls back to probing alone, as before.

Must never: keep a socket open, or hold its lock beyond one claim.
"""

from __future__ import annotations

import fcntl
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

# Long enough for a child to import torch and bind on a loaded box; once bound, the port is
# busy to any probe anyway, so a longer hold only keeps an unused port out of use a while.
HOLD_S = 600.0
LEDGER_NAME = "pdserve-port-picks.json"


class PortLedger:
    """Picks held machine-wide; `claim` picks the first free, unheld candidate and holds it."""

    def __init__(self, path: Path | None = None, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._path = path or Path(tempfile.gettempdir()) / LEDGER_NAME
        self._hold_s = hold_s
        self._clock = clock  # wall time: the holds are compared across processes

    def claim(self, candidates: Iterable[int], is_free: Callable[[int], bool]) -> int | None:
        """The first candidate not held and `is_free`, now held; None when none is.
        Without a usable ledger: the first candidate that `is_free`."""
        try:
            ledger = open(self._path, "a+", encoding="utf-8")
        except OSError:
            return next((port for port in candidates if is_free(port)), None)
        with ledger:
            fcntl.flock(ledger, fcntl.LOCK_EX)  # released when the file closes
            now = self._clock()
            holds = {port: until for port, until in _read(ledger).items() if until > now}
            port = next((p for p in candidates if p not in holds and is_free(p)), None)
            if port is not None:
                holds[port] = now + self._hold_s
            ledger.seek(0)
            ledger.truncate()
            json.dump({str(p): until for p, until in holds.items()}, ledger)
        return port


def _read(ledger) -> dict[int, float]:
    ledger.seek(0)
    try:
        return {int(port): float(until) for port, until in json.loads(ledger.read() or "{}").items()}
    except (ValueError, AttributeError, TypeError):
        return {}  # a torn or foreign file: its holds are lost, the next write replaces it
