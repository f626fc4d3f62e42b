"""`pdserve profile`'s node-front and client measurement: CPU per request and per streamed token.

A real `pdserve cluster --colocated 1` on the model, started as users start it, and closed-loop
gRPC streams through its router: the same requests with few and then with many tokens each. The
node's own process is its front (its engine core is a process of its own, with its own CPU time)
and this process is the client, so the two runs separate each one's two costs as
planner/measure_router.py does the router's: CPU = per_request × requests + per_token × tokens.

Must never: be imported by the simulator (it starts processes and loads gRPC).
"""

from __future__ import annotations

import time

import uvloop

from pdserve.bench.common import local_cluster
from pdserve.bench.http_front import grpc_streams, process_cpu_s
from pdserve.planner.measure_router import per_request_and_token
from pdserve.planner.profile import ClientCost, FrontCost

REQUESTS = 64
CONCURRENCY = 8
FEW_TOKENS, MANY_TOKENS = 2, 32


def measure_stack_cost(model_dir: str) -> tuple[FrontCost, ClientCost]:
    with local_cluster(model_dir, ("--colocated", "1"), ("--threads", "1")) as cluster:
        node = next(child for child in cluster.state.children.values() if child.kind == "colocated")
        uvloop.run(grpc_streams(cluster.router, CONCURRENCY, FEW_TOKENS, CONCURRENCY))  # warm-up
        front, client = [], []
        for tokens in (FEW_TOKENS, MANY_TOKENS):
            node_before, own_before = process_cpu_s(node.pid), time.process_time()
            streamed = uvloop.run(grpc_streams(cluster.router, REQUESTS, tokens, CONCURRENCY))
            front.append((streamed, process_cpu_s(node.pid) - node_before))
            client.append((streamed, time.process_time() - own_before))
    return (FrontCost(*per_request_and_token(front, REQUESTS), "a colocated node's front process, gRPC streams"),
            ClientCost(*per_request_and_token(client, REQUESTS), "a closed-loop gRPC streaming client"))
