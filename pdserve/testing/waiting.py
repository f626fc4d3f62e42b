"""Waiting for a condition: one bounded poll, never a sleep standing in for the condition.

`wait_until` (sync) fails the test naming what it waited for (`what` may be a function, asked at
the timeout, to show the state then); `until` (async) raises TimeoutError, which the caller's
scenario reports like any other failure. `until`'s predicate may be a coroutine function (an RPC
asked again until its answer is the one awaited). Both return the predicate's first true answer.
`settled` reads a state until it is the one awaited and returns it either way: for a test that
asserts exactly what it read (block counts all zero), so its failure shows the state at the timeout.

Must never: wait without a bound, or swallow the timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], object], what: str | Callable[[], str], timeout_s: float = 60.0,
               interval_s: float = 0.02) -> object:
    deadline = time.monotonic() + timeout_s
    while not (answer := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting until {what() if callable(what) else what}")
        time.sleep(interval_s)
    return answer


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


def settled(read: Callable[[], T], done: Callable[[T], object], timeout_s: float, interval_s: float = 0.05) -> T:
    """The first reading `done` accepts, or the last one once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not done(reading := read()) and time.monotonic() <= deadline:
        time.sleep(interval_s)
    return reading
