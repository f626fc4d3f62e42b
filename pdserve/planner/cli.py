"""`pdserve plan`: from a workload and two SLOs to the `pdserve cluster` command that serves it best.

    pdserve plan --model DIR --devices N --ttft-slo S --tpot-slo S [--attainment 0.9] \\
        [--workload fixed|uniform|chat|jsonl ...] [--output-json F] [--validate K]

Profiles each node configuration the search needs (cached: `pdserve profile`), simulates every
candidate on N devices under the workload (pdserve/planner/search.py, pdserve/planner/simulator.py), predicts
its goodput per device and its TTFT/TPOT at that rate, prints a ranked table and the command
line of the best, under it the measured error of the plans validated before on this model and
machine (pdserve/planner/track_record.py). SLOs that no candidate meets are refused in one line naming
the best figures attainable (exit 2). A plan that recommends, with a record, also names the layouts
predicted within its error of the best (close calls that only a measurement can rank). `--validate K` then runs the top K and a
few others for real, prints the plan's measured error (pdserve/planner/validate.py), adds it to that
record and ends with the candidate the measurement chose (`validated_choice`). Beside each error it
prints the goodput predicted again at the step speeds and the stack's CPU the runs measured
(`at_measured_inputs`, pdserve/planner/step_speed.py, pdserve/planner/stack_use.py): the share of the
error that was the profile's. Owns the flags, their
checks and the output; decides nothing itself.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.sweep import SweepConfig
from pdserve.bench.serve.workload_flags import (
    DEFAULT_NUM_REQUESTS, add_arrival_args, add_workload_args, build_workload, check_workload_args, workload_argv,
)
from pdserve.bench.serve.workloads import ModelLimits, RequestSpec
from pdserve.common.refusal import Refused
from pdserve.engine.config import DEFAULT_BLOCK_SIZE, DTYPE_NAMES, EngineConfig
from pdserve.planner.calibration import Calibration, current_inputs
from pdserve.planner.goodput import Traffic
from pdserve.planner.profile import ClientCost, Profile, ProfileCache, model_hash
from pdserve.planner.profile_cli import default_model, int_list, profiles_for, serving_costs_for
from pdserve.planner.search import (
    DEFAULT_LOCAL_PREFILL_MAX_TOKENS, Candidate, Evaluated, Knobs, evaluate, layouts, ranked, with_prompt_budgets,
)
from pdserve.planner.stack_use import scaled_costs
from pdserve.planner.track_record import TrackRecord, ValidationLog, record_key
from pdserve.planner.validate import (
    Validation, ValidationPlan, at_measured_inputs, chosen, close_calls, measured_best, validate, validated_choice,
)
from pdserve.planner.validation_report import format_validation, report_record


NAMED_CLOSE_CALLS = 3  # the plan's line names the best-ranked few; the count covers the rest


class Unattainable(Refused):
    """No candidate meets the SLOs at any rate probed."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the built-in demo model)")
    p.add_argument("--devices", type=int, required=True, help="devices to plan for (cores on CPU: 0..N-1)")
    slo = p.add_argument_group("SLOs")
    slo.add_argument("--ttft-slo", type=float, help="seconds (unset: any TTFT meets it)")
    slo.add_argument("--tpot-slo", type=float, help="seconds (unset: any TPOT meets it)")
    slo.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both")
    add_arrival_args(p, duration=False, min_duration_s=30.0)
    add_workload_args(p)
    space = p.add_argument_group("search space")
    space.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    space.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    space.add_argument("--batched-tokens", type=int_list("--batched-tokens"), default=[256, 512, 1024],
                       help="--max-num-batched-tokens values to try (comma-separated)")
    space.add_argument("--max-num-seqs", type=int_list("--max-num-seqs"), default=[64],
                       help="--max-num-seqs values to try (comma-separated)")
    space.add_argument("--chunk-schedules", default="fixed",
                       help="--chunk-schedule values to try (comma-separated: fixed, staged, target-step)")
    space.add_argument("--local-prefill-max-tokens", type=int_list("--local-prefill-max-tokens"),
                       default=[DEFAULT_LOCAL_PREFILL_MAX_TOKENS],
                       help="every prefill/decode split is also tried as the hybrid (decode nodes with "
                            "--local-prefill, the router at --disaggregation auto) with each of these bounds "
                            "(comma-separated; default: the router's)")
    space.add_argument("--no-hybrid", action="store_true", help="leave the hybrid splits out of the search")
    space.add_argument("--stream-intervals", type=int_list("--stream-intervals"), default=[1],
                       help="the router's --stream-interval values to try (comma-separated tokens per response; "
                            "above 1 the serving stack's CPU per token falls, measured at each by the profile, "
                            "and a client sees tokens in bursts; default: 1, every token its own response)")
    space.add_argument("--tp", type=int_list("--tp"), default=[1],
                       help="tensor-parallel sizes to try for each pool (comma-separated; each where it divides "
                            "the pool's cores per node and the model's shapes split; a missing profile is measured)")
    search = p.add_argument_group("goodput search (per candidate, on simulated runs)")
    search.add_argument("--tolerance", type=float, default=0.02,
                        help="stop when the bracket is this fraction (a prediction is the bracket's low end: "
                             "this is its own resolution, well under the error the validation measures)")
    search.add_argument("--max-probes", type=int, default=12, help="simulated runs per candidate at most")
    search.add_argument("--calibrate", action="store_true",
                        help="scale each pool's steps and the serving stack's CPU by the medians earlier "
                             "validations of this model on this machine measured (the plan prints them; "
                             "a pool setup never validated keeps the profile's steps)")
    check = p.add_argument_group("validation (runs clusters for real: minutes per candidate)")
    check.add_argument("--validate", type=int, default=0, metavar="K",
                       help="start the top K candidates and --validate-others more for real, sweep each with "
                            "`pdserve bench serve` (a process of its own) and print predicted vs measured "
                            "goodput and P90s")
    check.add_argument("--validate-others", type=int, default=2, metavar="M",
                       help="with --validate: the best-ranked candidates of M more layouts")
    check.add_argument("--validate-probes", type=int, default=6,
                       help="with --validate: real runs per candidate's sweep at most")
    check.add_argument("--validate-repeats", type=int, default=1, metavar="R",
                       help="with --validate: measure every chosen candidate R times, in rounds, and compare "
                            "the prediction with the median; the report gives the rounds' spread")
    check.add_argument("--client-here", action="store_true",
                       help="predict for a load generator on this machine: its CPU (measured by `pdserve profile`) "
                            "comes out of the nodes' cores, as the router's and the node fronts' does. "
                            "--validate implies it (its client runs here)")
    out = p.add_argument_group("output")
    out.add_argument("--output-json", type=Path)
    out.add_argument("--profile-dir", help="where profiles are cached (default: <pdserve cache>/profiles)")
    out.add_argument("--no-progress", action="store_true")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[Knobs]:
    check_workload_args(p, args)
    if args.devices < 1:
        p.error("--devices must be >= 1")
    if args.ttft_slo is None and args.tpot_slo is None:
        p.error("give --ttft-slo and/or --tpot-slo")
    for flag, value in (("--ttft-slo", args.ttft_slo), ("--tpot-slo", args.tpot_slo)):
        if value is not None and not value > 0:
            p.error(f"{flag} must be > 0 seconds, got {value}")
    if not 0 < args.attainment <= 1:
        p.error(f"--attainment must be in (0, 1], got {args.attainment}")
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    if not 0 < args.tolerance < 1:
        p.error(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if args.max_probes < 2:
        p.error("--max-probes must be >= 2")
    if args.validate < 0 or args.validate_others < 0:
        p.error("--validate and --validate-others must be >= 0")
    if args.validate_probes < 2:
        p.error("--validate-probes must be >= 2")
    if args.validate_repeats < 1:
        p.error(f"--validate-repeats must be >= 1, got {args.validate_repeats}")
    schedules = [s.strip() for s in args.chunk_schedules.split(",") if s.strip()]
    bad = [s for s in schedules if s not in ("fixed", "staged", "target-step")] or ([] if schedules else ["(none)"])
    if bad:
        p.error(f"--chunk-schedules: unknown schedule {bad[0]!r} (fixed, staged, target-step)")
    knobs = [Knobs(b, s, c, n) for b in args.batched_tokens for s in args.max_num_seqs for c in schedules
             for n in sorted(set(args.stream_intervals)) if b >= s]
    if not knobs:
        p.error("--batched-tokens: every value is below every --max-num-seqs (a step must fit every decode)")
    return knobs


def _traffic(args: argparse.Namespace, model: str, profile: Profile) -> Traffic:
    workload = build_workload(args, ModelLimits(profile.vocab_size, profile.max_model_len))
    tokenize = _tokenizer(model) if args.workload == "jsonl" else None

    def request(i: int) -> tuple[tuple[int, ...], int]:
        spec: RequestSpec = workload.request(i)
        ids = spec.token_ids if spec.token_ids is not None else tuple(tokenize(spec.text))
        return ids[: profile.max_model_len - 1], spec.output_len

    return Traffic(request, args.num_requests or DEFAULT_NUM_REQUESTS, args.min_duration_s,
                   1.0 if args.cv is None else args.cv, args.seed)


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]


def candidate_record(e: Evaluated, model: str, dtype: str, block_size: int) -> dict:
    s = e.prediction.run.summary
    lay, knobs = e.candidate.layout, e.candidate.knobs
    return {
        "mode": lay.mode, "layout": lay.describe(), "devices": lay.devices,
        "knobs": {"max_num_batched_tokens": knobs.max_num_batched_tokens, "max_num_seqs": knobs.max_num_seqs,
                  "chunk_schedule": knobs.chunk_schedule, "stream_interval": knobs.stream_interval},
        "command": e.candidate.command(model, dtype, block_size),
        "predicted_goodput_rps": e.prediction.goodput_rps,
        "predicted_goodput_per_device": e.goodput_per_device,
        "predicted": {"rate": e.prediction.run.rate, "attainment": s.attainment,
                      "ttft_p50_s": s.ttft_s.p50 if s.ttft_s else None, "ttft_p90_s": s.ttft_s.p90 if s.ttft_s else None,
                      "tpot_p50_s": s.tpot_s.p50 if s.tpot_s else None, "tpot_p90_s": s.tpot_s.p90 if s.tpot_s else None},
        "probes": e.prediction.probes, "converged": e.prediction.converged,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_table(results: list[Evaluated]) -> str:
    rows = [("#", "layout", "tokens", "seqs", "chunks", "stream", "goodput/s", "per dev", "TTFT p50/p90 ms",
             "TPOT p50/p90 ms", "attain")]
    for i, e in enumerate(results, start=1):
        s, k = e.prediction.run.summary, e.candidate.knobs
        ttft = f"{_ms(s.ttft_s.p50 if s.ttft_s else None)}/{_ms(s.ttft_s.p90 if s.ttft_s else None)}"
        tpot = f"{_ms(s.tpot_s.p50 if s.tpot_s else None)}/{_ms(s.tpot_s.p90 if s.tpot_s else None)}"
        rows.append((str(i), e.candidate.layout.describe(), str(k.max_num_batched_tokens), str(k.max_num_seqs),
                     k.chunk_schedule, str(k.stream_interval), f"{e.prediction.goodput_rps:.3g}",
                     f"{e.goodput_per_device:.3g}", ttft, tpot, f"{s.attainment:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def unattainable(results: list[Evaluated], devices: int, slo: Slo, target: float) -> Unattainable:
    """The refusal, naming what the best candidate attains at the lowest rate it was probed at."""
    best = max(results, key=lambda e: (e.prediction.run.summary.attainment, -e.rank_key()[1]))
    s = best.prediction.run.summary
    wanted = " and ".join(f"{name} <= {value:g} s" for name, value in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s))
                          if value is not None)
    return Unattainable(
        f"--ttft-slo/--tpot-slo: no configuration on {devices} devices meets {wanted} for {target:.0%} of "
        f"requests; the best attainable is {best.candidate.layout.describe()} with TTFT p90 "
        f"{s.ttft_s.p90 if s.ttft_s else float('nan'):.4g} s and TPOT p90 "
        f"{s.tpot_s.p90 if s.tpot_s else float('nan'):.4g} s ({s.attainment:.0%} attainment at "
        f"{best.prediction.run.rate:.3g} req/s)")


def _tp_sizes(model: str, sizes: list[int], log) -> tuple[int, ...]:
    """The asked TP sizes this model's shapes can split (pdserve/engine/model_loader.py's own check)."""
    splittable = []
    for tp in sorted(set(sizes)):
        if tp > 1:
            from pdserve.engine.model_folder import ModelRefused
            from pdserve.engine.model_loader import check_tensor_parallel  # torch: only for TP

            try:
                check_tensor_parallel(model, "auto", tp)
            except ModelRefused as err:
                log(f"note: --tp {tp} left out: {err}")
                continue
        splittable.append(tp)
    return tuple(splittable)


@dataclass(frozen=True)
class Plan:
    results: list[Evaluated]  # ranked, best first
    report: dict  # what --output-json writes
    checks: ValidationPlan  # how --validate measures the chosen candidates
    track: TrackRecord | None  # the error of the plans validated before (None: nothing was ranked)
    # A candidate's goodput predicted again with its pools' steps stretched by the first scales
    # (by pool) and its stack's CPU by the second (router, fronts, client).
    repredict: Callable[[Evaluated, dict[str, float], dict[str, float]], float]


def plan(args: argparse.Namespace, knobs: list[Knobs], log=print) -> Plan:
    model = default_model(args.model)
    bounds = () if args.no_hybrid else tuple(args.local_prefill_max_tokens)
    tp_sizes = _tp_sizes(model, args.tp, log)
    spread = list(layouts(args.devices, bounds, tp_sizes))
    if not spread:
        raise ValueError(f"--tp: no size the model can run divides the cores of any node on {args.devices} devices")
    setups = sorted({s for lay in spread for s in lay.setups})
    cache = ProfileCache(args.profile_dir)
    profiles = profiles_for(model, setups, args.dtype, args.block_size, cache, not args.no_progress, log=log)
    candidates = [Candidate(lay, k) for lay in with_prompt_budgets(spread, profiles, args.tpot_slo) for k in knobs]
    costs = {n: serving_costs_for(model, cache, log=log, stream_interval=n) for n in {k.stream_interval for k in knobs}}
    inputs = current_inputs(profiles, costs)  # as measured: what a calibration's ratios are against
    if not (args.client_here or args.validate):  # the clients run elsewhere
        costs = {n: replace(c, client=ClientCost.free()) for n, c in costs.items()}
    first = profiles[setups[0]]
    cores, most = first.machine.get("cores"), max(threads for threads, _ in setups)
    if isinstance(cores, int) and most > cores:
        log(f"note: nodes of {most} threads were profiled on a machine with {cores} cores: "
            "their step times are those of threads sharing cores")
    base = EngineConfig(model=model, dtype=first.setup.dtype, block_size=args.block_size)
    traffic = _traffic(args, model, first)
    slo = Slo(args.ttft_slo, args.tpot_slo)
    sweep = SweepConfig(args.attainment, tolerance=args.tolerance, max_probes=args.max_probes)
    validation_log = ValidationLog(cache.folder, record_key(model_hash(model), first.machine, first.setup.dtype,
                                                            args.block_size))
    calibration = Calibration.of(validation_log.read() + validation_log.read(calibrated=True), inputs) \
        if args.calibrate else None
    if calibration is not None:
        log(calibration.text())
    results = ranked([evaluate(c, base, profiles, traffic, slo, sweep, first.max_model_len,
                               *Calibration.applied(calibration, c.layout, costs[c.knobs.stream_interval]))
                      for c in tqdm(candidates, desc="simulating", unit="config", disable=args.no_progress)], slo)
    records = [candidate_record(e, model, first.setup.dtype, args.block_size) for e in results]
    best = records[0] if results and results[0].prediction.goodput_rps > 0 else None
    # The error bar: what the validations before this plan measured (this one's own is "validation").
    top = results[0].candidate.layout if results else None
    track = None if top is None else validation_log.track_record(top.mode, top.describe())
    report = {"recommended": None if best is None else {
        "command": best["command"], "mode": best["mode"], "predicted_goodput_rps": best["predicted_goodput_rps"],
        "predicted": {"ttft_p90_s": best["predicted"]["ttft_p90_s"], "tpot_p90_s": best["predicted"]["tpot_p90_s"]}},
        "candidates": records,
        # What every simulated run sent (a prediction is only comparable under the same run length).
        "traffic": {"num_requests": traffic.num_requests, "min_duration_s": traffic.min_duration_s},
        "track_record": None if track is None else track.to_json(),
        "calibration": None if calibration is None else calibration.to_json()}
    checks = ValidationPlan(tuple(workload_argv(args)), slo,
                            replace(sweep, max_probes=args.validate_probes), first.setup.dtype, args.block_size,
                            args.validate_repeats, validation_log=validation_log,
                            step_costs={setup: profile.step for setup, profile in profiles.items()}, stack_costs=costs,
                            calibrated=calibration is not None)

    def repredict(e: Evaluated, steps: dict[str, float], stack: dict[str, float]) -> float:
        c = e.candidate
        return evaluate(c, base, profiles, traffic, slo, sweep, first.max_model_len,
                        scaled_costs(costs[c.knobs.stream_interval], stack), steps).prediction.goodput_rps

    return Plan(results, report, checks, track, repredict)




def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    knobs = _check(p, args)
    try:
        log = lambda line: print(line, file=sys.stderr)  # noqa: E731 - progress, not the answer
        planned = plan(args, knobs, log=log)
        results, report, checks = planned.results, planned.report, planned.checks
        print(format_table(results))
        if planned.track is not None:
            print(planned.track.text())
            if planned.track.overall is not None and report["recommended"] is not None and not args.validate:
                print(close_calls_text(results, planned.track.overall.median_abs_error))
        choice = best = None  # the validated choice, and what measured the most (with --validate)
        if args.validate and report["recommended"] is not None:
            validations = validate(chosen(results, args.validate, args.validate_others),
                                   default_model(args.model), checks, log=log)
            validations = at_measured_inputs(validations, planned.repredict)
            print(format_validation(validations))
            report["validation"] = report_record(validations)
            choice = validated_choice(validations)
            report["validated_choice"] = None if choice is None else validated_record(choice, results, report)
            best = measured_best(validations)
        if args.output_json is not None:
            args.output_json.parent.mkdir(parents=True, exist_ok=True)
            args.output_json.write_text(json.dumps(report, indent=1))
            print(f"results: {args.output_json}")
        if report["recommended"] is None:
            raise unattainable(results, args.devices, Slo(args.ttft_slo, args.tpot_slo), args.attainment)
    except Refused as err:
        print(f"pdserve plan: {err.cli_message()}", file=sys.stderr)
        return err.exit_code
    except (ValueError, OSError) as err:  # a WorkloadError is a ValueError; a dataset that cannot be read
        print(f"pdserve plan: {err}", file=sys.stderr)
        return 2
    if choice is None:
        print(f"best: {results[0].candidate.layout.describe()}, predicted goodput "
              f"{results[0].prediction.goodput_rps:.3g} req/s ({results[0].goodput_per_device:.3g} per device)")
        print(shlex.join(report["recommended"]["command"]))
    else:
        print(choice_text(choice, report["validated_choice"]["rank"]))
        if best is not choice:
            print(f"  (#{_rank(results, best.evaluated)} {best.evaluated.candidate.layout.describe()} measured "
                  f"{best.measured_goodput_rps:.3g} req/s, a lead within the runs' spread and the other work on the "
                  "machine: the ranking stands)")
        print(shlex.join(report["validated_choice"]["command"]))
    return 0


def close_calls_text(results: list[Evaluated], error: float) -> str:
    """Which candidates the plan's measured error cannot rank below the first, and how to measure them."""
    close, others = close_calls(results, error)
    if not close:
        return f"no other layout is predicted within the measured error ({error:.0%}) of the first"
    named = ", ".join(f"#{_rank(results, c)} {c.candidate.layout.describe()}" for c in close[:NAMED_CLOSE_CALLS])
    more = len(close) - NAMED_CLOSE_CALLS
    return (f"predicted within the measured error ({error:.0%}) of the first: {named}"
            + (f" and {more} more" if more > 0 else "")
            + f"; `--validate 1 --validate-others {others}` measures them and hands over the best measured")


def _rank(results: list[Evaluated], e: Evaluated) -> int:
    """`e`'s place in the ranking, from 1."""
    return next(i for i, r in enumerate(results, start=1) if r is e)


def validated_record(choice: Validation, results: list[Evaluated], report: dict) -> dict:
    """The validated choice as --output-json writes it: the candidate's own record, its rank and what it measured."""
    rank = _rank(results, choice.evaluated)
    record = report["candidates"][rank - 1]
    return {"rank": rank, "command": record["command"], "mode": record["mode"], "layout": record["layout"],
            "predicted_goodput_rps": record["predicted_goodput_rps"],
            "measured_goodput_rps": choice.measured_goodput_rps}


def choice_text(choice: Validation, rank: int) -> str:
    what = (f"{choice.evaluated.candidate.layout.describe()}, measured goodput {choice.measured_goodput_rps:.3g} req/s "
            f"({choice.measured_per_device:.3g} per device; predicted {choice.predicted_goodput_rps:.3g})")
    if rank == 1:
        return f"best: {what}"
    unsure = "" if choice.spread is not None else (" (one round: `--validate-repeats 3` shows whether the lead is "
                                                     "more than the runs' own spread)")
    return f"best measured: {what}, ranked #{rank} by the prediction: the measurement overrules the ranking{unsure}"


if __name__ == "__main__":
    sys.exit(main())
