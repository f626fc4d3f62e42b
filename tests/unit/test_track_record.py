"""The planner's track record (pdserve/planner/track_record.py): what validations add, what a plan
reads back of its own key, the figures it reports, and a file it cannot read or write."""

from __future__ import annotations

import json

import pytest

from pdserve.planner.track_record import FILE_NAME, Checked, ErrorSummary, ValidationLog, record_key

KEY = record_key("model-a", {"cpu": "x", "flags": ["avx2"], "cores": 2}, "float32", 16)


def checked(error: float, when: str = "2026-12-07T10:00:00+00:00", mode: str = "colocated",
            layout: str = "colocated x2 (1 core each)", suspect: bool = False) -> Checked:
    return Checked(when, mode, layout, 10.0, error, False, suspect)


def test_a_plan_reads_back_what_validations_of_its_key_added(tmp_path):
    ValidationLog(tmp_path, KEY).add([checked(0.5), checked(-0.1)])
    ValidationLog(tmp_path, KEY).add([checked(0.2, when="2026-12-07T11:00:00+00:00", mode="disaggregated",
                                              layout="1P (1 core) + 1D (1 core)")])
    ValidationLog(tmp_path, {**KEY, "model": "model-b"}).add([checked(3.0)])  # another model: not this record
    ValidationLog(tmp_path, {**KEY, "profile_version": -1}).add([checked(3.0)])  # profiles since remeasured
    ValidationLog(tmp_path, KEY).add([checked(9.0, suspect=True)])  # measured on a busy machine: kept, not counted

    log = ValidationLog(tmp_path, KEY)
    assert [c.goodput_error for c in log.read()] == [0.5, -0.1, 0.2]
    assert len((tmp_path / FILE_NAME).read_text().splitlines()) == 6
    record = log.track_record("colocated", "colocated x2 (1 core each)")
    assert record.overall == ErrorSummary(candidates=3, validations=2, median_abs_error=0.2, median_error=0.2,
                                          latest="2026-12-07T11:00:00+00:00")
    assert record.of_mode == ErrorSummary(2, 1, pytest.approx(0.3), pytest.approx(0.2), "2026-12-07T10:00:00+00:00")
    assert record.of_layout == record.of_mode
    assert record.to_json()["overall"] == {"candidates": 3, "validations": 2, "median_abs_error": 0.2,
                                           "median_error": 0.2, "latest": "2026-12-07T11:00:00+00:00"}
    assert record.text().splitlines() == [
        "measured error of past plans for this model on this machine: median |goodput error| 20% (signed +20%) "
        "over 3 candidates in 2 validations, latest 2026-12-07",
        "  colocated layouts: median |goodput error| 30% (signed +20%) over 2 candidates in 1 validation, "
        "latest 2026-12-07",
        "  colocated x2 (1 core each): median |goodput error| 30% (signed +20%) over 2 candidates in 1 validation, "
        "latest 2026-12-07",
    ]
    hybrid = log.track_record("hybrid", "2D serving prefill (1 core each)")
    assert hybrid.of_mode is None and hybrid.of_layout is None
    assert hybrid.text().splitlines()[1:] == ["  hybrid layouts: not validated yet",
                                              "  2D serving prefill (1 core each): not validated yet"]


def test_no_record_yet_says_how_to_make_one(tmp_path):
    record = ValidationLog(tmp_path, KEY).track_record("colocated", "colocated x1 (1 core)")
    assert record.overall is None and record.to_json()["overall"] is None
    assert record.text() == ("measured error: none yet for this model on this machine "
                             "(`--validate K` measures the top K candidates and records their error)")


def test_a_line_cut_off_or_of_another_shape_is_skipped(tmp_path):
    log = ValidationLog(tmp_path, KEY)
    log.add([checked(0.1)])
    with (tmp_path / FILE_NAME).open("a") as f:
        f.write(json.dumps({"key": KEY, "when": "x"}) + "\n")  # fields missing
        f.write('{"key": {"model": "mod')  # cut off mid-write
    log.add([checked(0.3)])
    assert [c.goodput_error for c in log.read()] == [0.1, 0.3]  # the next line starts on a line of its own
    assert (tmp_path / FILE_NAME).read_text().count("\n") == 4


def test_a_record_that_cannot_be_read_is_empty_and_one_that_cannot_be_written_says_why(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    log = ValidationLog(blocked, KEY)  # its folder is a file
    assert log.read() == [] and log.track_record("colocated", "colocated x1 (1 core)").overall is None
    with pytest.raises(OSError):  # validate() logs it and goes on
        log.add([checked(0.1)])
