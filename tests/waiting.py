"""Waiting for a condition in a test: one bounded poll, never a sleep standing in for the condition.

`wait_until` (sync) fails the test naming what it waited for; `until` (async) raises TimeoutError,
which the caller's scenario reports like any other failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 60.0, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what}"
        time.sleep(interval_s)


async def until(predicate: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.01) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(interval_s)
