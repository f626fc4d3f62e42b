"""Time as an object the engine is given, so scheduling rules that read it are tested with a fake.

Must never: sleep, or be read through a module-level global.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds from an arbitrary origin; never goes backwards."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()
