"""`pdserve bench serve`: open-loop load against a running router, with an SLO report.

    pdserve bench serve --addr HOST:PORT --rate 4 --num-requests 200 \\
        --workload chat --ttft-slo 2 --tpot-slo 0.2 --output-json out.json --plot-dir plots/
    pdserve bench serve --backend openai --base-url http://127.0.0.1:8000/v1 --rate 4 ...

`--backend grpc` (the default) drives a pdserve router's gRPC API; `--backend openai` any
OpenAI-compatible server's `/v1/completions`, so pdserve and other servers are measured by the
same workloads, SLOs and sweep.

One run at `--rate`, one run per rate of `--rates`, or `--sweep`: bisection for the
highest rate whose SLO attainment reaches `--attainment` (goodput). Prints a summary
per run; `--output-json` and `--plot-dir` keep everything. Owns the flags and their
checks (a bad combination is a usage error, before any request is sent) and the
wiring of the other modules; measures nothing itself.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import aiohttp
import grpc
import uvloop

from pdserve.common.auth import add_auth_args, check_token, token_from_cli
from pdserve.common.tls import add_tls_args, tls_from_args
from pdserve.bench.serve import report
from pdserve.bench.serve.client import Backend, ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.openai_backend import OpenAIBackend
from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import Run, RunLength, ServeBench
from pdserve.bench.serve.sweep import SweepConfig, find_max_rate
from pdserve.bench.serve.workload_flags import (
    DEFAULT_NUM_REQUESTS, add_arrival_args, add_workload_args, build_workload, check_workload_args,
)
from pdserve.router.fronts.client import DEFAULT_ADDRESS



def _rates(text: str) -> list[float]:
    try:
        return [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["grpc", "openai"], default="grpc",
                   help="grpc: a pdserve router at --addr; openai: any OpenAI-compatible server at --base-url")
    p.add_argument("--addr", default=DEFAULT_ADDRESS, help="grpc: router HOST:PORT")
    p.add_argument("--base-url", help="openai: the API's root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="openai: the model to name (default: the first of GET /models)")
    p.add_argument("--vocab-size", type=int, help="openai: prompt token ids are drawn below it (default: from /models)")
    p.add_argument("--max-model-len", type=int, help="openai: the model's length (default: from /models)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rate", type=float, help="one run at this many requests/s (inf: all at once)")
    mode.add_argument("--rates", type=_rates, help="one run per rate, e.g. 1,2,4")
    mode.add_argument("--sweep", action="store_true", help="bisect for the highest rate meeting --attainment")

    add_arrival_args(p)
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="send this many requests at once before the first run and leave them out of every result "
                        "(a server's first shapes: kernel builds, allocator growth)")
    add_workload_args(p)

    slo = p.add_argument_group("SLOs and the sweep")
    slo.add_argument("--ttft-slo", type=float, help="seconds (unset: any TTFT meets it)")
    slo.add_argument("--tpot-slo", type=float, help="seconds (unset: any TPOT meets it)")
    slo.add_argument("--attainment", type=float, default=0.9, help="sweep target: share of requests meeting both")
    slo.add_argument("--rate-min", type=float, help="sweep bracket low end (or floor of the automatic bracket)")
    slo.add_argument("--rate-max", type=float, help="sweep bracket high end (or cap of the automatic bracket)")
    slo.add_argument("--start-rate", type=float, default=1.0, help="automatic bracket: first rate, doubled/halved")
    slo.add_argument("--tolerance", type=float, default=0.05, help="sweep stops when the bracket is this fraction")
    slo.add_argument("--max-probes", type=int, default=12, help="sweep: at most this many runs")
    slo.add_argument("--growth", type=float, default=2.0,
                     help="automatic bracket: x this after a pass, / this after a miss (a start near the answer "
                          "brackets it tightly with a small one, e.g. 1.25)")
    slo.add_argument("--devices", type=int, default=1, help="goodput is also reported divided by this")

    out = p.add_argument_group("client and output")
    out.add_argument("--timeout-s", type=float, help="deadline of each request")
    out.add_argument("--auth-token", help="sent as `authorization: Bearer <token>` (visible in `ps`: prefer the file)")
    add_auth_args(out)
    add_tls_args(p, server=False)
    out.add_argument("--output-json", type=Path)
    out.add_argument("--plot-dir", type=Path, help="write attainment_vs_rate.png and latency_cdf.png here")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.backend == "openai" and not args.base_url:
        p.error("--backend openai needs --base-url")
    if args.backend == "grpc" and any(v is not None for v in (args.base_url, args.model, args.vocab_size,
                                                               args.max_model_len)):
        p.error("--base-url, --model, --vocab-size and --max-model-len are for --backend openai")
    check_workload_args(p, args)
    if args.sweep and args.ttft_slo is None and args.tpot_slo is None:
        p.error("--sweep needs --ttft-slo and/or --tpot-slo")
    if args.devices < 1:
        p.error("--devices must be >= 1")
    if args.rates is not None and not args.rates:
        p.error("--rates lists no rate")
    if any(not rate > 0 for rate in _fixed_rates(args)):
        p.error("rates must be > 0 requests/s")
    if args.duration_s is not None and math.inf in _fixed_rates(args):
        p.error("an infinite rate sends everything at once: give --num-requests, not --duration-s")
    if args.warmup_requests < 0:
        p.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")


def _sweep_config(args: argparse.Namespace) -> SweepConfig:
    return SweepConfig(target_attainment=args.attainment, rate_min=args.rate_min, rate_max=args.rate_max,
                       start_rate=args.start_rate, tolerance=args.tolerance, max_probes=args.max_probes,
                       growth=args.growth)


def _fixed_rates(args: argparse.Namespace) -> list[float]:
    """The rates of --rate or --rates; none for --sweep."""
    return [args.rate] if args.rate is not None else args.rates or []


def _run_all(args: argparse.Namespace, bench: ServeBench) -> tuple[list[Run], dict | None]:
    def run_at(rate: float) -> Run:
        run = bench.run_at(rate)
        print(report.format_run(run), flush=True)
        return run

    if not args.sweep:
        return [run_at(rate) for rate in _fixed_rates(args)], None
    sweep = find_max_rate(run_at, _sweep_config(args))
    record = report.sweep_record(sweep, args.attainment, args.devices)
    print(report.format_sweep(record))
    return [p.result for p in sweep.probes], record


def _auth_token(args: argparse.Namespace) -> str | None:
    """--auth-token, else --auth-token-file, else $PDSERVE_AUTH_TOKEN, else none (as `pdserve generate`)."""
    if args.auth_token is not None:
        return check_token(args.auth_token, "--auth-token")
    return token_from_cli(args.auth_token_file, os.environ)


def _config_record(args: argparse.Namespace) -> dict:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["auth_token"] = "<set>" if args.auth_token else None  # never write the secret itself
    return config


def build_backend(args: argparse.Namespace, options: ClientOptions) -> Backend:
    if args.backend == "openai":
        return OpenAIBackend(args.base_url, options, args.model, args.vocab_size, args.max_model_len)
    return GrpcBackend(args.addr, options)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.num_requests is None and args.duration_s is None:
        args.num_requests = DEFAULT_NUM_REQUESTS
    slo = Slo(args.ttft_slo, args.tpot_slo)
    try:
        options = ClientOptions(timeout_s=args.timeout_s, auth_token=_auth_token(args), progress=not args.no_progress,
                                tls=tls_from_args(args, server=False))
        if args.sweep:
            _sweep_config(args)  # a bad bracket is a usage error before any request is sent
        backend = build_backend(args, options)
        model = uvloop.run(backend.model())
        workload = build_workload(args, model.limits)
        cv = 1.0 if args.cv is None else args.cv
        if args.warmup_requests:
            warmup = RunLength(num_requests=args.warmup_requests)
            ServeBench(backend, workload, warmup, cv, args.seed + 1, Slo()).run_at(math.inf)
        length = RunLength(args.num_requests, args.duration_s, args.min_duration_s)
        runs, sweep = _run_all(args, ServeBench(backend, workload, length, cv, args.seed, slo))
    except grpc.aio.AioRpcError as err:
        print(f"error: GetModelInfo at {args.addr}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except aiohttp.ClientError as err:
        print(f"error: {args.base_url}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:  # a WorkloadError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.output_json is not None:
        report.write_json(args.output_json, _config_record(args), model.record, runs, sweep)
        print(f"results: {args.output_json}")
    if args.plot_dir is not None:
        for path in report.write_plots(args.plot_dir, runs, args.attainment, slo):
            print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
