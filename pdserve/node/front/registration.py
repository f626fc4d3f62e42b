"""Registration with the router: Register once, then Heartbeat with NodeStats.

The router's `Registry` learns the node's real `host:port`, kind, id and fingerprint (the
model, dtype, block size and KV layout its engine core runs), then gets a
heartbeat every `heartbeat_interval_s` (or the interval the router asks for) carrying
the node's `NodeStats`: the latest snapshot the engine core pushed, never a fresh query,
so a core busy in a multi-second step cannot make a live node miss its heartbeats (a
dead core is the front's to notice: it shuts the node down). The node registers once
the core has sent its first snapshot. A heartbeat answered `known=false` (the router restarted or
timed the node out) makes the node register again, and only that: a heartbeat that fails
(a slow router, a lost connection) does not, since the router replaces the entry of a node
that registers again and ends the streams it had on it. While the router is unreachable the
task keeps retrying quietly (debug logs, one info line per outage). A router that refuses
the node's fingerprint (FAILED_PRECONDITION: e.g. another block size than the router's) would
refuse it again on every retry, so the task ends with `RegistrationRefused`, whose one line
the node prints before it exits with `EXIT_REFUSED` (which the local launcher never restarts).

A draining node (SIGTERM; pdserve/node/front/drain.py) says so at once (`drain`: a heartbeat with
`draining`, sent then and on every beat after, so the router places nothing new on it while
it finishes what it holds) and registers no more; once it holds nothing it `leave`s (Deregister).
Both are best effort within `registry_rpc_timeout_s`: a router that cannot be reached then
forgets the node by its heartbeat timeout, and finds nothing on it.

Must never: stop retrying an unreachable router while the node is up, hold the node's startup
hostage, or wait on the engine core.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.common.channels import reconnecting_channel
from pdserve.common.refusal import EXIT_REFUSED, Refused
from pdserve.node.config import NodeConfig
from pdserve.node.front.convert import stats_to_proto
from pdserve.node.messages import StatsData
from pdserve.proto import node_pb2, node_pb2_grpc

logger = logging.getLogger(__name__)
FIRST_SNAPSHOT_POLL_S = 0.02  # how soon a node with no stats yet looks again

LatestStats = Callable[[], StatsData | None]


class RegistrationRefused(Refused):
    """The router refused this node's fingerprint; its message names each field and both values."""

    exit_code = EXIT_REFUSED


class _Registration:
    def __init__(self, config: NodeConfig, address: str, latest_stats: LatestStats,
                 fingerprint: dict[str, object], stub: node_pb2_grpc.RegistryStub) -> None:
        self.config = config
        self.address = address
        self.node_id = config.resolved_node_id(address)
        self.latest_stats = latest_stats
        self.fingerprint = node_pb2.NodeFingerprint(**fingerprint)
        self.stub = stub
        self.interval_s = config.heartbeat_interval_s
        self.registered = False
        self.reachable = True
        self.draining = False

    async def beat(self) -> None:
        """Register if needed, then one heartbeat (neither before the core's first snapshot; a
        draining node never registers again)."""
        latest = self.latest_stats()
        if latest is None or (self.draining and not self.registered):
            return
        timeout = self.config.registry_rpc_timeout_s
        if not self.registered:
            reply = await self._register(timeout)
            self.interval_s = reply.heartbeat_interval_ms / 1000 or self.config.heartbeat_interval_s
            self.registered = True
            logger.info("registered %s node %s (%s) with the router at %s", self.config.kind, self.node_id,
                        self.address, self.config.router)
        stats = stats_to_proto(latest)
        reply = await self.stub.Heartbeat(node_pb2.HeartbeatRequest(node_id=self.node_id, stats=stats,
                                                                    draining=self.draining), timeout=timeout)
        self.reachable = True
        if not reply.known:
            logger.info("the router forgot node %s; registering again", self.node_id)
            self.registered = False

    def next_beat_in(self) -> float:
        """The heartbeat interval; shorter while the core's first snapshot is still to come, so a
        node registers as soon as it has one (it comes moments after the core starts)."""
        return self.interval_s if self.latest_stats() is not None else FIRST_SNAPSHOT_POLL_S

    async def _register(self, timeout: float) -> node_pb2.RegisterResponse:
        request = node_pb2.RegisterRequest(kind=self.config.kind, address=self.address, node_id=self.node_id,
                                           fingerprint=self.fingerprint,
                                           local_prefill=self.config.local_prefill or self.config.serve_prefill,
                                           serve_prefill=self.config.serve_prefill)
        try:
            return await self.stub.Register(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                raise RegistrationRefused(f"the router at {self.config.router} refused this node: "
                                          f"{exc.details()}") from exc
            raise

    def failed(self, exc: Exception) -> None:
        # Still registered: a heartbeat lost to a slow router or network says nothing of
        # whether the router forgot us (the next answered one does: `known`). Registering
        # again would replace the router's entry and end every stream it runs here.
        if self.reachable:
            logger.info("router %s unreachable; retrying quietly (%s)", self.config.router, _short(exc))
        else:
            logger.debug("router %s still unreachable: %s", self.config.router, _short(exc))
        self.reachable = False


    async def drain(self) -> None:
        """From now on every heartbeat says `draining`; one goes at once."""
        self.draining = True
        try:
            await self.beat()
        except grpc.aio.AioRpcError as exc:
            self.failed(exc)

    async def leave(self, drained: bool) -> None:
        """Deregister: `drained`, the node holds nothing; otherwise its drain ran out of time."""
        if not self.registered:
            return
        try:
            await self.stub.Deregister(node_pb2.DeregisterRequest(node_id=self.node_id, drained=drained),
                                       timeout=self.config.registry_rpc_timeout_s)
            logger.info("left the router at %s", self.config.router)
        except grpc.aio.AioRpcError as exc:
            logger.info("could not deregister from the router at %s (%s); it forgets this node by its heartbeat "
                        "timeout", self.config.router, _short(exc))
        self.registered = False


class RouterLink:
    """The node's registration, for its life: `run` heartbeats until cancelled (or refused),
    `drain` and `leave` are what a SIGTERM adds. One channel to the router for all three."""

    def __init__(self, config: NodeConfig, address: str, latest_stats: LatestStats,
                 fingerprint: dict[str, object]) -> None:
        """`latest_stats` is the front's cached snapshot (`CoreClient.latest_stats`), `fingerprint`
        its core's KV fingerprint (`CoreClient.fingerprint`, KVCacheSpec.fingerprint())."""
        # Reconnects to a router that comes up late (or restarts) within about a second.
        self._channel = reconnecting_channel(config.router, config.auth_token, config.tls)
        self._registration = _Registration(config, address, latest_stats, fingerprint,
                                           node_pb2_grpc.RegistryStub(self._channel))

    async def run(self) -> None:
        """Runs until cancelled, or until the router refuses the node (`RegistrationRefused`)."""
        registration = self._registration
        while True:
            try:
                await registration.beat()
            except grpc.aio.AioRpcError as exc:
                registration.failed(exc)
            await asyncio.sleep(registration.next_beat_in())

    async def drain(self) -> None:
        await self._registration.drain()

    async def leave(self, drained: bool) -> None:
        await self._registration.leave(drained)

    async def close(self) -> None:
        await self._channel.close()


async def run_registration(config: NodeConfig, address: str, latest_stats: LatestStats,
                           fingerprint: dict[str, object]) -> None:
    """`RouterLink.run` on a link of its own, closed at the end."""
    link = RouterLink(config, address, latest_stats, fingerprint)
    try:
        await link.run()
    finally:
        await link.close()


def _short(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
