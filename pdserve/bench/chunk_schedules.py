"""Chunk schedules on a colocated node under the same load: TTFT p50 and TPOT p99 of each.

    python -m pdserve.bench.chunk_schedules [--size small] [--dtype float32] [--rate 2]
                                            [--num-requests 24] [--budget 512] [--target-step-ms 40]

For each of `--chunk-schedule fixed`, `staged` and `target-step`, a local colocated cluster
(`pdserve cluster --colocated 1`, one core for the node) serves the same seeded open-loop
workload through `pdserve bench serve`'s gRPC backend: long prompts (`--input-len-range`)
arriving while earlier requests decode. A fixed chunk spends the whole `--budget` on prefill
each step, so running decodes wait behind it (TPOT's tail); the staged schedule shrinks a long
prompt's chunks as it advances; target-step sizes each step's prefill from the step-time model
profiled at start, to hold `--target-step-ms`. Prints, per schedule, TTFT p50, TPOT p50/p99 and
the ratios against `fixed` measured in the same run, and the CPU capability.
"""

from __future__ import annotations

import argparse
import json

import torch
import uvloop

from pdserve.bench.common import ensure_model, local_cluster
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import RunLength, ServeBench
from pdserve.bench.serve.workloads import SyntheticWorkload, UniformLengths

SCHEDULES = ("fixed", "staged", "target-step")


def measure(schedule: str, args: argparse.Namespace, model_dir) -> dict:
    node_args = ("--chunk-schedule", schedule, "--max-num-batched-tokens", str(args.budget),
                 "--low-chunk-size", str(args.low_chunk_size), "--chunk-schedule-max-tokens",
                 str(args.input_len_range[1]), "--target-step-ms", str(args.target_step_ms), "--threads", "1")
    with local_cluster(model_dir, ("--colocated", "1"), node_args) as cluster:
        backend = GrpcBackend(cluster.router, ClientOptions(timeout_s=600.0, progress=False))
        limits = uvloop.run(backend.model()).limits
        lengths = UniformLengths(args.input_len_range, args.output_len_range)
        # Warm-up (kernels built for the shapes), unrecorded; then the measured run.
        ServeBench(backend, SyntheticWorkload(lengths, limits, 99), RunLength(num_requests=2), 1.0, 0,
                   Slo()).run_at(float("inf"))
        run = ServeBench(backend, SyntheticWorkload(lengths, limits, args.seed), RunLength(args.num_requests),
                         1.0, args.seed, Slo()).run_at(args.rate)
    summary = run.summary
    return {"ok": summary.num_ok, "ttft_p50_s": summary.ttft_s.p50, "tpot_p50_s": summary.tpot_s.p50,
            "tpot_p99_s": summary.tpot_s.p99}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.chunk_schedules", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", help="model shape (model_factory)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--input-len-range", type=lambda t: tuple(int(x) for x in t.split(":")), default=(512, 1536))
    p.add_argument("--output-len-range", type=lambda t: tuple(int(x) for x in t.split(":")), default=(16, 48))
    p.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens (fixed's chunk)")
    p.add_argument("--low-chunk-size", type=int, default=128, help="staged: the last stage")
    p.add_argument("--target-step-ms", type=float, default=40.0, help="target-step: the step time to hold")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    model_dir = ensure_model("llama", args.size, args.dtype)
    results = {schedule: measure(schedule, args, model_dir) for schedule in SCHEDULES}
    base = results["fixed"]
    for schedule, r in results.items():
        print(f"{schedule:11}: {r['ok']}/{args.num_requests} OK, TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
              f"({r['ttft_p50_s'] / base['ttft_p50_s']:.2f}x fixed), TPOT p50 {r['tpot_p50_s'] * 1e3:6.1f} ms, "
              f"p99 {r['tpot_p99_s'] * 1e3:6.1f} ms ({r['tpot_p99_s'] / base['tpot_p99_s']:.2f}x fixed)")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
