"""A workload whose mix shifts halfway, served by the same three nodes with and without the
planner's load mode (`pdserve cluster --rebalance`): SLO attainment in each half.

    pdserve bench rebalance [--model-dir DIR] [--rate 2] [--requests-per-phase 60]
                            [--ttft-slo 2] [--tpot-slo 0.15] [--out-dir results/rebalance]

The first half sends long prompts and short outputs (the prefill pool's work), the second short
prompts and long outputs (the decode pool's). Each cluster starts as 1 prefill + 2 decode nodes,
one torch thread each, on this machine's cores; with the load mode the launcher may move nodes
between the pools (its `load mode:` lines are printed), without it the pools keep their sizes.
One open-loop client (`pdserve bench serve`'s machinery), one seed: both clusters see the same
requests at the same times. Prints each half's attainment for both, and the moves made; writes
JSON. The load mode needs the nodes' profile: measured on the first run, then cached.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import uvloop

from pdserve.bench.common import ensure_model, local_cluster
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo, summarize
from pdserve.bench.serve.runner import RunLength, ServeBench
from pdserve.bench.serve.workloads import RequestSpec, SyntheticWorkload, UniformLengths, Workload

POOLS = ("--prefill", "1", "--decode", "2", "--threads-per-node", "1")


@dataclass(frozen=True)
class Phased:
    """Requests 0..switch-1 from `first`, the rest from `second`."""

    first: Workload
    second: Workload
    switch: int

    def request(self, index: int, run: int = 0) -> RequestSpec:
        return self.first.request(index, run) if index < self.switch else self.second.request(index, run)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench rebalance", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, help="default: the smol135m-shaped model in bf16 (built once)")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s, Poisson, through both halves")
    p.add_argument("--requests-per-phase", type=int, default=60)
    p.add_argument("--prefill-heavy", default="384:768,4:16", metavar="IN_RANGE,OUT_RANGE",
                   help="the first half's prompt and output length ranges")
    p.add_argument("--decode-heavy", default="16:64,96:192", metavar="IN_RANGE,OUT_RANGE",
                   help="the second half's prompt and output length ranges")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tpot-slo", type=float, default=0.15)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--interval-s", type=float, default=10.0, help="the load mode's window")
    p.add_argument("--cooldown-s", type=float, default=20.0, help="the load mode's wait after a move")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("results/rebalance"))
    return p


def _lengths(text: str) -> UniformLengths:
    prompt, output = (tuple(int(x) for x in part.split(":")) for part in text.split(","))
    return UniformLengths(prompt, output)


def _measure(args: argparse.Namespace, model_dir: str, load_mode: tuple[str, ...]) -> dict:
    slo = Slo(args.ttft_slo, args.tpot_slo)
    node_args = ("--max-num-batched-tokens", "512", "--max-num-seqs", "64")
    with local_cluster(model_dir, POOLS, node_args, extra=load_mode) as cluster:
        backend = GrpcBackend(cluster.router, ClientOptions(progress=True, timeout_s=600.0))
        limits = uvloop.run(backend.model()).limits
        phases = Phased(SyntheticWorkload(_lengths(args.prefill_heavy), limits, args.seed),
                        SyntheticWorkload(_lengths(args.decode_heavy), limits, args.seed + 1), args.requests_per_phase)
        warm = SyntheticWorkload(_lengths(args.prefill_heavy), limits, args.seed + 2)
        ServeBench(backend, warm, RunLength(num_requests=3), 1.0, args.seed, Slo()).run_at(math.inf)
        run = ServeBench(backend, phases, RunLength(num_requests=2 * args.requests_per_phase), 1.0, args.seed,
                         slo).run_at(args.rate)
        moves = [line for line in cluster.log("launcher").splitlines() if "load mode:" in line]
    halves = {"prefill-heavy": [m for m in run.requests if m.index < args.requests_per_phase],
              "decode-heavy": [m for m in run.requests if m.index >= args.requests_per_phase]}
    return {"attainment": {name: summarize(ms, slo, run.summary.duration_s).attainment for name, ms in halves.items()},
            "overall": run.summary.attainment, "moves": moves}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model_dir = str(args.model_dir or ensure_model("llama", "smol135m", "bfloat16"))
    load_mode = ("--rebalance", "--rebalance-ttft-slo", str(args.ttft_slo), "--rebalance-tpot-slo", str(args.tpot_slo),
                 "--rebalance-attainment", str(args.attainment), "--rebalance-interval-s", str(args.interval_s),
                 "--rebalance-cooldown-s", str(args.cooldown_s))
    results = {"fixed 1P2D": _measure(args, model_dir, ()), "load mode": _measure(args, model_dir, load_mode)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                           "results": results}, indent=1))
    print(f"\nSLO attainment (TTFT <= {args.ttft_slo:g} s, TPOT <= {args.tpot_slo:g} s) at {args.rate:g} req/s:")
    for name, r in results.items():
        halves = ", ".join(f"{half} {a:.1%}" for half, a in r["attainment"].items())
        print(f"  {name:10s}: {halves}; overall {r['overall']:.1%}")
    for line in results["load mode"]["moves"]:
        print(f"  {line}")
    print(f"results: {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
