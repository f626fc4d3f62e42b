"""`pdserve profile`'s router measurement: the router's CPU per request and per streamed token.

The serving bench's router-cost setup (bench/http_front.py): a real `pdserve router` process on
the model folder behind fake nodes that answer at once (pdserve.testing.serve_fakes), so the router is the
only work, driven by closed-loop gRPC streams. Two runs of the same requests with few and with
many tokens each separate the two costs: CPU = per_request × requests + per_token × tokens.

Must never: be imported by the simulator (it starts processes and loads gRPC).
"""

from __future__ import annotations

import uvloop

from pdserve.bench.http_front import grpc_streams, process_cpu_s, start_fake_nodes, start_router
from pdserve.planner.profile import RouterCost

REQUESTS = 128
CONCURRENCY = 8
FEW_TOKENS, MANY_TOKENS = 4, 64


def measure_router_cost(model_dir: str) -> RouterCost:
    from pathlib import Path

    router = start_router(Path(model_dir))
    nodes = start_fake_nodes(router, Path(model_dir))
    try:
        uvloop.run(grpc_streams(router.grpc_address, CONCURRENCY, FEW_TOKENS, CONCURRENCY))  # warm-up
        points = []
        for tokens in (FEW_TOKENS, MANY_TOKENS):
            before = process_cpu_s(router.process.pid)
            streamed = uvloop.run(grpc_streams(router.grpc_address, REQUESTS, tokens, CONCURRENCY))
            points.append((streamed, process_cpu_s(router.process.pid) - before))
    finally:
        for process in (nodes, router.process):
            process.terminate()
            process.wait(timeout=30)
    return RouterCost(*per_request_and_token(points, REQUESTS), "router CPU behind fake nodes, gRPC streams")


def per_request_and_token(points: list[tuple[int, float]], requests: int) -> tuple[float, float]:
    """(per request, per token) CPU seconds from two runs of `requests` requests each,
    (tokens streamed, CPU seconds) with few and with many tokens."""
    (few, cpu_few), (many, cpu_many) = points
    per_token = max((cpu_many - cpu_few) / (many - few), 0.0)
    return max((cpu_few - per_token * few) / requests, 0.0), per_token
