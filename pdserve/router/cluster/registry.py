"""The node registry: which prefill, decode and colocated nodes are alive, their last stats, their channels.

Owns one `NodeEntry` per node (by id): kind, address, last `NodeStats`, when it was last
heard from. Nodes register and heartbeat through the router's `Registry` service;
static nodes (from flags) are polled with `GetStats` instead. A node not heard from
for `heartbeat_timeout_s` is not live: a registered one is dropped (it registers again
when its next heartbeat is answered known=false), a static one stays on the list and
comes back when it answers again. A node that failed a request's call and then did not
answer a `GetStats` probe is *suspect*: not live until its next stats arrive, so other
requests stop trying it long before its heartbeat timeout. A node that heartbeats
`draining` (it got SIGTERM) is *draining*: not live, so placement gives it nothing new,
while the calls it holds run to their end on its entry; it then `deregister`s and is
forgotten. Draining is never undone (a node that drains leaves; started again it registers
afresh). A registering node is admitted
only if its fingerprint agrees with the router's facts and with the nodes already registered
(pdserve/router/cluster/node_facts.py); otherwise `NodeRefused` names every field that differs, and the refusal
is logged. One gRPC channel per address
is cached (reconnecting within a second, so a node restarted on its old address takes
traffic as soon as it registers).

It never decides placement and never calls a node except for `GetStats` (static nodes,
probes).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from pdserve.common.channels import reconnecting_channel
from pdserve.common.tls import TlsConfig
from pdserve.proto import node_pb2, node_pb2_grpc
from pdserve.router.errors import NodeRefused
from pdserve.router.cluster.node_facts import RouterFacts, disagreements
from pdserve.router.cluster.placement import Candidate

log = logging.getLogger(__name__)


def node_channel_factory(token: str | None, tls: TlsConfig | None = None) -> Callable[[str], grpc.aio.Channel]:
    """Channels to nodes whose every call carries the auth token (pdserve/common/auth.py), over mutual
    TLS when the router has it (pdserve/common/tls.py)."""
    return lambda address: reconnecting_channel(address, token, tls)


class NodeKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # runs both phases: the baseline the disaggregated pools are compared with


# Each kind's service stub; every one of them answers GetStats.
_STUBS = {
    NodeKind.PREFILL: node_pb2_grpc.PrefillNodeStub,
    NodeKind.DECODE: node_pb2_grpc.DecodeNodeStub,
    NodeKind.COLOCATED: node_pb2_grpc.ColocatedNodeStub,
}


@dataclass(slots=True, eq=False)
class NodeEntry:
    node_id: str
    kind: NodeKind
    address: str
    static: bool
    stats: node_pb2.NodeStats | None = None
    stats_seq: int = 0
    last_seen: float = -math.inf
    suspect: bool = False  # failed a call and a probe; cleared by its next stats
    fingerprint: node_pb2.NodeFingerprint | None = None  # what it runs; None for a static node
    local_prefill: bool = False  # a decode node that also computes prompts itself (`--local-prefill`)
    serve_prefill: bool = False  # a decode node that is a prefill node too (`--serve-prefill`)
    draining: bool = False  # it is leaving: nothing new is placed on it (a drain, not a failure)
    # Set when this entry stops standing for a serving process: dropped (silent past the
    # heartbeat timeout), replaced by a new registration, or a static node gone silent.
    # Every call in flight on it moves elsewhere (pdserve/router/cluster/liveness.py).
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    gone_reason: str = ""

    def serves(self, kind: NodeKind) -> bool:
        """Is this node in `kind`'s pool? (A decode node with --serve-prefill is in two.)"""
        return self.kind is kind or (kind is NodeKind.PREFILL and self.serve_prefill)

    def candidate(self) -> Candidate:
        stats = self.stats or node_pb2.NodeStats()
        free = max(0, stats.num_blocks - stats.used_blocks)
        return Candidate(self.node_id, self.stats_seq, free, stats.queued_prefill_tokens, stats.placed_through)


class NodeRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        channel_close_grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        channel_factory: Callable[[str], grpc.aio.Channel] = reconnecting_channel,
    ) -> None:
        self._timeout_s = heartbeat_timeout_s
        self._close_grace_s = channel_close_grace_s
        self._clock = clock
        self._channel_factory = channel_factory
        self._nodes: dict[str, NodeEntry] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def add_static(self, kind: NodeKind, address: str) -> NodeEntry:
        entry = NodeEntry(f"static-{kind.value}-{address}", kind, address, static=True)
        self._nodes[entry.node_id] = entry
        return entry

    def admit(self, kind: NodeKind, address: str, node_id: str, fingerprint: node_pb2.NodeFingerprint,
              router: RouterFacts, local_prefill: bool = False, serve_prefill: bool = False) -> NodeEntry:
        """`register`, once the node's fingerprint agrees with the router's facts and with every
        other registered node's (the entries it replaces excepted); `NodeRefused` otherwise."""
        node_id = node_id or f"{kind.value}-{address}"
        others = [(e.node_id, e.fingerprint) for e in self._nodes.values()
                  if e.fingerprint is not None and e.node_id != node_id and e.address != address]
        lines = disagreements(fingerprint, router, others)
        if lines:
            log.warning("refused %s node %s at %s: %s", kind.value, node_id, address, "; ".join(lines))
            raise NodeRefused("; ".join(lines))
        return self.register(kind, address, node_id, fingerprint, local_prefill, serve_prefill)

    def register(self, kind: NodeKind, address: str, node_id: str,
                 fingerprint: node_pb2.NodeFingerprint | None = None, local_prefill: bool = False,
                 serve_prefill: bool = False) -> NodeEntry:
        """A node announced itself; it replaces any entry with its id or its address. Unchecked:
        the Registry service goes through `admit`."""
        node_id = node_id or f"{kind.value}-{address}"
        replaced = [e for e in self._nodes.values() if e.node_id == node_id or e.address == address]
        for other in replaced:
            del self._nodes[other.node_id]
            _mark_gone(other, f"{other.address} registered again (a new process)")
        static = any(e.static and e.address == address for e in replaced)  # keep polling it if it goes quiet
        entry = NodeEntry(node_id, kind, address, static, last_seen=self._clock(), fingerprint=fingerprint,
                          local_prefill=local_prefill or serve_prefill, serve_prefill=serve_prefill)
        # A fresh stats number, so placement forgets what it counted against the old entry.
        entry.stats_seq = max((e.stats_seq + 1 for e in replaced), default=0)
        self._nodes[node_id] = entry
        for other in replaced:
            self._release_channel(other.address)
        log.info("registered %s node %s at %s", kind.value, node_id, address)
        return entry

    def heartbeat(self, node_id: str, stats: node_pb2.NodeStats, draining: bool = False) -> bool:
        """Record a node's stats; False if the router does not know it (it must register again).
        `draining`: the node is leaving; from now on it is never live again."""
        entry = self._nodes.get(node_id)
        if entry is None:
            return False
        self._update(entry, stats)
        if draining and not entry.draining:
            entry.draining = True
            log.info("%s node %s at %s is draining: placing nothing new on it", entry.kind.value, node_id,
                     entry.address)
        return True

    def deregister(self, node_id: str, drained: bool) -> bool:
        """A node leaves. Not `drained` (its drain ran out of time): its entry is marked gone, so
        a call still open on it moves elsewhere. `drained` (it holds nothing): a watch on it stays
        quiet, since a decode stream it fed already has its KV and needs nothing more from it.
        False if it was not known."""
        entry = self._nodes.get(node_id)
        if entry is None:
            return False
        entry.draining = True  # a loss on it from here on is the drain's (pdserve/router/dispatch/driver.py)
        if not drained:
            _mark_gone(entry, f"{entry.address} left the cluster before its drain finished")
        self._drop(entry)
        log.info("%s node %s at %s left the cluster", entry.kind.value, node_id, entry.address)
        return True

    def live(self, kind: NodeKind) -> list[NodeEntry]:
        now = self._clock()
        return [e for e in self._nodes.values()
                if e.serves(kind) and not e.suspect and not e.draining and now - e.last_seen <= self._timeout_s]

    def draining(self, kind: NodeKind) -> list[NodeEntry]:
        """Nodes of `kind` that are leaving and still finish what they hold."""
        return [e for e in self._nodes.values() if e.serves(kind) and e.draining]

    def mark_suspect(self, entry: NodeEntry, reason: str) -> None:
        """Skip `entry` until its next stats: a call to it failed the way a dead node's does."""
        if self._nodes.get(entry.node_id) is not entry or entry.suspect:
            return
        entry.suspect = True
        log.warning("%s node %s at %s is suspect until it heartbeats again: %s", entry.kind.value, entry.node_id,
                    entry.address, reason)

    async def probe(self, entry: NodeEntry, timeout_s: float) -> bool:
        """Does a node whose call just failed still answer? If not, it is marked suspect."""
        try:
            await _STUBS[entry.kind](self.channel(entry)).GetStats(node_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self.mark_suspect(entry, f"GetStats failed: {exc.code().name}: {exc.details()}")
            return False
        return True

    def get(self, node_id: str) -> NodeEntry | None:
        return self._nodes.get(node_id)

    def expire(self) -> list[NodeEntry]:
        """Drop registered nodes silent for longer than the heartbeat timeout (a static node
        stays, to be polled, but its calls in flight move on too)."""
        now = self._clock()
        silent = [e for e in self._nodes.values() if now - e.last_seen > self._timeout_s and not e.gone.is_set()]
        for entry in silent:
            reason = f"{entry.address} was silent for {now - entry.last_seen:.1f}s (no heartbeat or stats)"
            _mark_gone(entry, reason)
            if entry.static:
                continue
            log.warning("dropping %s node %s: %s", entry.kind.value, entry.node_id, reason)
            self._drop(entry)
        return [e for e in silent if not e.static]

    def channel(self, entry: NodeEntry) -> grpc.aio.Channel:
        channel = self._channels.get(entry.address)
        if channel is None:
            channel = self._channels[entry.address] = self._channel_factory(entry.address)
        return channel

    async def poll_static(self, timeout_s: float) -> None:
        """Ask every static node for its stats; a node that answers is live again."""
        entries = [e for e in self._nodes.values() if e.static]
        await asyncio.gather(*(self._poll(e, timeout_s) for e in entries))

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        self._nodes.clear()
        await asyncio.gather(*(c.close() for c in channels), *self._closing, return_exceptions=True)

    async def _poll(self, entry: NodeEntry, timeout_s: float) -> None:
        try:
            stats = await _STUBS[entry.kind](self.channel(entry)).GetStats(node_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.debug("static %s node %s: GetStats failed: %s", entry.kind.value, entry.address, exc.code().name)
            return
        if self._nodes.get(entry.node_id) is entry:
            self._update(entry, stats)

    def _update(self, entry: NodeEntry, stats: node_pb2.NodeStats) -> None:
        if entry.gone.is_set():  # a static node heard from again: calls made from now on may wait on it
            entry.gone, entry.gone_reason = asyncio.Event(), ""
        entry.stats = stats
        entry.stats_seq += 1
        entry.last_seen = self._clock()
        entry.suspect = False

    def _drop(self, entry: NodeEntry) -> None:
        del self._nodes[entry.node_id]
        self._release_channel(entry.address)

    def _release_channel(self, address: str) -> None:
        if any(e.address == address for e in self._nodes.values()):
            return
        channel = self._channels.pop(address, None)
        if channel is None:
            return
        # Calls still in flight on it may finish (or fail on their own) within the grace.
        task = asyncio.get_running_loop().create_task(channel.close(grace=self._close_grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _mark_gone(entry: NodeEntry, reason: str) -> None:
    entry.gone_reason = reason
    entry.gone.set()
