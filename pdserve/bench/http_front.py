"""The OpenAI HTTP front against gRPC on the same router: client latency and the router's CPU per token.

    python -m pdserve.bench.http_front [--rounds 3] [--requests 8] [--tokens 32]
                                       [--cost-requests 200] [--cost-tokens 64] [--concurrency 8]
                                       [--stream-interval K ...]

1. latency: a local 1P1D cluster of the demo-shaped model (`pdserve cluster`, both APIs on one
   router). `--rounds` times, the same seeded requests go through gRPC and then through HTTP
   (`pdserve bench serve`'s two backends, one request in flight at a time), and the TTFT and
   inter-token-latency p50 of each API are printed with their difference. The goal is HTTP
   within 2 ms of gRPC at p50.
2. router cost: `pdserve router` alone, behind fake nodes that answer at once
   (pdserve/testing/serve_fakes.py), so the router is all the work there is. `--concurrency` closed-loop
   streams of `--cost-tokens` tokens each, first over gRPC, then over HTTP; the router process's
   CPU time (/proc) over the tokens streamed is the cost of one token through each API. The goal
   is at most 100 µs per token through HTTP. One run per `--stream-interval` K given: the router
   runs with `--stream-interval K` and the fake decode node sends the request's tokens as a real
   node front does at that interval (pdserve/node/front/inbox.py: one token per event at 1, the default,
   about K per event otherwise); each K's figures are printed under its own label, K = 1 first.
Prints the CPU capability it ran on; absolute numbers depend on this shared, noisy machine,
the differences and ratios between the two APIs of one run are what to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import torch
import uvloop

from pdserve.bench.common import ensure_model, local_cluster
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.openai_backend import OpenAIBackend
from pdserve.bench.serve.runner import RunLength, ServeBench
from pdserve.bench.serve.workloads import FixedLengths, SyntheticWorkload
from pdserve.common.proc_stat import process_cpu_s
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import until

PROMPT_LEN = 64
LATENCY_RATE = 1.0  # requests/s: one at a time, so the APIs are compared unloaded


# -- 1. latency on a real cluster --------------------------------------------------------------
def measure_latency(args: argparse.Namespace) -> dict:
    model_dir = ensure_model("llama", "small", "float32")
    per_api: dict[str, dict[str, list[float]]] = {"grpc": {"ttft": [], "itl": []}, "http": {"ttft": [], "itl": []}}
    with local_cluster(model_dir, ("--prefill", "1", "--decode", "1"), ("--threads", "1")) as cluster:
        options = ClientOptions(timeout_s=120.0, progress=False)
        backends = {"grpc": GrpcBackend(cluster.router, options), "http": OpenAIBackend(cluster.state.http, options)}
        limits = uvloop.run(backends["grpc"].model()).limits
        uvloop.run(backends["http"].model())  # names the model the HTTP requests ask for
        for round_ in range(args.rounds + 1):  # round 0 warms both paths up, unrecorded
            workload = SyntheticWorkload(FixedLengths(PROMPT_LEN, args.tokens), limits, seed=round_)
            for name, backend in backends.items():
                bench = ServeBench(backend, workload, RunLength(num_requests=args.requests), 1.0, round_, Slo())
                run = bench.run_at(LATENCY_RATE)
                if round_ and run.summary.num_ok == run.summary.num_requests:
                    per_api[name]["ttft"].append(run.summary.ttft_s.p50)
                    per_api[name]["itl"].append(run.summary.itl_s.p50)
    result = {api: {metric: statistics.median(values) for metric, values in metrics.items()}
              for api, metrics in per_api.items()}
    result["http_minus_grpc_ms"] = {m: (result["http"][m] - result["grpc"][m]) * 1e3 for m in ("ttft", "itl")}
    return result


# -- 2. the router's CPU per token, behind nodes that cost nothing --------------------------
@dataclass
class Router:
    process: subprocess.Popen
    grpc_address: str
    http_url: str


def start_router(model_dir: Path, stream_interval: int = 1) -> Router:
    """`pdserve router` on OS-picked ports, read back from the lines it prints when it serves."""
    argv = [sys.executable, "-m", "pdserve", "router", "--model", str(model_dir), "--port", "0",
            "--http-port", "0", "--log-level", "warning", "--stream-interval", str(stream_interval)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    grpc_address = process.stdout.readline().split()[-1]  # "pdserve router listening on HOST:PORT"
    http_url = process.stdout.readline().split()[-1]  # "... HTTP API on http://HOST:PORT/v1"
    return Router(process, grpc_address, http_url)


def start_fake_nodes(router: Router, model_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdserve.testing.serve_fakes", "--router", router.grpc_address,
            "--model", str(model_dir)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError("the fake nodes did not start")
    uvloop.run(wait_serving(router.grpc_address))
    return process


async def wait_serving(address: str, timeout_s: float = 30.0) -> None:
    """Until the router says it can serve (both fakes registered and heard from)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def serving() -> bool:
            return (await stub.Health(pdserve_pb2.HealthRequest())).serving
        await until(serving, timeout_s, interval_s=0.05)


async def grpc_streams(address: str, requests: int, tokens: int, concurrency: int) -> int:
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=list(range(1, PROMPT_LEN + 1))),
                                          sampling_params=pdserve_pb2.SamplingParams(
                                              temperature=0.0, max_tokens=tokens, ignore_eos=True))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)

        async def one() -> int:
            return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=60)])
        return await _closed_loop(one, requests, concurrency)


async def http_streams(base_url: str, requests: int, tokens: int, concurrency: int) -> int:
    # The final usage counts the tokens: a chunk carries every token of its node event.
    body = {"prompt": list(range(1, PROMPT_LEN + 1)), "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one() -> int:
            count = 0
            async with http.post(f"{base_url}/completions", json=body) as response:
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        count += (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0)
            return count
        return await _closed_loop(one, requests, concurrency)


async def _closed_loop(one, requests: int, concurrency: int) -> int:
    remaining = iter(range(requests))

    async def worker() -> int:
        return sum([await one() for _ in remaining])
    return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))


def measure_router_cost(args: argparse.Namespace, stream_interval: int) -> dict:
    model_dir = ensure_model("llama", "small", "float32")
    router = start_router(model_dir, stream_interval)
    nodes = start_fake_nodes(router, model_dir)
    result = {}
    try:
        drives = {"grpc": lambda n: grpc_streams(router.grpc_address, n, args.cost_tokens, args.concurrency),
                  "http": lambda n: http_streams(router.http_url, n, args.cost_tokens, args.concurrency)}
        for name, drive in drives.items():
            uvloop.run(drive(args.concurrency))  # warm-up: channels, first requests
            before, start = process_cpu_s(router.process.pid), time.perf_counter()
            streamed = uvloop.run(drive(args.cost_requests))
            cpu_s, wall_s = process_cpu_s(router.process.pid) - before, time.perf_counter() - start
            result[name] = {"tokens": streamed, "router_cpu_us_per_token": cpu_s / streamed * 1e6,
                            "tokens_per_s": streamed / wall_s}
    finally:
        for process in (nodes, router.process):
            process.terminate()
            process.wait(timeout=30)
    result["http_over_grpc_cpu"] = result["http"]["router_cpu_us_per_token"] / result["grpc"]["router_cpu_us_per_token"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.http_front", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="latency: rounds of both APIs (after one warm-up)")
    p.add_argument("--requests", type=int, default=8, help="latency: requests per API per round")
    p.add_argument("--tokens", type=int, default=32, help="latency: tokens per request")
    p.add_argument("--cost-requests", type=int, default=200, help="router cost: requests per API")
    p.add_argument("--cost-tokens", type=int, default=64, help="router cost: tokens per request")
    p.add_argument("--concurrency", type=int, default=8, help="router cost: streams at once")
    p.add_argument("--stream-interval", type=int, nargs="+", default=[1], metavar="K",
                   help="router cost: the router's --stream-interval, one run per K (1: every token streamed)")
    p.add_argument("--skip-latency", action="store_true", help="only the router cost (no model runs)")
    args = p.parse_args(argv)
    if min(args.stream_interval) < 1:
        p.error(f"--stream-interval: every K must be at least 1, got {args.stream_interval}")
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    result: dict = {"router_cost_by_stream_interval": {}}
    for k in sorted(set(args.stream_interval)):
        cost = measure_router_cost(args, k)
        label = f"--stream-interval {k}"
        for api in ("grpc", "http"):
            print(f"router cost {api:4} ({label}): {cost[api]['router_cpu_us_per_token']:6.1f} µs CPU/token "
                  f"({cost[api]['tokens']} tokens, {cost[api]['tokens_per_s']:.0f} tokens/s)")
        print(f"router cost http/grpc ({label}): {cost['http_over_grpc_cpu']:.2f}x", flush=True)
        result["router_cost_by_stream_interval"][k] = cost
        if k == 1:
            result["router_cost"] = cost
    if not args.skip_latency:
        latency = measure_latency(args)
        for api in ("grpc", "http"):
            print(f"latency {api:4}: TTFT p50 {latency[api]['ttft'] * 1e3:7.2f} ms, "
                  f"ITL p50 {latency[api]['itl'] * 1e3:7.2f} ms")
        diff = latency["http_minus_grpc_ms"]
        print(f"latency http - grpc: TTFT {diff['ttft']:+.2f} ms, ITL {diff['itl']:+.2f} ms")
        result["latency"] = latency
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
