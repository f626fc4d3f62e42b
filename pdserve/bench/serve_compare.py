"""Disaggregated 1P1D (one core each), colocated, and hybrid on the same two cores: goodput per SLO.

    pdserve bench serve-compare [--model-dir DIR] [--num-requests 24] [--out-dir results/serve_compare]
                                [--architectures disaggregated,colocated,hybrid,hybrid-budget,hybrid-pool]

One run, one workload, one client: for each architecture, start it on cores 0 and 1
(the router shares core 1), warm it up, measure the unloaded TTFT/TPOT, then bisect for
the goodput (the highest rate at which `--attainment` of the requests meet both SLOs)
under a TPOT-tight, a TTFT-tight and a balanced SLO, with `pdserve bench serve`'s own machinery.
The hybrid is the 1P1D pair with a decode node that can also prefill (`--local-prefill`) and
the router choosing per request (`--disaggregation auto`, pdserve/router/dispatch/hybrid.py). The
budgeted hybrid (`hybrid-budget`, not run unless asked for) adds the router's prompt budget,
`--local-prefill-tokens-per-s`, set for each SLO as `pdserve plan` sets it:
`--budget-fraction` of what the TPOT target leaves the decode node by its profile (measured
once and cached, as `pdserve profile` does); so it runs one cluster per SLO. The hybrid pool
(`hybrid-pool`, not run unless asked for) is two decode nodes that are prefill nodes too
(`--serve-prefill`, one core each): colocated, and moving a prompt's KV to another node when its
own is short of KV blocks.
On the disaggregated cluster it also measures the KV transfer's share of TTFT (the
transfer time left after token 1, one request at a time). Each sweep records where its
requests' prompts were computed (the router's `pdserve_prompt_routes_total`, read before and
after): what a hybrid decided, so that a hybrid measured level with colocated can be told from
one that moved nothing. Prints a table of goodputs,
each architecture's over colocated's, and whether the hybrid reached the better of the
other two under each SLO; writes JSON and the plots of every sweep.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from pdserve.bench.common import ensure_model, local_cluster
from pdserve.bench.disagg_latency import one_request
from pdserve.cluster_process import ClusterProcess
from pdserve.bench.serve import report
from pdserve.bench.serve.client import ClientOptions
from pdserve.bench.serve.grpc_backend import GrpcBackend
from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.runner import RunLength, ServeBench
from pdserve.bench.serve.sweep import SweepConfig, find_max_rate
from pdserve.bench.serve.workloads import SyntheticWorkload, UniformLengths
from pdserve.testing.metrics import counter_in, scrape
from pdserve.engine.config import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from pdserve.planner.profile import Profile

NUM_DEVICES = 2  # cores 0 and 1: the same two "devices" for both architectures
UNLOADED_RATE = 0.1  # requests/s: one at a time, nearly always


@dataclass(frozen=True)
class Architecture:
    key: str  # --architectures names it
    name: str
    pools: tuple[str, ...]  # `pdserve cluster` flags: the pools and their cores (cores as devices)
    kind_args: tuple[tuple[str, tuple[str, ...]], ...] = ()  # more flags for one kind's nodes
    tpot_budget: bool = False  # the router's prompt budget set per SLO (a cluster per SLO)


PAIR = ("--prefill", "1", "--decode", "1", "--prefill-cores", "0", "--decode-cores", "1", "--router-cores", "1")
ARCHITECTURES = {a.key: a for a in (
    Architecture("disaggregated", "disaggregated 1P1D", PAIR),
    Architecture("colocated", "colocated 2x1", ("--colocated", "2", "--colocated-cores", "0-1", "--router-cores", "1")),
    Architecture("hybrid", "hybrid 1P1D auto", (*PAIR, "--router-args", "--disaggregation auto"),
                 (("decode", ("--local-prefill",)),)),
    Architecture("hybrid-budget", "hybrid 1P1D auto, TPOT budget", PAIR, (("decode", ("--local-prefill",)),),
                 tpot_budget=True),
    Architecture("hybrid-pool", "2 decode nodes that serve prefill, auto",
                 ("--prefill", "0", "--decode", "2", "--decode-cores", "0-1", "--router-cores", "1",
                  "--router-args", "--disaggregation auto"), (("decode", ("--serve-prefill",)),)),
)}
DEFAULT_ARCHITECTURES = "disaggregated,colocated,hybrid"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve-compare", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, help="default: the smol135m-shaped model in bf16 (built once)")
    p.add_argument("--input-len-range", default="128:512")
    p.add_argument("--output-len-range", default="32:128")
    p.add_argument("--num-requests", type=int, default=24, help="requests per sweep probe")
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of every node")
    p.add_argument("--tpot-tight", default="4.0,0.10", metavar="TTFT,TPOT",
                   help="SLO seconds: loose TTFT, tight TPOT")
    p.add_argument("--ttft-tight", default="2.0,0.3", metavar="TTFT,TPOT",
                   help="SLO seconds: tight TTFT, loose TPOT")
    p.add_argument("--balanced", default="3.0,0.15", metavar="TTFT,TPOT",
                   help="SLO seconds: both between the tight and the loose ones")
    p.add_argument("--architectures", default=DEFAULT_ARCHITECTURES,
                   help=f"comma-separated, of {', '.join(ARCHITECTURES)} (colocated is the ratios' baseline)")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="hybrid-budget: the share of the TPOT budget the router gets (pdserve plan tries 1, 0.5, 0.25)")
    p.add_argument("--profile-dir", help="hybrid-budget: where profiles are cached (default: pdserve profile's)")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--start-rate", type=float, default=0.5)
    p.add_argument("--rate-min", type=float, help="never probe below this")
    p.add_argument("--rate-max", type=float, help="never probe above this")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--max-probes", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("results/serve_compare"))
    return p


def _slo(text: str) -> Slo:
    ttft, tpot = (float(x) for x in text.split(","))
    return Slo(ttft_s=ttft, tpot_s=tpot)


@contextmanager
def _cluster(arch: Architecture, model_dir: str, chunk: int,
             router_args: tuple[str, ...] = ()) -> Iterator[ClusterProcess]:
    node_args = ("--num-blocks", "4096", "--max-num-batched-tokens", str(chunk), "--max-num-seqs", "64")
    extra = ("--metrics-port", "0", *(("--router-args", shlex.join(router_args)) if router_args else ()))
    with local_cluster(model_dir, arch.pools, node_args, extra, kind_args=dict(arch.kind_args)) as cluster:
        yield cluster


def _decode_profile(args: argparse.Namespace, model_dir: str) -> Profile:
    """The decode node's profile (one core), from `pdserve profile`'s cache or measured now."""
    from pdserve.planner.profile import ProfileCache
    from pdserve.planner.profile_cli import profiles_for

    return profiles_for(model_dir, [(1, 1)], "auto", DEFAULT_BLOCK_SIZE, ProfileCache(args.profile_dir))[(1, 1)]


def _budget_args(profile: Profile, fraction: float, slo: Slo) -> tuple[str, ...]:
    """The budgeted hybrid's router flags under `slo`: `pdserve plan`'s rate for its decode node."""
    from pdserve.planner.search import budget_rates

    rates = budget_rates(profile, slo.tpot_s, (fraction,))
    if not rates:
        return ("--disaggregation", "always")  # no time to give: every prompt on the prefill pool
    return ("--disaggregation", "auto", "--local-prefill-tokens-per-s", str(rates[0]))


def _kv_share(router: str, rng: random.Random, prompt_len: int, vocab_size: int, repeats: int = 3) -> dict:
    prompts = [[rng.randrange(1, vocab_size) for _ in range(prompt_len)] for _ in range(repeats)]
    runs = [one_request(router, prompt, 4, None) for prompt in prompts]
    ttft = statistics.median(r["client_ttft_s"] for r in runs)
    transfer = statistics.median(r["kv_transfer_after_token1_s"] for r in runs)
    return {"prompt_len": prompt_len, "ttft_s": ttft, "kv_transfer_after_token1_s": transfer,
            "share_of_ttft": transfer / ttft, "kv_transfer_bytes": runs[0]["kv_transfer_bytes"]}


def prompt_routes(metrics_text: str) -> dict[str, int]:
    """The router's requests so far by where their prompts were computed (`pdserve_prompt_routes_total`)."""
    return {route: int(n) for route, n in counter_in(metrics_text, "pdserve_prompt_routes", "route").items()}


def _routes_now(cluster: ClusterProcess) -> dict[str, int]:
    return prompt_routes(scrape(cluster.state.children["router"].metrics_url))


def _measure(arch: Architecture, args: argparse.Namespace, model_dir: str, slos: dict[str, Slo]) -> dict:
    """One cluster for every SLO, or one per SLO for the budgeted hybrid (its router's budget is
    set from each TPOT target)."""
    if not arch.tpot_budget:
        with _cluster(arch, model_dir, args.chunk) as cluster:
            return _measure_on(cluster, arch, args, slos)
    result: dict = {"architecture": arch.name, "sweeps": {}, "router_args": {}}
    profile = _decode_profile(args, model_dir)
    for slo_name, slo in slos.items():
        router_args = _budget_args(profile, args.budget_fraction, slo)
        print(f"{arch.name} / {slo_name}: router {shlex.join(router_args)}", flush=True)
        with _cluster(arch, model_dir, args.chunk, router_args) as cluster:
            one = _measure_on(cluster, arch, args, {slo_name: slo}, first_phase=3 + list(slos).index(slo_name))
        result.setdefault("unloaded", one["unloaded"])
        result["sweeps"][slo_name] = one["sweeps"][slo_name]
        result["router_args"][slo_name] = list(router_args)
    return result


def _measure_on(cluster: ClusterProcess, arch: Architecture, args: argparse.Namespace, slos: dict[str, Slo],
                first_phase: int = 3) -> dict:
    low, high = (int(x) for x in args.input_len_range.split(":"))
    out_low, out_high = (int(x) for x in args.output_len_range.split(":"))
    result: dict = {"architecture": arch.name}
    backend = GrpcBackend(cluster.router, ClientOptions(progress=True, timeout_s=300.0))
    limits = uvloop.run(backend.model()).limits
    lengths = UniformLengths((low, high), (out_low, out_high))

    def workload(phase: int) -> SyntheticWorkload:
        # One seed per phase: no phase finds another's prompts in the prefix cache, and
        # every architecture sees the same requests in each phase.
        return SyntheticWorkload(lengths, limits, args.seed + phase)

    # Warm up every node on full-size prompts (first shapes build kernels), unrecorded.
    ServeBench(backend, workload(1), RunLength(num_requests=4), 1.0, args.seed, Slo()).run_at(math.inf)
    unloaded = ServeBench(backend, workload(2), RunLength(num_requests=4), 1.0, args.seed,
                          Slo()).run_at(UNLOADED_RATE)
    result["unloaded"] = {"ttft_p50_s": unloaded.summary.ttft_s.p50, "tpot_p50_s": unloaded.summary.tpot_s.p50}
    print(f"{arch.name}: unloaded TTFT p50 {unloaded.summary.ttft_s.p50 * 1e3:.0f} ms, "
          f"TPOT p50 {unloaded.summary.tpot_s.p50 * 1e3:.0f} ms", flush=True)
    if arch.key == "disaggregated":  # the KV transfer share of the pair that always moves it
        result["kv_share"] = _kv_share(cluster.router, random.Random(args.seed), high, limits.vocab_size)
    result["sweeps"] = {}
    for phase, (slo_name, slo) in enumerate(slos.items(), start=first_phase):
        bench = ServeBench(backend, workload(phase), RunLength(num_requests=args.num_requests), 1.0,
                           args.seed, slo)
        config = SweepConfig(target_attainment=args.attainment, start_rate=args.start_rate,
                             rate_min=args.rate_min, rate_max=args.rate_max, tolerance=args.tolerance,
                             max_probes=args.max_probes)

        def run_at(rate: float, bench: ServeBench = bench):
            run = bench.run_at(rate)
            print(report.format_run(run), flush=True)
            return run

        before = _routes_now(cluster)
        sweep = find_max_rate(run_at, config)
        after = _routes_now(cluster)
        record = report.sweep_record(sweep, args.attainment, NUM_DEVICES)
        record["prompt_routes"] = {route: n - before.get(route, 0) for route, n in after.items()}
        print(f"{arch.name} / {slo_name}: {report.format_sweep(record)}", flush=True)
        print(f"{arch.name} / {slo_name}: prompts computed by route: "
              + ", ".join(f"{route} {n}" for route, n in sorted(record["prompt_routes"].items())), flush=True)
        runs = [p.result for p in sweep.probes]
        plot_dir = args.out_dir / f"{_slug(arch.name)}-{slo_name}"
        report.write_plots(plot_dir, runs, args.attainment, slo)
        record["runs"] = [report.run_record(r) for r in runs]
        result["sweeps"][slo_name] = record
    return result


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-")


def _architectures(p: argparse.ArgumentParser, text: str) -> list[Architecture]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ARCHITECTURES] or ([] if keys else ["(none)"])
    if unknown:
        p.error(f"--architectures: unknown architecture {unknown[0]!r} ({', '.join(ARCHITECTURES)})")
    return [ARCHITECTURES[k] for k in keys]


def _summary_lines(results: dict[str, dict], slos: dict[str, Slo], attainment: float) -> list[str]:
    """Each SLO's goodput per architecture, each over colocated's, and each hybrid against the better
    pure mode (its goal: at least the better of them under a tight SLO, above both when balanced)."""
    lines = [f"goodput per device (req/s/core, attainment >= {attainment:g}):"]
    for slo_name, slo in slos.items():
        goodput = {key: r["sweeps"][slo_name]["goodput_per_device"] or 0.0 for key, r in results.items()}
        base = goodput.get("colocated")
        cells = [f"{key} {value:.3g}" + (f" ({value / base:.2f}x)" if base and key != "colocated" else "")
                 for key, value in goodput.items()]
        line = f"  {slo_name:10s} (TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s:g} s): " + ", ".join(cells)
        pure = [v for k, v in goodput.items() if k in ("colocated", "disaggregated")]
        best = max(pure, default=None)
        for hybrid in (k for k in goodput if k.startswith("hybrid") and best is not None):
            line += f"; {hybrid}/best pure {goodput[hybrid] / best:.2f}x" if best else "; no pure mode met the SLOs"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    architectures = _architectures(p, args.architectures)
    model_dir = str(args.model_dir or ensure_model("llama", "smol135m", "bfloat16"))
    slos = {"tpot-tight": _slo(args.tpot_tight), "ttft-tight": _slo(args.ttft_tight), "balanced": _slo(args.balanced)}
    results = {arch.key: _measure(arch, args, model_dir, slos) for arch in architectures}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) for k, v in vars(args).items()}
    (args.out_dir / "results.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
    print("\n" + "\n".join(_summary_lines(results, slos, args.attainment)))
    if "disaggregated" in results:
        share = results["disaggregated"]["kv_share"]
        print(f"KV transfer left after token 1: {share['kv_transfer_after_token1_s'] * 1e3:.1f} ms = "
              f"{share['share_of_ttft']:.3f} of TTFT ({share['prompt_len']}-token prompt)")
    print(f"results: {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
