"""pdserve/bench/tp_costs.py's pure parts: the call-timing wrapper puts the original back, and the
per-step and TP-over-TP=1 arithmetic. No processes, no model."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.bench.tp_costs import (CallTimes, StepCosts, cost_report, measured_step_costs, over, threads_per_rank,
                                    timed_calls, tp_ratios)


def test_timed_calls_counts_and_restores_the_original():
    owner = types.SimpleNamespace(double=lambda x: 2 * x)
    original = owner.double
    seen = []
    with timed_calls(owner, "double", seen.append) as times:
        assert owner.double is not original
        assert owner.double(3) == 6 and owner.double(4) == 8
    assert owner.double is original
    assert times.calls == 2 and times.seconds >= 0.0
    assert seen == [3, 4]


def test_timed_calls_restores_the_original_when_the_block_or_the_call_raises():
    def fail(x):
        raise RuntimeError("boom")

    owner = types.SimpleNamespace(fail=fail)
    with pytest.raises(RuntimeError), timed_calls(owner, "fail") as times:
        owner.fail(1)
    assert owner.fail is fail
    assert times.calls == 1  # a call that raised still counts


def test_measured_step_costs_puts_torch_distributed_all_reduce_back():
    original = torch.distributed.all_reduce
    runner = types.SimpleNamespace(fanout=lambda batch, copies: None)
    with measured_step_costs(runner) as costs:
        assert torch.distributed.all_reduce is not original
    assert torch.distributed.all_reduce is original
    assert costs.fanout.calls == 0 and costs.all_reduce.calls == 0


def test_per_step_means():
    times = CallTimes(calls=8, seconds=0.004)
    assert times.per_step(2) == {"calls": 8, "seconds": 0.004, "calls_per_step": 4.0,
                                 "mean_per_call_s": pytest.approx(0.0005), "per_step_s": 0.002}
    assert CallTimes().per_step(0) == {"calls": 0, "seconds": 0.0, "calls_per_step": 0.0, "mean_per_call_s": 0.0,
                                       "per_step_s": 0.0}


def test_tp_ratios_are_tp_over_tp1_and_none_where_unmeasured():
    base = {"tokens_per_s": 100.0, "step_mean_s": 0.010, "decode_step_mean_s": 0.0}
    tp = {"tokens_per_s": 50.0, "step_mean_s": 0.025, "decode_step_mean_s": 0.02}
    assert tp_ratios(base, tp) == {"tokens_per_s_tp_over_tp1": 0.5, "step_mean_s_tp_over_tp1": 2.5,
                                   "decode_step_mean_s_tp_over_tp1": None}
    assert over(0.0, 2.0) == 0.0 and over(None, 2.0) is None and over(1.0, 0.0) is None


def test_cost_report_compares_against_the_gloo_replay():
    costs = StepCosts(CallTimes(4, 0.0004), CallTimes(16, 0.016), [100, 300], [64] * 16, torch.bfloat16)
    replay = {"broadcast": {"per_step_s": 0.0004}, "all_reduce_idle": {"mean_per_call_s": 0.00025}}
    report = cost_report(costs, 4, replay)
    assert report["fanout"]["per_step_s"] == pytest.approx(0.0001)
    assert report["all_reduce"]["calls_per_step"] == 4.0
    assert report["batch_words_mean"] == 200.0 and report["all_reduce_elements_mean"] == 64.0
    assert report["all_reduce_dtype"] == "bfloat16"
    assert report["fanout_over_gloo_broadcast"] == pytest.approx(0.25)
    assert report["all_reduce_idle_over_measured"] == pytest.approx(0.25)
    unreplayed = cost_report(costs, 4, None)
    assert unreplayed["gloo_replay"] is None and unreplayed["fanout_over_gloo_broadcast"] is None


@pytest.mark.parametrize("threads, size, expected", [(2, 1, 2), (2, 2, 1), (1, 2, 1), (8, 3, 2)])
def test_ranks_share_the_threads(threads, size, expected):
    assert threads_per_rank(threads, size) == expected
