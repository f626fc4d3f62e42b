"""No call waits on a node that is gone: a node call raced against its nodes' `gone` events.

A node can vanish without failing its calls: frozen (SIGSTOP, a hung host), its calls
stay open and silent until the client's deadline. The registry marks such a node gone
once it has been silent past the heartbeat timeout (router/cluster/registry.py), and every call
the driver or a route makes through `unless_gone` ends then with `NodeGone`, so the
sample resumes (decode) or retries (prefill) elsewhere within heartbeat timeout +
maintenance interval. When the node wakes, the router has cancelled its calls: it frees
what they held, heartbeats, registers again and takes new traffic.

Must never: cancel the call itself (the caller's `finally` does), or wait on anything but
the awaitable and the events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from pdserve.router.cluster.registry import NodeEntry

T = TypeVar("T")


class NodeGone(Exception):
    """One of the nodes a call depends on is gone (`entry.gone_reason` says why)."""

    def __init__(self, entry: NodeEntry) -> None:
        super().__init__(f"{entry.kind.value} node {entry.node_id} is gone: {entry.gone_reason}")
        self.entry = entry


async def unless_gone(awaitable: Awaitable[T], entries: Sequence[NodeEntry]) -> T:
    """`awaitable`'s result, or `NodeGone` as soon as one of `entries` is gone first."""
    for entry in entries:
        if entry.gone.is_set():
            _close(awaitable)
            raise NodeGone(entry)
    work = asyncio.ensure_future(awaitable)
    watches = {asyncio.ensure_future(entry.gone.wait()): entry for entry in entries}
    try:
        await asyncio.wait([work, *watches], return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise NodeGone(next(entry for watch, entry in watches.items() if watch.done()))
    finally:
        for watch in watches:
            watch.cancel()
        work.cancel()  # no-op once done


def _close(awaitable: Awaitable) -> None:
    if asyncio.iscoroutine(awaitable):
        awaitable.close()  # never awaited: say so, instead of a "never awaited" warning
