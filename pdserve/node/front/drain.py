"""A node's drain: what SIGTERM (Kubernetes scaling a pool down) does before the node stops.

    SIGTERM ─▶ /health "draining", grpc health NOT_SERVING
            ─▶ heartbeat `draining` at once: the router places nothing new here (RouterLink.drain)
            ─▶ the node serves on: every open RPC runs to its end, a call the router sent just
               before it heard is taken too; a prefill node computes its queued prompts and
               pushes their KV until each push is acknowledged
            ─▶ holds nothing (no open RPC; its core has no request waiting or running and no
               block in use or held for a transfer) ─▶ Deregister ─▶ stop ─▶ exit 0
            ─▶ or `--drain-timeout-s` passes first ─▶ Deregister anyway ─▶ stop

What still runs at the timeout is failed, not handed off: the router sees its node leave (a
Deregister that is not `drained` marks the entry gone), and the stopping server cancels the
calls, so each sample resumes on another node from the tokens its client already has — the same
exact path as a lost node, counted `pdserve_resumes_total{reason="drain_timeout"}`. A hand-off
would move a running request's KV to another decode node, a decode-to-decode path and a
re-placement the router does not have; a resume costs one prefill of prompt + streamed tokens,
and only for what outlives the drain. A drain that ends in time recomputes nothing: its
Deregister says `drained`, so a decode stream it fed (whose first token the router may not have
yet) is not failed over.

Must never: refuse a call while draining (the router may have placed it before it heard),
stop the node before it holds nothing or the timeout passed, or wait past the timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.node.front.client import CoreClient
from pdserve.node.front.registration import RouterLink
from pdserve.node.messages import StatsData

logger = logging.getLogger(__name__)


def still_held(open_requests: int, stats: StatsData | None) -> str | None:
    """What the node still holds, in words; None when nothing (a core that did not answer in
    time may hold anything)."""
    if stats is None:
        return "its engine core is mid-step"
    held = {"open requests": open_requests, "waiting": stats.num_waiting, "running": stats.num_running,
            "blocks in use": stats.used_blocks, "blocks held for transfers": stats.reserved_blocks}
    busy = [f"{value} {name}" for name, value in held.items() if value]
    return ", ".join(busy) or None


async def drain(client: CoreClient, link: RouterLink, timeout_s: float, poll_s: float) -> bool:
    """Leave placement, wait until the node holds nothing (or `timeout_s`), then leave the
    router. True if it drained in time."""
    start = time.monotonic()
    await link.drain()
    logger.info("draining: placed nothing new from now on; finishing what this node holds (up to %.1fs)",
                timeout_s)
    drained = await _until_empty(client, start + timeout_s, poll_s)
    await link.leave(drained)
    if drained:
        logger.info("drained in %.2fs", time.monotonic() - start)
    return drained


async def _until_empty(client: CoreClient, deadline: float, poll_s: float) -> bool:
    while True:
        if client.dead.is_set():
            return False
        # Counted as the query goes (no await between): every request sent before it is in the
        # core's answer or still open; counted again after, for one that opened meanwhile.
        open_before = client.open_requests
        stats = await client.fresh_stats()
        held = still_held(max(open_before, client.open_requests), stats)
        if held is None:
            return True
        if time.monotonic() >= deadline:
            logger.warning("drain timed out with %s; failing them over (the router resumes them elsewhere)", held)
            return False
        await asyncio.sleep(poll_s)
