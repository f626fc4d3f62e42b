"""`pdserve plan --validate K`: the plan's own error, measured — predicted against real runs.

The top K candidates of the ranking and a few others (the best-ranked candidates of layouts
not yet chosen, so that a validation also sees the modes the plan turned down) are each started
for real with the command line the plan prints (`pdserve cluster`, as users run it), then
warmed up and swept by `pdserve bench serve` in a process of its own, as users measure (its
command line is logged: a user can run it again): the same workload, arrivals, run length
(pdserve/planner/goodput.py's `Traffic`), SLOs, attainment target and bisection the prediction used.
A prediction and its measurement therefore differ only in what produced the traces.

The client is not run in this process: here it would share an interpreter with everything the
search left, and its garbage collections (measured on an AMX machine: 340k objects, 148 ms a full
collection) paused it mid-probe, so that it read responses late and the cluster looked slower
than it was (colocated x2 at 26 req/s: attainment 0.42 measured from here, 1.0 from a
`pdserve bench serve` of its own).

A measurement has its own spread: on a shared machine the same layout's goodput moves from one
run to the next (measured here: 8.65 req/s, then no rate passing down to 5.2, an hour apart).
`repeats` measures every chosen candidate that many times, in rounds — each candidate once,
then each again — so a slow spell falls on every layout, not on one. A candidate's measured
goodput is the median of its rounds, and the report gives their spread beside the error: an
error smaller than the spread is not one the runs can show.

Each round also reads how fast the nodes' steps ran against the profile (each node's step sums,
asked of it before and after the sweep, pdserve/planner/step_speed.py) and how much CPU the router,
the node fronts and the client took against the profile's costs for the requests and tokens served
(pdserve/planner/stack_use.py): a profile measured at another hour, or alone on the machine, or a
client busier than the profile's, shows there, apart from the simulator's own error. The window is
the client's whole run, its few warm-up requests among the hundreds it sends.

Each round's sweep is watched for what else took the machine's CPU while it ran (steal, and
processes outside the plan's own tree: pdserve/planner/cpu_witness.py); the report marks a
measurement during which that reached `SUSPECT_SHARE` of the machine, whose error is the
machine's as much as the plan's.

A validated plan hands over what was measured best (`validated_choice`), not what was ranked first:
the measurement is the better evidence where the two disagree by more than the runs' own spread
and the share of the machine other work took while the first was measured. The prediction still
ranks what the runs cannot tell apart.

What a validation measured is kept (`ValidationPlan.validation_log`, pdserve/planner/track_record.py): later
plans on the same model and machine print it under their tables as their error bar.

The sweep starts at the predicted goodput, so its first probe also measures the P90s at the
predicted rate: the latency error is read there, at the same rate on both sides. It moves from
there by a quarter (`GROWTH`), not by doubling: a prediction within 25% of the truth is
bracketed by its next probe, 20–25% wide, and each probe after halves that, so a budget of a
few probes measures the goodput to a few percent, where doubling left brackets of 15–25%.

Must never: rank the candidates (that is pdserve/planner/search.py's), or leave a cluster running.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from pdserve.bench.serve.metrics import Slo, Summary
from pdserve.bench.serve.sweep import Probe, SweepConfig, SweepResult
from pdserve.cluster_process import ClusterProcess
from pdserve.common.affinity import threads_pinned_to
from pdserve.planner.calibration import digest, pool_key
from pdserve.planner.cpu_witness import SUSPECT_SHARE, CpuUse, CpuWitness
from pdserve.planner.profile import ServingCosts
from pdserve.planner.search import Evaluated
from pdserve.planner.step_cost import StepCost
from pdserve.planner.stack_use import StackSpeed, stack_scales
from pdserve.planner.stack_use import short_text as stack_text
from pdserve.planner.step_speed import StepSpeed, describe_speeds, step_scales, summed
from pdserve.planner.track_record import Checked, ValidationLog
from pdserve.planner.validation_inputs import Readings, step_speeds

WARMUP_REQUESTS = 4  # every node's first shapes (kernel builds, allocator growth) before any probe
GROWTH = 1.25  # the sweep's step from the predicted rate: × 1.25 up after a pass, ÷ 1.25 down after a miss


def chosen(results: list[Evaluated], top: int, others: int) -> list[Evaluated]:
    """The first `top` of the ranking, then the best-ranked candidate of each layout not yet
    chosen, in ranking order, until `others` more are chosen."""
    picked = list(results[:top])
    layouts = {e.candidate.layout for e in picked}
    for e in results[top:]:
        if len(picked) >= top + others:
            break
        if e.candidate.layout not in layouts:
            picked.append(e)
            layouts.add(e.candidate.layout)
    return picked


def close_calls(results: list[Evaluated], error: float) -> tuple[list[Evaluated], int]:
    """The best-ranked candidate of each layout but the first's, in ranking order, predicted within
    `error` (a fraction: the plans' measured median |error|) of the first's goodput per device: the
    ones a prediction this good cannot rank against it. With them, the `--validate-others` that
    measures them all beside the first (the ranking puts near ties by their headroom, so one outside
    may come before the last of them)."""
    if not results or results[0].goodput_per_device <= 0:
        return [], 0
    floor = results[0].goodput_per_device * (1 - error)
    others = chosen(results, 1, len(results))[1:]
    close = [e for e in others if e.goodput_per_device >= floor and e.goodput_per_device > 0]
    return close, (others.index(close[-1]) + 1 if close else 0)


@dataclass(frozen=True)
class Measurement:
    """One round's sweep of one candidate."""

    goodput_rps: float  # 0 when no probed rate met the target
    at_predicted_rate: Summary | None  # the real run at the predicted goodput (None: nothing was predicted)
    sweep: SweepResult[Summary]
    cpu: CpuUse | None = None  # where the machine's CPU went while the sweep ran (None: not watched)
    speeds: dict[str, StepSpeed] = field(default_factory=dict)  # each kind of node's steps over the sweep
    stack: dict[str, StackSpeed] = field(default_factory=dict)  # the router's, the fronts', the client's CPU


@dataclass(frozen=True)
class Validation:
    evaluated: Evaluated
    rounds: tuple[Measurement, ...]  # in the order they ran; at least one
    # The goodput predicted again with each pool's steps as slow, and the stack's CPU as costly, as
    # the rounds measured them (`speeds`, `stack`); None: not predicted again (too little ran to
    # tell). What is left of the error then is the simulator's, not the profile's.
    predicted_at_speeds_rps: float | None = None

    @property
    def speeds(self) -> dict[str, StepSpeed]:
        """Each kind of node's steps over every round, as one."""
        return summed([m.speeds for m in self.rounds])

    @property
    def stack(self) -> dict[str, StackSpeed]:
        """Each kind of stack process's CPU over every round, as one."""
        return summed([m.stack for m in self.rounds])

    @property
    def predicted_goodput_rps(self) -> float:
        return self.evaluated.prediction.goodput_rps

    @property
    def measured_goodput_rps(self) -> float:
        """The median over the rounds (0 when none passed a rate)."""
        return statistics.median(m.goodput_rps for m in self.rounds)

    @property
    def measured_per_device(self) -> float:
        return self.measured_goodput_rps / self.evaluated.candidate.layout.devices

    @property
    def spread(self) -> float | None:
        """(highest - lowest) / median of the rounds' goodputs; None with one round or a zero median."""
        goodputs = [m.goodput_rps for m in self.rounds]
        median = self.measured_goodput_rps
        if len(goodputs) < 2 or median <= 0:
            return None
        return (max(goodputs) - min(goodputs)) / median

    @property
    def at_predicted_rate(self) -> Summary | None:
        """The first round's run at the predicted rate: where the P90s are compared."""
        return self.rounds[0].at_predicted_rate

    @property
    def measured_below_rps(self) -> float | None:
        """Where no rate passed (a zero median): the goodput lies below the lowest rate that failed
        in those rounds (the highest such, when several did); None otherwise."""
        if self.measured_goodput_rps > 0:
            return None
        failed = [m.sweep.failed_rate for m in self.rounds if m.goodput_rps <= 0 and m.sweep.failed_rate]
        return max(failed) if failed else None

    @property
    def goodput_error(self) -> float | None:
        """(predicted - measured) / measured. Where no rate passed, the least it can be, against
        `measured_below_rps` (`error_is_a_bound`): such a candidate counts in the median error,
        never out of it. None when nothing was measured at all."""
        return self._error_of(self.predicted_goodput_rps)

    @property
    def error_at_speeds(self) -> float | None:
        """`goodput_error` of `predicted_at_speeds_rps`."""
        return None if self.predicted_at_speeds_rps is None else self._error_of(self.predicted_at_speeds_rps)

    def _error_of(self, predicted: float) -> float | None:
        measured = self.measured_goodput_rps or self.measured_below_rps
        if not measured:
            return None
        return (predicted - measured) / measured

    @property
    def error_is_a_bound(self) -> bool:
        return self.measured_goodput_rps <= 0 and self.measured_below_rps is not None

    @property
    def taken_share(self) -> float | None:
        """The most any round's sweep lost of the machine's CPU to steal and other processes
        (None: no round was watched)."""
        shares = [m.cpu.taken_share for m in self.rounds if m.cpu is not None]
        return max(shares) if shares else None

    @property
    def suspect(self) -> bool:
        return self.taken_share is not None and self.taken_share >= SUSPECT_SHARE


@dataclass(frozen=True)
class ValidationPlan:
    """How each chosen candidate is measured."""

    workload_flags: tuple[str, ...]  # `pdserve bench serve`'s workload and arrival flags: the plan's traffic
    slo: Slo
    sweep: SweepConfig  # the prediction's own target, tolerance and probe budget
    dtype: str  # the plan's, resolved: the command line names it
    block_size: int
    repeats: int = 1  # rounds: each candidate measured this many times, one round after the other
    timeout_s: float = 600.0
    validation_log: ValidationLog | None = None  # where the measured errors are kept (None: nowhere)
    # The profiles' step models by (cores, TP): what a node's steps are compared with.
    step_costs: dict[tuple[int, int], StepCost] = field(default_factory=dict)
    # The serving stack's costs the prediction charged, by the router's --stream-interval.
    stack_costs: dict[int, ServingCosts] = field(default_factory=dict)
    calibrated: bool = False  # the predictions were made with `--calibrate`


def validate(candidates: list[Evaluated], model: str, plan: ValidationPlan, log=print) -> list[Validation]:
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rounds: list[list[Measurement]] = []
    for number in range(1, plan.repeats + 1):
        if plan.repeats > 1:
            log(f"validate: round {number} of {plan.repeats}")
        rounds.append([_measure(e, model, plan, log) for e in candidates])
    validations = [Validation(e, tuple(r[i] for r in rounds)) for i, e in enumerate(candidates)]
    if plan.validation_log is not None:
        try:
            plan.validation_log.add(checked for v in validations
                                    if (checked := checked_record(v, when, plan)) is not None)
        except OSError as err:  # the validation stands without its record
            log(f"validate: could not keep this validation's errors in {plan.validation_log.path}: {err}")
    return validations


def at_measured_inputs(validations: list[Validation],
                       repredict: Callable[[Evaluated, dict[str, float], dict[str, float]], float]) -> list[Validation]:
    """Each validation with its goodput predicted again (`repredict(candidate, step scales, stack
    scales)`) at the step speeds and the stack's CPU its rounds measured, where they measured any."""
    out = []
    for v in validations:
        steps, stack = step_scales(v.speeds), stack_scales(v.stack)
        out.append(replace(v, predicted_at_speeds_rps=repredict(v.evaluated, steps, stack)) if steps or stack else v)
    return out


def checked_record(v: Validation, when: str, plan: ValidationPlan) -> Checked | None:
    """What the track record keeps of a validated candidate (None: nothing was measured)."""
    if v.goodput_error is None:
        return None
    layout, interval = v.evaluated.candidate.layout, v.evaluated.candidate.knobs.stream_interval
    steps = {pool_key(kind, layout.pool_setup(kind)): scale for kind, scale in step_scales(v.speeds).items()}
    stack = stack_scales(v.stack)
    # What each was measured against: the setup's step model, the stack's costs at its interval.
    inputs = {pool_key(kind, layout.pool_setup(kind)): digest(plan.step_costs[layout.pool_setup(kind)])
              for kind in step_scales(v.speeds)}
    inputs.update({role: digest(plan.stack_costs[interval]) for role in stack})
    return Checked(when, layout.mode, layout.describe(), v.predicted_goodput_rps, v.goodput_error,
                   v.error_is_a_bound, v.suspect, steps, stack, inputs, plan.calibrated)


def client_argv(router: str, predicted_rps: float, plan: ValidationPlan, output: Path, devices: int = 1) -> list[str]:
    """The `pdserve bench serve` that sweeps one candidate of `devices` devices: from the predicted
    goodput (unset: the plan's own start), by `GROWTH`, with the plan's workload, SLOs, target and
    probe budget."""
    sweep = plan.sweep
    start = predicted_rps if predicted_rps > 0 else sweep.start_rate
    slos = [arg for flag, value in (("--ttft-slo", plan.slo.ttft_s), ("--tpot-slo", plan.slo.tpot_s))
            if value is not None for arg in (flag, repr(value))]
    return [sys.executable, "-m", "pdserve", "bench", "serve", "--addr", router, "--sweep", *plan.workload_flags,
            "--warmup-requests", str(WARMUP_REQUESTS), *slos,
            "--attainment", repr(sweep.target_attainment), "--start-rate", repr(start), "--growth", repr(GROWTH),
            "--tolerance", repr(sweep.tolerance), "--max-probes", str(sweep.max_probes),
            "--timeout-s", repr(plan.timeout_s), "--devices", str(devices), "--no-progress", "--output-json", str(output)]


def _measure(e: Evaluated, model: str, plan: ValidationPlan, log) -> Measurement:
    command = e.candidate.command(model, plan.dtype, plan.block_size)
    layout = e.candidate.layout.describe()
    log(f"validate: starting {layout}: {' '.join(command)}")
    with tempfile.TemporaryDirectory(prefix="pdserve-validate-") as workdir:
        output = Path(workdir) / "bench.json"
        # command[:2] is "pdserve cluster"; ClusterProcess runs the same program with its own ports.
        # The client is a process of its own, as users run it (in this one it would share an
        # interpreter, and a garbage collector, with the search's objects), started on the cores the
        # plan pinned the router to: where the simulator charged its CPU. It inherits this thread's.
        with (ClusterProcess([*command[2:], "--http-port", "0", "--metrics-port", "0"], workdir) as cluster,
              threads_pinned_to(e.candidate.layout.router_cores)):
            argv = client_argv(cluster.router, e.prediction.goodput_rps, plan, output, e.candidate.layout.devices)
            log(f"validate: {layout}: {shlex.join(argv[2:])}")
            before = Readings.take(cluster, log)
            witness = CpuWitness()  # this process's tree: the cluster and the client
            witness.start()
            _run_client(argv, lambda line: log(f"validate: {layout}: {line}"))
            cpu = witness.stop()
            after = Readings.take(cluster, log)
        log(f"validate: {layout}: {cpu_text(cpu)}")
        measured = measurement(json.loads(output.read_text()), e.prediction.goodput_rps, cpu)
        if before is None or after is None:
            return measured
        speeds = step_speeds(before.steps, after.steps, e.candidate.layout, plan.step_costs)
        stack = after.stack_against(before, plan.stack_costs.get(e.candidate.knobs.stream_interval))
        log(f"validate: {layout}: its steps against the profile: {describe_speeds(speeds)}; the stack's CPU against "
            f"the profile's: {stack_text(stack)}")
        return replace(measured, speeds=speeds, stack=stack)


def cpu_text(cpu: CpuUse) -> str:
    text = (f"while it was measured, steal took {cpu.steal_s / cpu.capacity_s:.0%} and processes outside the "
            f"cluster and its client {cpu.others_s / cpu.capacity_s:.0%} of the machine's CPU time"
            if cpu.capacity_s > 0 else "no CPU time passed while it was measured")
    return text + (" (suspect: its measured goodput is the machine's as much as the plan's)" if cpu.suspect else "")


def _run_client(argv: list[str], log) -> None:
    """Run `pdserve bench serve`, its report lines to `log` as they come."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True) as client:
        try:
            for line in client.stdout:
                if line.strip():
                    log(line.rstrip())
        except BaseException:  # Ctrl-C: the client goes with the cluster, not after its last probe
            client.kill()
            raise
    if client.returncode != 0:
        raise ChildProcessError(f"validate: `pdserve bench serve` exited with {client.returncode} "
                                "(its output is above)")


def measurement(doc: dict, predicted_rps: float, cpu: CpuUse | None = None) -> Measurement:
    """One round's measurement from the JSON a `pdserve bench serve --sweep` wrote: its runs are
    its probes, in order; the one at the predicted rate (the first, where one was predicted) is
    where the P90s are compared."""
    record = doc["sweep"]
    summaries = [Summary.from_record(run["summary"]) for run in doc["runs"]]
    probes = [Probe(p["rate"], summary, p["passed"]) for p, summary in zip(record["probes"], summaries, strict=True)]
    sweep = SweepResult(record["goodput"], record["failed_rate"], probes, record["converged"])
    at_predicted = next((p.result for p in probes if p.rate == predicted_rps), None) if predicted_rps > 0 else None
    return Measurement(sweep.best_rate or 0.0, at_predicted, sweep, cpu)


# -- what the rounds say -----------------------------------------------------------------------
def median_abs_goodput_error(validations: list[Validation], at_speeds: bool = False) -> float | None:
    """Over the candidates measured; `at_speeds`: of the predictions at the measured step speeds,
    over those predicted again."""
    found = [v.error_at_speeds if at_speeds else v.goodput_error for v in validations]
    errors = [abs(e) for e in found if e is not None]
    return statistics.median(errors) if errors else None


def median_spread(validations: list[Validation]) -> float | None:
    """The median of the candidates' spreads over their rounds (None with one round)."""
    spreads = [v.spread for v in validations if v.spread is not None]
    return statistics.median(spreads) if spreads else None


def measured_best(validations: list[Validation]) -> Validation | None:
    """The candidate that served the most per device (of equals, the first-ranked); None when none
    passed a rate."""
    best = max(validations, key=lambda v: v.measured_per_device, default=None)
    return best if best is not None and best.measured_per_device > 0 else None


def recommended_share_of_best(validations: list[Validation]) -> float | None:
    """The recommended (first-ranked) candidate's measured goodput over the best measured one's."""
    best = measured_best(validations)
    return None if best is None else validations[0].measured_per_device / best.measured_per_device


def validated_choice(validations: list[Validation]) -> Validation | None:
    """What a validated plan hands over: the best measured, unless the first-ranked measured within
    the two's own spread over their rounds of it (the runs cannot tell them apart, so the ranking
    stands); the share of the machine other work took while the first was measured widens that
    margin (it was slowed by as much, not shown to be worse). With one round the spread is not
    known and the measurement decides. None when no candidate passed a rate: the prediction is all
    there is."""
    best = measured_best(validations)
    if best is None:
        return None
    first = validations[0]
    margin = max((s for s in (first.spread, best.spread, first.taken_share) if s is not None), default=0.0)
    return first if first.measured_per_device >= best.measured_per_device * (1 - margin) else best
