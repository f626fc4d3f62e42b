"""No call waits on a node that is gone: a node call raced against its nodes' `gone` events.

A node can vanish without failing its calls: frozen (SIGSTOP, a hung host), its calls
stay open and silent until the client's deadline. The registry marks such a node gone
once it has been silent past the heartbeat timeout (pdserve/router/cluster/registry.py), and every call
the driver or a route makes through `unless_gone` (one await) or a `GoneWatch` (every
await of a stream) ends then with `NodeGone`, so the sample resumes (decode) or retries
(prefill) elsewhere within heartbeat timeout + maintenance interval. When the node wakes,
the router has cancelled its calls: it frees what they held, heartbeats, registers again
and takes new traffic.

The awaitable runs in the caller's own task; a node gone while it waits cancels that wait
(as `asyncio.timeout` does) and the cancellation becomes `NodeGone`. A `GoneWatch` watches
its nodes once for a whole stream, so a stream's events cost no task each.

Must never: cancel anything but the wait it was given (the caller's `finally` cancels the
call), swallow a cancellation that came from elsewhere, or wait on anything but the
awaitable and the events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from pdserve.router.cluster.registry import NodeEntry

T = TypeVar("T")


class NodeGone(Exception):
    """One of the nodes a call depends on is gone (`entry.gone_reason` says why)."""

    def __init__(self, entry: NodeEntry) -> None:
        super().__init__(f"{entry.kind.value} node {entry.node_id} is gone: {entry.gone_reason}")
        self.entry = entry


class GoneWatch:
    """Watches nodes across any number of `until` awaits, one at a time.

    One watch task per node for as long as the watch is open (`with GoneWatch(...)`);
    `until(awaitable)` then costs no task at all."""

    def __init__(self, entries: Iterable[NodeEntry]) -> None:
        self._entries = list(entries)
        self._watches: dict[NodeEntry, asyncio.Future] = {}
        self._task: asyncio.Task | None = None  # the task awaiting in `until`
        self._waiting = False  # inside `until`: a node gone now cancels the wait
        self._gone: NodeEntry | None = None  # the node whose loss cancelled the wait

    def __enter__(self) -> GoneWatch:
        for entry in self._entries:
            self._watch(entry)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for watch in self._watches.values():
            watch.cancel()
        self._watches.clear()

    def forget(self, entries: Iterable[NodeEntry]) -> None:
        """Stop watching `entries` (the call no longer depends on them)."""
        for entry in entries:
            watch = self._watches.pop(entry, None)
            if watch is not None:
                watch.cancel()

    async def until(self, awaitable: Awaitable[T]) -> T:
        """`awaitable`'s result, or `NodeGone` as soon as a watched node is gone first."""
        for entry in self._watches:
            if entry.gone.is_set():
                _close(awaitable)
                raise NodeGone(entry)
        self._task = asyncio.current_task()
        self._waiting = True
        try:
            result = await awaitable
        except asyncio.CancelledError:
            gone, self._gone = self._gone, None
            # Ours alone (no other cancel pending on the task): the node is gone.
            if gone is not None and self._task.uncancel() == 0:
                raise NodeGone(gone) from None
            raise
        finally:
            self._waiting = False
        if self._gone is not None:  # the awaitable swallowed our cancel: take it back, say why
            gone, self._gone = self._gone, None
            self._task.uncancel()
            raise NodeGone(gone)
        return result

    def _watch(self, entry: NodeEntry) -> None:
        if entry in self._watches:
            return
        watch = asyncio.ensure_future(entry.gone.wait())
        watch.add_done_callback(lambda done: self._on_gone(entry, done))
        self._watches[entry] = watch

    def _on_gone(self, entry: NodeEntry, watch: asyncio.Future) -> None:
        if watch.cancelled() or not self._waiting or self._gone is not None:
            return  # forgotten, closed, or between waits (the next `until` sees the event)
        self._gone = entry
        self._task.cancel()


async def unless_gone(awaitable: Awaitable[T], entries: Iterable[NodeEntry]) -> T:
    """`awaitable`'s result, or `NodeGone` as soon as one of `entries` is gone first."""
    entries = list(entries)
    for entry in entries:
        if entry.gone.is_set():
            _close(awaitable)
            raise NodeGone(entry)
    with GoneWatch(entries) as watch:
        return await watch.until(awaitable)


def _close(awaitable: Awaitable) -> None:
    if asyncio.iscoroutine(awaitable):
        awaitable.close()  # never awaited: say so, instead of a "never awaited" warning
