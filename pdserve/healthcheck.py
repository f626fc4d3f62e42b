"""One-shot health probes of a pdserve router or node, for container healthchecks and the launcher.

Owns: asking the standard `grpc.health.v1.Health` service (what Kubernetes probes and
grpc_health_probe ask: SERVING for the router's `Generation`, or for the node kind's service),
then, for the one-line reason, a router's `Generation.Health` (node counts, checked against the
`--min-*` bounds) or a node's `GetStats` — each with a deadline and the auth token when one is
configured — and the verdict (healthy or not, with a one-line reason). `python -m pdserve.healthcheck ADDR` exits 0 when healthy and 1 otherwise,
printing that line.

Must never: retry, wait longer than its timeout, or change anything on the probed server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.auth import add_auth_args, token_or_usage_error
from pdserve.common.channels import probe_channel
from pdserve.common.tls import TlsConfig, add_tls_args, tls_or_usage_error
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

T = TypeVar("T")
SERVICES = ("router", "prefill", "decode", "colocated")
# Each node kind's service stub; every one of them answers GetStats.
_NODE_STUBS = {
    "prefill": node_pb2_grpc.PrefillNodeStub,
    "decode": node_pb2_grpc.DecodeNodeStub,
    "colocated": node_pb2_grpc.ColocatedNodeStub,
}
# The service each probe asks grpc.health.v1 about (the router's public API, each node's own).
_STANDARD_NAMES = {
    "router": pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    **{kind: node_pb2.DESCRIPTOR.services_by_name[f"{kind.capitalize()}Node"].full_name for kind in _NODE_STUBS},
}
# Codes meaning nothing answered (not listening yet, gone, or hung) rather than a refusal.
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class HealthcheckConfig:
    """Defaults of the probe, in one place."""

    timeout_s: float = 2.0
    # A router is healthy once it serves with at least this many nodes of each kind.
    min_prefill: int = 1
    min_decode: int = 1
    min_colocated: int = 0  # a colocated cluster (`pdserve cluster --colocated N`) asks for N and 0, 0 above
    auth_token: str | None = field(default=None, repr=False)  # None: the servers require none
    tls: TlsConfig | None = None  # None: plaintext (pdserve/common/tls.py)


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reason: str
    reachable: bool = True  # False: no answer at all (not listening yet, or gone)


async def _router_health(addr: str, timeout_s: float, token: str | None,
                         tls: TlsConfig | None) -> pdserve_pb2.HealthResponse:
    async with probe_channel(addr, token, tls) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return await stub.Health(pdserve_pb2.HealthRequest(), timeout=timeout_s)


async def _node_stats(addr: str, kind: str, timeout_s: float, token: str | None,
                      tls: TlsConfig | None) -> node_pb2.NodeStats:
    async with probe_channel(addr, token, tls) as channel:
        return await _NODE_STUBS[kind](channel).GetStats(node_pb2.StatsRequest(), timeout=timeout_s)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    # asyncio.Runner: Python 3.11's asyncio.run takes no loop_factory.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def router_health(addr: str, timeout_s: float = HealthcheckConfig.timeout_s,
                  token: str | None = None, tls: TlsConfig | None = None) -> pdserve_pb2.HealthResponse:
    """The router's Health answer; raises grpc.RpcError when it does not answer in time."""
    return _run(_router_health(addr, timeout_s, token, tls))


def node_stats(addr: str, kind: str, timeout_s: float = HealthcheckConfig.timeout_s,
               token: str | None = None, tls: TlsConfig | None = None) -> node_pb2.NodeStats:
    """A node's NodeStats; raises grpc.RpcError when it does not answer in time."""
    if kind not in _NODE_STUBS:
        raise ValueError(f"node kind must be one of {', '.join(_NODE_STUBS)}, got {kind!r}")
    return _run(_node_stats(addr, kind, timeout_s, token, tls))


async def _standard_status(addr: str, service: str, timeout_s: float, token: str | None,
                           tls: TlsConfig | None) -> int:
    async with probe_channel(addr, token, tls) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return (await health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s)).status


def standard_status(addr: str, service: str, timeout_s: float = HealthcheckConfig.timeout_s,
                    token: str | None = None, tls: TlsConfig | None = None) -> int:
    """`grpc.health.v1` status of `service` at `addr`; raises grpc.RpcError when it does not answer."""
    return _run(_standard_status(addr, service, timeout_s, token, tls))


def check(addr: str, service: str, config: HealthcheckConfig = HealthcheckConfig()) -> Verdict:
    """Probe `addr` as `service` once; never raises for an unreachable or unhealthy server."""
    deadline = time.monotonic() + config.timeout_s  # both calls together, within the timeout

    def remaining() -> float:
        return max(0.001, deadline - time.monotonic())

    try:
        status = standard_status(addr, _STANDARD_NAMES[service], remaining(), config.auth_token, config.tls)
        if status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            return Verdict(False, f"{service} at {addr}: {_STANDARD_NAMES[service]} is {name}")
        if service == "router":
            return _judge_router(router_health(addr, remaining(), config.auth_token, config.tls), config)
        stats = node_stats(addr, service, remaining(), config.auth_token, config.tls)
    except grpc.RpcError as err:
        detail = f"{service} at {addr}: {err.code().name} {err.details() or ''}".rstrip()
        return Verdict(False, detail, reachable=err.code() not in _NO_ANSWER)
    if stats.kind != service:
        return Verdict(False, f"{addr} is a {stats.kind or 'unknown'} node, not {service}")
    return Verdict(True, f"{service} at {addr}: {stats.used_blocks}/{stats.num_blocks} blocks used, "
                         f"{stats.num_running} running, {stats.num_waiting} waiting")


def _judge_router(health: pdserve_pb2.HealthResponse, config: HealthcheckConfig) -> Verdict:
    counts = f"{health.prefill_nodes} prefill, {health.decode_nodes} decode, {health.colocated_nodes} colocated"
    if not health.serving:
        return Verdict(False, f"router not serving ({counts})")
    if (health.prefill_nodes < config.min_prefill or health.decode_nodes < config.min_decode
            or health.colocated_nodes < config.min_colocated):
        return Verdict(False, f"router serving with too few nodes ({counts}; want at least "
                              f"{config.min_prefill} prefill, {config.min_decode} decode, "
                              f"{config.min_colocated} colocated)")
    return Verdict(True, f"router serving ({counts})")


def _parser() -> argparse.ArgumentParser:
    defaults = HealthcheckConfig()
    parser = argparse.ArgumentParser(prog="python -m pdserve.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("addr", help="HOST:PORT of the router or node")
    parser.add_argument("--service", choices=SERVICES, default="router")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    parser.add_argument("--min-prefill", type=int, default=defaults.min_prefill)
    parser.add_argument("--min-decode", type=int, default=defaults.min_decode)
    parser.add_argument("--min-colocated", type=int, default=defaults.min_colocated,
                        help="a colocated cluster: e.g. --min-colocated 1 --min-prefill 0 --min-decode 0")
    add_auth_args(parser)
    add_tls_args(parser, server=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    token = token_or_usage_error(parser, args.auth_token_file, os.environ)
    config = HealthcheckConfig(timeout_s=args.timeout_s, min_prefill=args.min_prefill, min_decode=args.min_decode,
                               min_colocated=args.min_colocated, auth_token=token,
                               tls=tls_or_usage_error(parser, args, server=False))
    verdict = check(args.addr, args.service, config)
    print(("healthy: " if verdict.healthy else "unhealthy: ") + verdict.reason)
    return 0 if verdict.healthy else 1


if __name__ == "__main__":
    sys.exit(main())
