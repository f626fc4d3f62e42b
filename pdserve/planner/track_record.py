"""The planner's measured error, kept: every validation adds to it, every plan reports it.

A plan's predictions are as good as its simulator and the profile under it, and how good that is
differs by machine, by model and by the kind of layout (docs/benchmarks.md: on one machine,
colocated layouts within a few percent while the 1P1D pair with its router on the decode core
was over-predicted by 40–56%). A plan printed without that is a number without an error bar.
So `pdserve plan --validate K` appends each measured candidate to `validations.jsonl` in the
profile cache, and every plan, validated or not, prints the error of the validations before it
under its table, and writes it to its JSON as `track_record`:

- over every candidate validated on the same key, and for the recommended candidate's mode and
  its exact layout, where those were validated;
- the median of |error| (what the issue's goal measures) and the median of the signed error
  (+: the plan tends to promise more than the cluster serves);
- how many validations and candidates it rests on, and the date of the latest.

The key is what makes errors comparable: the model's digest, the machine's facts and the profile
version (a new kernel measures new profiles, and the old ones' errors say nothing of them).
A measurement marked suspect (the machine was busy with other work while it ran,
pdserve/planner/cpu_witness.py) is kept in the file but left out of the figures. An unreadable line
(a file cut off mid-write) is skipped.

Each record also keeps what its runs measured of the profile's inputs (step speeds, the stack's
CPU), which `pdserve plan --calibrate` applies (pdserve/planner/calibration.py), and whether its
prediction was calibrated: the figures are of uncalibrated predictions only.

Must never: change a prediction by its errors (they are reported, never applied), or fail a plan
because the file cannot be read (a validation that cannot write it says so and goes on).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from pdserve.planner.profile import PROFILE_VERSION

FILE_NAME = "validations.jsonl"


def record_key(model_digest: str, machine: dict[str, object], dtype: str, block_size: int) -> dict:
    """What two validations must share for their errors to be one record."""
    return {"model": model_digest, "machine": machine, "dtype": dtype, "block_size": block_size,
            "profile_version": PROFILE_VERSION}


@dataclass(frozen=True)
class Checked:
    """One validated candidate: what the plan predicted and what its cluster measured."""

    when: str  # the validation's start, ISO 8601 UTC: candidates of one validation share it
    mode: str  # colocated, disaggregated or hybrid
    layout: str
    predicted_goodput_rps: float
    goodput_error: float  # (predicted - measured) / measured
    error_is_a_bound: bool  # no probed rate passed: the least the error can be
    suspect: bool
    # What its runs measured of the profile's inputs (pdserve/planner/calibration.py): each pool's
    # step speed by "kind coresxTP", and the stack's CPU ratios (router, fronts, client).
    step_scales: dict[str, float] = field(default_factory=dict)
    stack_scales: dict[str, float] = field(default_factory=dict)
    # Each of those scales' key -> the digest of what it was measured against (the setup's step
    # model, the stack's costs: pdserve/planner/calibration.py `digest`).
    inputs: dict[str, str] = field(default_factory=dict)
    calibrated: bool = False  # predicted with `--calibrate`: its error is kept apart (`ValidationLog.read`)


@dataclass(frozen=True)
class ErrorSummary:
    """The error of a set of validated candidates."""

    candidates: int
    validations: int
    median_abs_error: float
    median_error: float  # signed: + the plan over-predicts
    latest: str

    @classmethod
    def of(cls, checked: Sequence[Checked]) -> ErrorSummary | None:
        if not checked:
            return None
        errors = [c.goodput_error for c in checked]
        return cls(len(checked), len({c.when for c in checked}), statistics.median(abs(e) for e in errors),
                   statistics.median(errors), max(c.when for c in checked))

    def text(self) -> str:
        return (f"median |goodput error| {self.median_abs_error:.0%} (signed {self.median_error:+.0%}) over "
                f"{self.candidates} candidate{'s' * (self.candidates != 1)} in {self.validations} "
                f"validation{'s' * (self.validations != 1)}, latest {self.latest[:10]}")


@dataclass(frozen=True)
class TrackRecord:
    """The record for one key, as a plan reports it."""

    overall: ErrorSummary | None
    mode: str
    of_mode: ErrorSummary | None
    layout: str
    of_layout: ErrorSummary | None

    def to_json(self) -> dict:
        def summary(s: ErrorSummary | None) -> dict | None:
            return None if s is None else asdict(s)

        return {"overall": summary(self.overall), "mode": self.mode, "of_mode": summary(self.of_mode),
                "layout": self.layout, "of_layout": summary(self.of_layout)}

    def text(self) -> str:
        if self.overall is None:
            return ("measured error: none yet for this model on this machine "
                    "(`--validate K` measures the top K candidates and records their error)")
        lines = [f"measured error of past plans for this model on this machine: {self.overall.text()}"]
        for name, summary in ((f"{self.mode} layouts", self.of_mode), (self.layout, self.of_layout)):
            lines.append(f"  {name}: " + ("not validated yet" if summary is None else summary.text()))
        return "\n".join(lines)


class ValidationLog:
    """`validations.jsonl` in a profile cache's folder, one line per validated candidate; this
    object reads and adds the lines of one key (`record_key`)."""

    def __init__(self, folder: str | Path, key: dict) -> None:
        self.path = Path(folder) / FILE_NAME
        self.key = json.loads(json.dumps(key))  # as it reads back: tuples are lists there

    def add(self, checked: Iterable[Checked]) -> None:
        """Raises OSError when the file cannot be written (the caller says so and goes on)."""
        lines = "".join(json.dumps({"key": self.key, **asdict(c)}, sort_keys=True) + "\n" for c in checked)
        if not lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as f:  # appends go to the end, wherever it reads
            if _ends_mid_line(f):
                lines = "\n" + lines  # after a line cut off mid-write: that one is lost, not these
            f.write(lines.encode())  # one write per validation: lines of two never interleave

    def read(self, calibrated: bool = False) -> list[Checked]:
        """The key's candidates that were measured with the machine to themselves, predicted with
        the profile as measured (or, `calibrated`, with `--calibrate`: what a record's errors
        summarise is one kind of prediction)."""
        try:
            text = self.path.read_text()
        except OSError:
            return []
        found = []
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                if entry.pop("key") == self.key:
                    found.append(Checked(**entry))
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # a line cut off mid-write, or from another version of this file
        return [c for c in found if not c.suspect and c.calibrated == calibrated]

    def track_record(self, mode: str, layout: str) -> TrackRecord:
        """The record as a plan whose best candidate has this mode and layout reports it."""
        checked = self.read()
        return TrackRecord(ErrorSummary.of(checked), mode, ErrorSummary.of([c for c in checked if c.mode == mode]),
                           layout, ErrorSummary.of([c for c in checked if c.layout == layout]))


def _ends_mid_line(f: BinaryIO) -> bool:
    if f.seek(0, os.SEEK_END) == 0:
        return False
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"
