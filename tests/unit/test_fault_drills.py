"""--debug-step-delay-s slows a node's engine steps without touching what they compute."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.node.core.fault_drills import slow_every_step


def test_a_slowed_step_returns_what_the_step_returns_and_sleeps_after_it(monkeypatch):
    events = []
    engine = SimpleNamespace(step=lambda: events.append("step") or ["out"])
    monkeypatch.setattr("pdserve.node.core.fault_drills.time.sleep", lambda s: events.append(("sleep", s)))
    slow_every_step(engine, 0.25)
    assert engine.step() == ["out"]
    assert events == ["step", ("sleep", 0.25)]


def test_no_delay_leaves_the_engine_as_it_is():
    step = lambda: []  # noqa: E731
    engine = SimpleNamespace(step=step)
    slow_every_step(engine, 0.0)
    assert engine.step is step
