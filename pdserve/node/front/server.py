"""Running one node: core process + gRPC front + registration, until a signal.

`run_node(argv, kind)` is the body of `pdserve prefill|decode|colocated`, for one `NodeKind` (a
row of pdserve/node_kinds.py: policy, KV stages, whether it computes its own prompts, services):
parse the flags, check that its ports are free (`--port`, `--metrics-port`, `--kv-port`: a busy
one is one line naming the flag, exit status 2, before anything slow), pin the process to
`--cpus` (pdserve/common/affinity.py), serve Prometheus `/metrics` and `/health` when `--metrics-port`
is set (pdserve/node/front/metrics.py; from the start, so /health answers 503 while the model loads), bind
gRPC on `host:port`, start the engine core (and wait for its model and KV cache), serve gRPC
(port 0: the OS picks; the line `pdserve <kind> node listening on HOST:PORT` on stdout says
which), register with the router and heartbeat, then on SIGINT (or a dead core) stop the server,
the core and the registration, and the metrics endpoint last. SIGTERM drains first
(pdserve/node/front/drain.py: leave placement, finish what the node holds within `--drain-timeout-s`,
deregister), then stops the same way. Exit status: 130 after Ctrl-C, 0 after SIGTERM, 1 when
the core died or failed to start. A refusal
(`Refused`: the core cannot serve the model folder, or the router refused the node's
fingerprint) stops the node the same way, then prints its one line and exits with its code.

Must never: bind anything but the configured hosts (--host, and --kv-host for the KV
transport: 127.0.0.1 by default), or exit leaving the core process running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import uvloop

from pdserve.common.auth import server_interceptors, server_options
from pdserve.common.grpc_standard import StandardServices
from pdserve.common.lifecycle import ExitStatus, StopSignals, supervisor_of
from pdserve.common.metrics_endpoint import MetricsEndpoint
from pdserve.common.ports import Listen, PortUnavailable, check_free, unavailable
from pdserve.common.refusal import Refused
from pdserve.common.tls import add_port
from pdserve.common.affinity import pin_to_cpus
from pdserve.node.front.client import CoreClient
from pdserve.node.config import NodeConfig, parse_node_args
from pdserve.node.core.core_part import CorePart
from pdserve.node.errors import NodeError
from pdserve.node.front.drain import drain
from pdserve.node.front.metrics import NodeHealth, serve_node_metrics
from pdserve.node.front.registration import RouterLink
from pdserve.proto import node_pb2, node_pb2_grpc

if TYPE_CHECKING:
    from pdserve.engine.policy import SchedulingPolicy

logger = logging.getLogger(__name__)

Servicer = Callable[[CoreClient], object]  # a servicer class of pdserve/node/front/servicers.py or a kind's front


@dataclass(frozen=True)
class NodeOption:
    """What a node flag adds to its kind: KV stages, gRPC services, prompts of its own."""

    flag: str  # the NodeConfig field (a bool) that turns it on
    stages: tuple[str, ...] = ()
    services: dict[str, Servicer] = field(default_factory=dict)
    own_prompts: bool = False

    def on(self, config: NodeConfig) -> bool:
        return bool(getattr(config, self.flag))


@dataclass(frozen=True)
class NodeKind:
    """A kind of node: its engine's policy, its node core's KV stages, and its gRPC services,
    each with what the options its flags turn on add."""

    name: str
    policy: type[SchedulingPolicy]
    stages: tuple[str, ...]  # CorePart.stages: "module:function" factories
    own_prompts: bool  # does its node core compute prompts of its own (without options)?
    services: dict[str, Servicer]  # node.proto service name -> servicer
    options: tuple[NodeOption, ...] = ()

    def core_part(self, config: NodeConfig) -> CorePart:
        on = self._options_on(config)
        stages = (*self.stages, *(stage for option in on for stage in option.stages))
        return CorePart(self.policy, stages, self.own_prompts or any(option.own_prompts for option in on))

    def services_for(self, config: NodeConfig) -> dict[str, Servicer]:
        services = dict(self.services)
        for option in self._options_on(config):
            services.update(option.services)
        return services

    def _options_on(self, config: NodeConfig) -> list[NodeOption]:
        return [option for option in self.options if option.on(config)]


def run_node(argv: list[str] | None, kind: NodeKind) -> int:
    config = parse_node_args(argv, kind.name, os.environ)
    part = kind.core_part(config)
    try:
        for listen in _listens(config, part):  # before anything slow: a busy port fails at once
            check_free(listen)
        pin_to_cpus(config.cpus)  # first: every thread and child of this process inherits it
    except (PortUnavailable, ValueError) as exc:  # ValueError: --cpus names a core not usable here
        return _usage_error(kind.name, exc)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {kind.name}-node %(levelname)s %(message)s")
    try:
        return uvloop.run(serve_node(config, part, kind.services_for(config)))
    except PortUnavailable as exc:  # taken between the check and the bind
        return _usage_error(kind.name, exc)
    except Refused as exc:  # printed once everything has stopped, so it is the node's last line
        print(f"pdserve {kind.name}: {exc.cli_message()}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C while the engine core starts: serve_node has stopped it
        return ExitStatus.INTERRUPTED


def _usage_error(kind: str, exc: Exception) -> ExitStatus:
    print(f"pdserve {kind}: {exc}", file=sys.stderr)
    return ExitStatus.USAGE


async def serve_node(config: NodeConfig, part: CorePart, services: dict[str, Servicer]) -> int:
    client = CoreClient(config, part)
    health = NodeHealth(config.kind, client.core_alive)
    server: grpc.aio.Server | None = None
    standard: StandardServices | None = None
    registration: asyncio.Task | None = None
    link: RouterLink | None = None
    metrics: MetricsEndpoint | None = None
    try:
        metrics = _start_metrics(config, client, health)
        server = grpc.aio.server(interceptors=server_interceptors(config.auth_token),
                                 options=server_options(config.max_message_bytes))
        for name, servicer in services.items():
            getattr(node_pb2_grpc, f"add_{name}Servicer_to_server")(servicer(client), server)
        # What reflection lists and Health reports on, by full name.
        full_names = tuple(node_pb2.DESCRIPTOR.services_by_name[name].full_name for name in services)
        standard = StandardServices(server, full_names, lambda: health().serving)
        port = _bind(server, config)  # before the core loads the model: the port is ours from here
        await standard.refresh()  # NOT_SERVING until the engine core runs (grpc's default says SERVING)
        await client.start()
        await server.start()
        address = f"{config.host}:{port}"
        health.serving(address)
        await standard.start()  # grpc.health.v1 follows /health: SERVING while the engine core runs
        signals = StopSignals()
        signals.install(asyncio.get_running_loop(), supervisor_of(os.environ))
        print(f"pdserve {config.kind} node listening on {address}", flush=True)
        link = RouterLink(config, address, client.latest_stats, client.fingerprint)
        registration = asyncio.create_task(link.run())
        await _until_stopped(signals, client, registration)
        if registration.done():
            registration.result()  # it ends by itself only when the router refused the node: raises
        if signals.drain and not client.dead.is_set():
            health.draining()
            await standard.refresh()
            await drain(client, link, config.drain_timeout_s, config.drain_poll_s)
        return ExitStatus.FAILED if client.dead.is_set() else signals.exit_status
    except NodeError as exc:
        logger.error("%s", exc.message)
        return ExitStatus.FAILED
    finally:
        health.stopping()
        start = time.monotonic()
        if standard is not None:
            await standard.stop()
        if registration is not None:
            registration.cancel()
        if link is not None:
            await link.close()
        if server is not None:
            await server.stop(config.grace_s)
        logger.info("gRPC server stopped in %.2fs", time.monotonic() - start)
        await client.close()
        logger.info("%s node stopped in %.2fs", config.kind, time.monotonic() - start)
        if metrics is not None:  # last: /health answers "stopping" until the node is gone
            metrics.stop()


def _listens(config: NodeConfig, part: CorePart) -> list[Listen]:
    """The node's ports, named by their flags, each on the address it binds."""
    listens = [Listen("--port", config.host, config.port)]
    if config.metrics_port is not None:
        listens.append(Listen("--metrics-port", config.host, config.metrics_port))
    if part.uses_kv_transport:
        listens.append(Listen("--kv-port", config.transfer.host, config.transfer.port))
    return listens


def _start_metrics(config: NodeConfig, client: CoreClient, health: NodeHealth) -> MetricsEndpoint | None:
    if config.metrics_port is None:
        return None
    metrics = serve_node_metrics(config.host, config.metrics_port, client.latest_stats, health)
    print(f"pdserve {config.kind} node metrics on {metrics.url}", flush=True)
    return metrics


def _bind(server: grpc.aio.Server, config: NodeConfig) -> int:
    try:
        return add_port(server, f"{config.host}:{config.port}", config.tls)
    except RuntimeError:  # gRPC says only that it failed
        raise unavailable(Listen("--port", config.host, config.port)) from None


async def _until_stopped(signals: StopSignals, client: CoreClient, registration: asyncio.Task) -> None:
    waiters = [asyncio.create_task(signals.event.wait()), asyncio.create_task(client.dead.wait())]
    try:
        await asyncio.wait([*waiters, registration], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
