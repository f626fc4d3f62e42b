"""`pdserve profile`'s serving-stack measurement: the router's, a node front's and a client's CPU
per request and per streamed token.

A real `pdserve cluster --colocated 1` on the model, started as users start it, and closed-loop
gRPC streams through its router: the same requests with few and then with many tokens each. The
router's process, the node's own process (its front: its engine core is a process of its own,
with its own CPU time) and this process (the client) are timed over each run, and the two runs
separate each one's two costs: CPU = per_request × requests + per_token × tokens.

The router is measured in the cluster, not behind fake nodes that answer at once (the router's
own benchmark, pdserve/bench/http_front.py): there the node events come back to back and a wakeup of its
event loop serves several, the cheapest a token can be; in a cluster they come as the engine
steps, which is what the planner predicts.

Everything measured shares one core — the node, its front, the router and the client — as the
stack shares the engines' cores in every layout a plan proposes (the router pinned to a pool's
cores, or floating over all). A process that shares its core pays more CPU for the same work
(its caches and its event loop's batching lost to the others). Measured on an AMX machine (bf16):
the router 193–229 µs a token with a core to itself, 266–287 sharing one; in a hybrid 1P1D pair
serving 21.6 and 33.8 requests/s, its router sharing the prefill node's core, 259–294.

Must never: be imported by the simulator (it starts processes and loads gRPC).
"""

from __future__ import annotations

import time

import uvloop

from pdserve.bench.common import local_cluster
from pdserve.bench.http_front import grpc_streams
from pdserve.common.affinity import available_cpus, threads_pinned_to
from pdserve.common.proc_stat import process_cpu_s
from pdserve.planner.profile import ClientCost, FrontCost, RouterCost, ServingCosts

REQUESTS_PER_STREAM = 8  # each run: this many requests per stream in flight, at least 64 in all
CONCURRENCY = 8
FEW_TOKENS, MANY_TOKENS = 2, 32


def measure_stack_cost(model_dir: str, concurrency: int = CONCURRENCY, stream_interval: int = 1) -> ServingCosts:
    """`concurrency`: the streams at once (docs/benchmarks.md compares 8, 32 and 64);
    `stream_interval`: the router's `--stream-interval` (tokens per response: fewer messages, each
    dearer, for every process measured)."""
    core = min(available_cpus())
    router_args = ("--router-args", f"--stream-interval {stream_interval}") if stream_interval != 1 else ()
    with (local_cluster(model_dir, ("--colocated", "1"), ("--threads", "1"),
                        ("--colocated-cores", str(core), "--router-cores", str(core), *router_args)) as cluster,
          threads_pinned_to({core})):
        children = cluster.state.children.values()
        node = next(child.pid for child in children if child.kind == "colocated")
        router = next(child.pid for child in children if child.kind == "router")

        def cpu_now() -> tuple[float, float, float]:
            return process_cpu_s(router), process_cpu_s(node), time.process_time()

        uvloop.run(grpc_streams(cluster.router, concurrency, FEW_TOKENS, concurrency))  # warm-up
        requests = max(64, REQUESTS_PER_STREAM * concurrency)
        runs: list[list[tuple[int, float]]] = [[], [], []]  # router, front, client
        for tokens in (FEW_TOKENS, MANY_TOKENS):
            before = cpu_now()
            streamed = uvloop.run(grpc_streams(cluster.router, requests, tokens, concurrency))
            for points, start, end in zip(runs, before, cpu_now()):
                points.append((streamed, end - start))
    method = f"closed-loop gRPC streams through a colocated cluster, {concurrency} at once, all on one core"
    if stream_interval != 1:
        method += f", stream interval {stream_interval}"
    kinds = ((RouterCost, "the router's process"), (FrontCost, "a node's front process"), (ClientCost, "the client"))
    return ServingCosts(*(kind(*per_request_and_token(points, requests), f"{process}, {method}")
                          for (kind, process), points in zip(kinds, runs)))


def per_request_and_token(points: list[tuple[int, float]], requests: int) -> tuple[float, float]:
    """(per request, per token) CPU seconds from two runs of `requests` requests each,
    (tokens streamed, CPU seconds) with few and with many tokens."""
    (few, cpu_few), (many, cpu_many) = points
    per_token = max((cpu_many - cpu_few) / (many - few), 0.0)
    return max((cpu_few - per_token * few) / requests, 0.0), per_token
