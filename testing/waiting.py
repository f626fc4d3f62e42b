"""Waiting for a condition: one bounded poll, never a sleep standing in for the condition.

`wait_until` (sync) fails the test naming what it waited for; `until` (async) raises TimeoutError,
which the caller's scenario reports like any other failure. `until`'s predicate may be a coroutine
function (an RPC asked again until its answer is the one awaited).

Must never: wait without a bound, or swallow the timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 60.0, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what}"
        time.sleep(interval_s)


async def until(predicate: Callable[[], object | Awaitable[object]], timeout_s: float = 5.0,
                interval_s: float = 0.01) -> object:
    """The predicate's first true answer."""
    async with asyncio.timeout(timeout_s):
        while True:
            answer = predicate()
            if inspect.isawaitable(answer):
                answer = await answer
            if answer:
                return answer
            await asyncio.sleep(interval_s)
