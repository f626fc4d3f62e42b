"""How fast a cluster's steps ran against the profile (pdserve/planner/step_speed.py): the nodes' step
sums through the router's /metrics, read back, set against the profile's prediction for them, and
the load mode's simulation stretched by the speed its window measured."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.bench.serve.metrics import Slo
from pdserve.engine.step_shape import StepShape, StepTotals
from pdserve.planner.load_mode import Rebalancer, Split, Window
from pdserve.planner.step_cost import StepCost
from pdserve.planner.step_speed import StepSpeed, parse_node_steps, pool_steps, short_text, summed
from pdserve.proto import node_pb2
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.router.fronts.metrics import RouterMetrics
from tests.unit.test_planner_load_mode import ENGINE, PROFILE, rebalancer, window

COST = StepCost(base_s=0.002, per_token_s=0.0001, per_seq_s=0.0005, per_attended_s=1e-7, per_decode_context_s=1e-6)
STEPS = ([(0, 100), (0, 30)], [(100, 1), (30, 1)], [(101, 1), (31, 1), (0, 64)], [(64, 1)])


def totals(steps=STEPS, seconds: float = 0.0, cpu_seconds: float = 0.0) -> StepTotals:
    sums = StepTotals()
    for chunks in steps:
        sums.add(StepShape.of(chunks), seconds / len(steps), cpu_seconds / len(steps))
    return sums


def test_the_profile_prices_the_sums_of_steps_as_the_sum_of_their_prices():
    # A prefill of two prompts, two decodes, decodes beside a chunk, one decode.
    assert COST.total(totals()) == pytest.approx(sum(COST.time(StepShape.of(chunks)) for chunks in STEPS), rel=1e-12)
    assert COST.scaled(1.5).total(totals()) == pytest.approx(1.5 * COST.total(totals()), rel=1e-12)


def test_the_router_exports_each_nodes_step_sums_and_they_read_back_exactly():
    nodes = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0, clock=lambda: 0.0)
    nodes.register(NodeKind.PREFILL, "127.0.0.1:1", "p0")
    nodes.register(NodeKind.DECODE, "127.0.0.1:2", "d0")
    sent = {"p0": totals(STEPS[:1], 0.25, 0.2), "d0": totals(STEPS[1:], 0.125, 0.0625)}
    for node, steps in sent.items():
        nodes.heartbeat(node, node_pb2.NodeStats(steps=node_pb2.StepTotals(**dataclasses.asdict(steps))))
    registry = CollectorRegistry()
    RouterMetrics(registry, nodes)

    assert parse_node_steps(generate_latest(registry).decode()) == {("p0", "prefill"): sent["p0"],
                                                                    ("d0", "decode"): sent["d0"]}


def test_a_window_sums_each_kinds_nodes_in_both_readings_and_skips_a_restarted_one():
    before = {("d0", "decode"): totals(STEPS[:1], 1.0, 1.0), ("d1", "decode"): totals(STEPS, 4.0, 4.0)}
    after = {("d0", "decode"): totals(STEPS[:2], 2.0, 1.5),  # one step more
             ("d1", "decode"): totals(STEPS[:1], 1.0, 1.0),  # counts went back: restarted
             ("d2", "decode"): totals(STEPS[3:], 0.5, 0.25),  # not in the first: late, or joined since
             ("p0", "prefill"): totals(STEPS[2:3], 3.0, 3.0)}  # not in the first either
    pools = pool_steps(before, after)
    assert set(pools) == {"decode"}
    assert pools["decode"] == totals([STEPS[1]], 1.0, 0.5)


def test_the_speed_is_the_cpu_seconds_over_the_profiles_and_says_nothing_of_a_few_short_steps():
    predicted = COST.total(totals())
    speed = StepSpeed.of(totals(seconds=3 * predicted, cpu_seconds=2 * predicted), COST)
    assert not speed.known  # 4 steps of about 20 ms in all: below a second of predicted work
    many = StepSpeed.of(totals(STEPS * 100, 300 * predicted, 200 * predicted), COST)
    assert many.known and many.cpu_ratio == pytest.approx(2.0) and many.clock_ratio == pytest.approx(3.0)
    assert summed([{"decode": many}, {"decode": many, "prefill": speed}]) == {"decode": many.plus(many),
                                                                               "prefill": speed}
    assert short_text({"decode": many, "prefill": speed}) == "D 2.00"  # the prefill's too few to tell
    tp = StepSpeed.of(totals(STEPS * 100, 300 * predicted, 200 * predicted), COST, tensor_parallel_size=2)
    assert not tp.known and "tensor-parallel" in tp.describe()  # its CPU leaves out the collectives' waits


def test_the_load_mode_simulates_each_pool_as_slow_as_its_steps_ran():
    slo = Slo(ttft_s=2.0, tpot_s=0.03)
    base = window(6.0, 32, 256)
    # Every pool's steps ran at twice the profile's time: as a profile twice as slow predicts.
    work = totals(STEPS * 200)
    slow = {pool: dataclasses.replace(work, cpu_seconds=2 * PROFILE.step.total(work)) for pool in ("prefill", "decode")}
    measured = dataclasses.replace(base, steps=slow)
    twice = Rebalancer(rebalancer(slo).config, ENGINE, ENGINE, dataclasses.replace(PROFILE, step=PROFILE.step.scaled(2)))
    as_profiled = rebalancer(slo)
    for split in (Split(1, 2), Split(2, 1)):
        assert as_profiled.attainment(split, measured) == twice.attainment(split, base)
    assert any(as_profiled.attainment(s, measured) != as_profiled.attainment(s, base) for s in (Split(1, 2), Split(2, 1)))
    # Too few steps to tell: the profile as measured.
    few = dataclasses.replace(base, steps={"decode": dataclasses.replace(totals(), cpu_seconds=1.0)})
    assert as_profiled.attainment(Split(1, 2), few) == as_profiled.attainment(Split(1, 2), base)


def test_a_hold_names_the_windows_step_speeds():
    work = totals(STEPS * 200)
    measured = Window(6.0, ((32, 256),) * 32, 0.5, 0.5,
                      {"decode": dataclasses.replace(work, cpu_seconds=1.25 * PROFILE.step.total(work))})
    hold = rebalancer(Slo(ttft_s=2.0, tpot_s=0.03), margin=1.0).decide(measured, Split(2, 1))
    assert hold.describe(Split(2, 1)).endswith(
        "; the window's steps: decode: 800 steps ran 1.25× the profile's time in CPU, 0.00× on the clock)")
