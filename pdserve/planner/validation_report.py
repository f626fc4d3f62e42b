"""`pdserve plan --validate`'s report: predicted against measured, as a table and as JSON.

A row per validated candidate: its predicted and measured goodput and their error, the P90s at
the predicted rate on both sides, the rounds' goodputs and their spread, and how fast its nodes'
steps ran against the profile (pdserve/planner/step_speed.py): an error its steps' speed explains
is the profile's (it was measured at another hour, or alone on the machine), not the simulator's.

Must never: measure anything (pdserve/planner/validate.py does).
"""

from __future__ import annotations

from pdserve.bench.serve.metrics import Summary
from pdserve.planner.cpu_witness import SUSPECT_SHARE
from pdserve.planner.stack_use import short_text as stack_text
from pdserve.planner.step_speed import short_text
from pdserve.planner.validate import (
    Measurement, Validation, median_abs_goodput_error, median_spread, recommended_share_of_best,
)


def _p90(summary: Summary | None, field: str) -> float | None:
    dist = getattr(summary, field) if summary is not None else None
    return None if dist is None else dist.p90


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def validation_record(v: Validation) -> dict:
    predicted = v.evaluated.prediction.run.summary
    return {
        "layout": v.evaluated.candidate.layout.describe(),
        "predicted_goodput_rps": v.predicted_goodput_rps,
        "measured_goodput_rps": v.measured_goodput_rps,
        "measured_below_rps": v.measured_below_rps,
        "goodput_error": v.goodput_error,
        "goodput_error_is_a_lower_bound": v.error_is_a_bound,
        "measured_spread": v.spread,
        "cpu_taken_share": v.taken_share,
        "suspect": v.suspect,
        "measured_converged": v.rounds[0].sweep.converged,
        "at_predicted_rate": {
            "ttft_p90_s": {"predicted": _p90(predicted, "ttft_s"), "measured": _p90(v.at_predicted_rate, "ttft_s")},
            "tpot_p90_s": {"predicted": _p90(predicted, "tpot_s"), "measured": _p90(v.at_predicted_rate, "tpot_s")},
            "attainment": {"predicted": predicted.attainment,
                           "measured": None if v.at_predicted_rate is None else v.at_predicted_rate.attainment},
        },
        "step_speeds": _speeds_record(v.speeds),
        "stack_speeds": _speeds_record(v.stack),
        "predicted_at_step_speeds_rps": v.predicted_at_speeds_rps,
        "goodput_error_at_step_speeds": v.error_at_speeds,
        "probes": _probes(v.rounds[0]),  # the first round's: the one sweep of reports from before rounds
        "rounds": [{"measured_goodput_rps": m.goodput_rps, "probes": _probes(m),
                    "cpu": None if m.cpu is None else m.cpu.record(), "step_speeds": _speeds_record(m.speeds),
                    "stack_speeds": _speeds_record(m.stack)}
                   for m in v.rounds],
    }


def _at_speeds(v: Validation) -> str:
    if v.predicted_at_speeds_rps is None:
        return "-"
    return f"{v.predicted_at_speeds_rps:.3g} ({'≥' if v.error_is_a_bound else ''}{_pct(v.error_at_speeds)})"


def _speeds_record(speeds: dict) -> dict:
    return {kind: speed.record() for kind, speed in speeds.items()}


def _probes(m: Measurement) -> list[dict]:
    return [{"rate": p.rate, "attainment": p.result.attainment, "passed": p.passed} for p in m.sweep.probes]


def report_record(validations: list[Validation]) -> dict:
    return {"candidates": [validation_record(v) for v in validations],
            "median_abs_goodput_error": median_abs_goodput_error(validations),
            "median_abs_goodput_error_at_step_speeds": median_abs_goodput_error(validations, at_speeds=True),
            "median_measured_spread": median_spread(validations),
            "recommended_share_of_best_measured": recommended_share_of_best(validations)}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def rounds_text(goodputs: list[float], spread: float | None) -> str:
    """A candidate's measured goodput by round and their spread, as the reports print them."""
    return ", ".join(f"{g:.3g}" for g in goodputs) + (" (-)" if spread is None else f" ({spread:.0%})")


def format_validation(validations: list[Validation]) -> str:
    repeated = any(len(v.rounds) > 1 for v in validations)
    rows = [("layout", "goodput pred/meas", "error", "TTFT p90 ms pred/meas", "TPOT p90 ms pred/meas",
             "steps/profile", "stack/profile", "at those: pred (error)", *(("measured by round (spread)",) if repeated else ()))]
    for v in validations:
        predicted = v.evaluated.prediction.run.summary
        ttft = (_p90(predicted, "ttft_s"), _p90(v.at_predicted_rate, "ttft_s"))
        tpot = (_p90(predicted, "tpot_s"), _p90(v.at_predicted_rate, "tpot_s"))
        measured = f"<{v.measured_below_rps:.3g}" if v.error_is_a_bound else f"{v.measured_goodput_rps:.3g}"
        measured += "*" if v.suspect else ""
        row = (v.evaluated.candidate.layout.describe(), f"{v.predicted_goodput_rps:.3g}/{measured}",
               ("≥" if v.error_is_a_bound else "") + _pct(v.goodput_error),
               f"{_ms(ttft[0])}/{_ms(ttft[1])} ({_pct(_error(*ttft))})",
               f"{_ms(tpot[0])}/{_ms(tpot[1])} ({_pct(_error(*tpot))})",
               short_text(v.speeds), stack_text(v.stack), _at_speeds(v))
        rows.append((*row, rounds_text([m.goodput_rps for m in v.rounds], v.spread)) if repeated else row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    median, share = median_abs_goodput_error(validations), recommended_share_of_best(validations)
    lines.append("median |goodput error|: " + ("-" if median is None else f"{median:.0%}") +
                 "; the recommended configuration measured " +
                 ("-" if share is None else f"{share:.0%}") + " of the best measured goodput per device")
    at_speeds = median_abs_goodput_error(validations, at_speeds=True)
    if at_speeds is not None:
        again = median_abs_goodput_error([v for v in validations if v.error_at_speeds is not None])
        lines.append(f"median |goodput error| predicted again at the step speeds and stack CPU measured: "
                     f"{at_speeds:.0%}, against {again:.0%} as first predicted for the same candidates (what is left "
                     "is the simulator's; the rest was the profile's)")
    spread = median_spread(validations)
    if spread is not None:
        lines.append(f"median spread of the measured goodput over its rounds: {spread:.0%} "
                     "(an error under it is within the runs' own variation)")
    if any(v.suspect for v in validations):
        lines.append(f"(*: steal or processes outside the cluster took {SUSPECT_SHARE:.0%} or more of the machine's "
                     "CPU while it was measured; its error is the machine's as much as the plan's)")
    if any(v.error_is_a_bound for v in validations):
        lines.append("(<R: no probed rate met the target, the lowest to fail was R; the error shown, and counted "
                     "in the median, is the least it can be)")
    lines.append("(error = (predicted - measured) / measured, measured = the median of the rounds; "
                 "P90s at the predicted goodput rate, in the first round; steps/profile: the CPU seconds of each "
                 "kind of node's steps (Colocated, Prefill, Decode) over what the profile predicts for them, above 1 "
                 "slower than profiled; stack/profile: the CPU of the Router, the node Fronts and the Client over what "
                 "the profile's costs give for the requests and tokens served)")
    return "\n".join(lines)
