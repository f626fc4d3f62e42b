"""Running one node: core process + gRPC front + registration, until a signal.

`run_node(argv, kind, part, add_servicer)` is the body of `pdserve prefill|decode|colocated`:
parse the flags, pin the process to `--cpus` (node/affinity.py), start the engine core (and wait for its model and KV cache), serve
gRPC on `host:port` (port 0: the OS picks; the line `pdserve <kind> node listening on
HOST:PORT` on stdout says which), serve Prometheus `/metrics` when `--metrics-port` is
set (node/metrics.py), register with the router and heartbeat, then on
SIGINT/SIGTERM (or a dead core) stop the server, the core and the registration. A refusal
(`Refused`: the core cannot serve the model folder, or the router refused the node's
fingerprint) stops the node the same way, then prints its one line and exits with its code.

Must never: bind anything but the configured host (127.0.0.1 by default), or exit
leaving the core process running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import grpc
import uvloop

from pdserve.common.auth import server_interceptors, server_options
from pdserve.common.metrics_endpoint import MetricsEndpoint
from pdserve.common.refusal import Refused
from pdserve.node.affinity import pin_to_cpus
from pdserve.node.client import CoreClient
from pdserve.node.config import NodeConfig, parse_node_args
from pdserve.node.core_part import CorePart
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.metrics import serve_node_metrics
from pdserve.node.registration import run_registration

logger = logging.getLogger(__name__)

AddServicer = Callable[[grpc.aio.Server, CoreClient], None]


def run_node(argv: list[str] | None, kind: str, part: CorePart, add_servicer: AddServicer) -> int:
    config = parse_node_args(argv, kind, os.environ)
    try:
        pin_to_cpus(config.cpus)  # first: every thread and child of this process inherits it
    except ValueError as exc:
        print(f"pdserve {kind}: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {kind}-node %(levelname)s %(message)s")
    try:
        return uvloop.run(serve_node(config, part, add_servicer))
    except Refused as exc:  # printed once everything has stopped, so it is the node's last line
        print(f"pdserve {kind}: {exc.cli_message()}", file=sys.stderr, flush=True)
        return exc.exit_code


async def serve_node(config: NodeConfig, part: CorePart, add_servicer: AddServicer) -> int:
    client = CoreClient(config, part)
    server: grpc.aio.Server | None = None
    registration: asyncio.Task | None = None
    metrics: MetricsEndpoint | None = None
    try:
        await client.start()
        server = grpc.aio.server(interceptors=server_interceptors(config.auth_token),
                                 options=server_options(config.max_message_bytes))
        add_servicer(server, client)
        port = _bind(server, config)
        await server.start()
        metrics = _start_metrics(config, client)
        address = f"{config.host}:{port}"
        print(f"pdserve {config.kind} node listening on {address}", flush=True)
        registration = asyncio.create_task(run_registration(config, address, client.latest_stats,
                                                            client.fingerprint))
        await _until_stopped(client, registration)
        if registration.done():
            registration.result()  # it ends by itself only when the router refused the node: raises
        return 1 if client.dead.is_set() else 0
    except NodeError as exc:
        logger.error("%s", exc.message)
        return 1
    finally:
        start = time.monotonic()
        if registration is not None:
            registration.cancel()
        if metrics is not None:
            metrics.stop()
        if server is not None:
            await server.stop(config.grace_s)
        logger.info("gRPC server stopped in %.2fs", time.monotonic() - start)
        await client.close()
        logger.info("%s node stopped in %.2fs", config.kind, time.monotonic() - start)


def _start_metrics(config: NodeConfig, client: CoreClient) -> MetricsEndpoint | None:
    if config.metrics_port is None:
        return None
    metrics = serve_node_metrics(config.host, config.metrics_port, client.latest_stats)
    print(f"pdserve {config.kind} node metrics on {metrics.url}", flush=True)
    return metrics


def _bind(server: grpc.aio.Server, config: NodeConfig) -> int:
    try:
        return server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise NodeError(ErrorCode.UNAVAILABLE, f"cannot listen on {config.host}:{config.port}: {exc}") from exc


async def _until_stopped(client: CoreClient, registration: asyncio.Task) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(client.dead.wait())]
    try:
        await asyncio.wait([*waiters, registration], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
