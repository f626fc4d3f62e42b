"""Overload: admitted requests keep their latency when 10× the cluster's capacity arrives.

    pdserve bench overload [--size small] [--max-inflight 8] [--duration-s 10] [--overload 10]
                           [--auth-token-file PATH]

Starts router + `--prefill` prefill + `--decode` decode nodes on 127.0.0.1 (the router
admits `--max-inflight` sequences at a time), then, with one seeded workload of
random-id prompts each generating exactly `--max-tokens` tokens:
  1. capacity: `--max-inflight` closed-loop clients for `--duration-s`; completed
     requests per second is the capacity rate;
  2. 1×: an open loop (Poisson arrivals) offering the capacity rate;
  3. N×: an open loop offering `--overload` times the capacity rate.
For each open-loop phase it reports the share refused with RESOURCE_EXHAUSTED, p50/p99
of admitted requests' end-to-end latency and time to first token, how fast a refusal
came back, and every other status seen (there should be none). Ratios N× / 1× are what
to read: this machine is shared and noisy, so absolute numbers are context only.
With a token (`--auth-token-file`, else `$PDSERVE_AUTH_TOKEN`) the cluster requires it
and the benchmark's clients send it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.common.auth import add_auth_args, open_channel, token_or_usage_error
from pdserve.bench.common import ensure_model, local_cluster
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

WARMUP_REQUESTS = 4


@dataclass(slots=True)
class Result:
    code: str
    latency_s: float
    ttft_s: float | None


@dataclass
class Phase:
    name: str
    offered_rps: float
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [r for r in self.results if r.code == "OK"]
        refused = [r for r in self.results if r.code == "RESOURCE_EXHAUSTED"]
        other = Counter(r.code for r in self.results if r.code not in ("OK", "RESOURCE_EXHAUSTED"))
        return {
            "phase": self.name,
            "offered_rps": self.offered_rps,
            "requests": len(self.results),
            "admitted": len(ok),
            "rejected": len(refused),
            "rejected_share": len(refused) / len(self.results) if self.results else 0.0,
            "other_statuses": dict(other),
            "goodput_rps": len(ok) / self.wall_s if self.wall_s else 0.0,
            "admitted_e2e_p50_s": _quantile([r.latency_s for r in ok], 0.5),
            "admitted_e2e_p99_s": _quantile([r.latency_s for r in ok], 0.99),
            "admitted_ttft_p50_s": _quantile([r.ttft_s for r in ok if r.ttft_s is not None], 0.5),
            "admitted_ttft_p99_s": _quantile([r.ttft_s for r in ok if r.ttft_s is not None], 0.99),
            "rejection_p50_s": _quantile([r.latency_s for r in refused], 0.5),
            "rejection_p99_s": _quantile([r.latency_s for r in refused], 0.99),
        }


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Workload:
    def __init__(self, seed: int, prompt_len: int, max_tokens: int, vocab: int) -> None:
        self._rng = random.Random(seed)
        self.prompt_len, self.max_tokens, self.vocab = prompt_len, max_tokens, vocab

    def next_request(self) -> pdserve_pb2.GenerateRequest:
        prompt = [self._rng.randrange(1, self.vocab) for _ in range(self.prompt_len)]
        return pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt),
            sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True),
        )


async def one_request(stub, request: pdserve_pb2.GenerateRequest, timeout_s: float) -> Result:
    start = time.perf_counter()
    first = None
    code = "OK"
    try:
        async for _ in stub.Generate(request, timeout=timeout_s):
            first = first if first is not None else time.perf_counter() - start
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return Result(code, time.perf_counter() - start, first)


async def closed_loop(stub, workload: Workload, clients: int, duration_s: float, timeout_s: float) -> Phase:
    phase = Phase("capacity (closed loop)", 0.0)
    end = time.perf_counter() + duration_s

    async def client() -> None:
        while time.perf_counter() < end:
            phase.results.append(await one_request(stub, workload.next_request(), timeout_s))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    phase.wall_s = time.perf_counter() - start
    return phase


async def open_loop(stub, workload: Workload, name: str, rate: float, duration_s: float, timeout_s: float,
                    rng: random.Random) -> Phase:
    """Poisson arrivals at `rate` per second for `duration_s`, never waiting for an answer."""
    phase = Phase(name, rate)
    tasks = []
    start = time.perf_counter()
    next_at = start
    while next_at < start + duration_s:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        tasks.append(asyncio.create_task(one_request(stub, workload.next_request(), timeout_s)))
        next_at += rng.expovariate(rate)
    phase.results = list(await asyncio.gather(*tasks))
    phase.wall_s = time.perf_counter() - start
    return phase


async def measure(router: str, args: argparse.Namespace, auth_token: str | None) -> list[Phase]:
    workload = Workload(args.seed, args.prompt_len, args.max_tokens, args.vocab)
    rng = random.Random(args.seed + 1)
    async with open_channel(router, auth_token) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        for _ in range(WARMUP_REQUESTS):
            await one_request(stub, workload.next_request(), args.timeout_s)
        capacity = await closed_loop(stub, workload, args.max_inflight, args.duration_s, args.timeout_s)
        rate = capacity.summary()["goodput_rps"]
        if rate <= 0:
            codes = Counter(r.code for r in capacity.results)
            raise RuntimeError(f"no request completed in the capacity phase: {dict(codes)}")
        capacity.offered_rps = rate
        base = await open_loop(stub, workload, "1x", rate, args.duration_s, args.timeout_s, rng)
        over = await open_loop(stub, workload, f"{args.overload:g}x", rate * args.overload, args.duration_s,
                               args.timeout_s, rng)
    return [capacity, base, over]


def run(args: argparse.Namespace, auth_token: str | None = None) -> dict:
    model_dir = args.model_dir or ensure_model("llama", args.size, "float32")
    node_args = ("--num-blocks", str(args.num_blocks), "--max-num-batched-tokens", str(args.chunk),
                 "--max-num-seqs", str(args.max_num_seqs))
    pools = ("--prefill", str(args.prefill), "--decode", str(args.decode))
    extra = ("--threads-per-node", str(args.threads), "--router-args", f"--max-inflight-requests {args.max_inflight}")
    with local_cluster(model_dir, pools, node_args, extra, auth_token) as cluster:
        phases = asyncio.run(measure(cluster.router, args, auth_token))
        leftover = [(name, *held) for name, held in cluster.wait_all_blocks_free(timeout_s=30).items()]
    summaries = [p.summary() for p in phases]
    base, over = summaries[1], summaries[2]
    return {
        "model_dir": str(model_dir), "config": {k: str(v) for k, v in vars(args).items()},
        "phases": summaries,
        "blocks_after (node, used, reserved)": leftover,
        "ratios": {
            "e2e_p50_overload_over_1x": _ratio(over["admitted_e2e_p50_s"], base["admitted_e2e_p50_s"]),
            "e2e_p99_overload_over_1x": _ratio(over["admitted_e2e_p99_s"], base["admitted_e2e_p99_s"]),
            "ttft_p99_overload_over_1x": _ratio(over["admitted_ttft_p99_s"], base["admitted_ttft_p99_s"]),
            "goodput_overload_over_capacity": _ratio(over["goodput_rps"], summaries[0]["goodput_rps"]),
            "rejection_p50_over_admitted_e2e_p50": _ratio(over["rejection_p50_s"], over["admitted_e2e_p50_s"]),
        },
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _print(result: dict) -> None:
    print(f"{'phase':>22} {'offered/s':>9} {'reqs':>5} {'admit':>5} {'reject':>7} {'e2e p50':>8} {'e2e p99':>8} "
          f"{'ttft p99':>8} {'refusal p50':>11} other")
    for p in result["phases"]:
        print(f"{p['phase']:>22} {p['offered_rps']:9.1f} {p['requests']:5d} {p['admitted']:5d} "
              f"{p['rejected_share']:7.1%} {p['admitted_e2e_p50_s'] * 1e3:6.0f}ms "
              f"{p['admitted_e2e_p99_s'] * 1e3:6.0f}ms {p['admitted_ttft_p99_s'] * 1e3:6.0f}ms "
              f"{p['rejection_p50_s'] * 1e3:9.1f}ms {p['other_statuses'] or '-'}")
    for name, value in result["ratios"].items():
        print(f"  {name:40s} {value:6.2f}")
    print(f"  blocks after (kind, used, reserved): {result['blocks_after (kind, used, reserved)']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench overload", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: the cached llama --size model, float32")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--vocab", type=int, default=900, help="prompt ids are drawn from [1, vocab)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--max-inflight", type=int, default=8, help="the router's --max-inflight-requests")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--overload", type=float, default=10.0, help="offered load of the last phase, x capacity")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="each request's deadline")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="the nodes' max_num_batched_tokens")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/overload.json"))
    add_auth_args(parser)
    args = parser.parse_args(argv)
    result = run(args, token_or_usage_error(parser, args.auth_token_file, os.environ))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    _print(result)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
