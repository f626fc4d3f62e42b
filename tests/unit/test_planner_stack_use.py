"""The serving stack's CPU during a validation against the profile (pdserve/planner/stack_use.py):
/proc read for real around processes that burn known CPU where a cluster's router, a node front
and the client would be, and the figures set against the profile's costs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.planner.profile import ClientCost, FrontCost, RouterCost, ServingCosts
from pdserve.planner.stack_use import (
    Served, StackCpu, StackSpeed, scaled_costs, short_text, stack_scales, stack_speeds,
)
from pdserve.router.dispatch.state import PromptRoute, RouteCounts
from pdserve.router.fronts.metrics import RouterMetrics
from tests.unit.test_router_metrics import FakeContext, drain, last, stream

# Waits for argv[4] (when given), burns CPU until its own process time reaches argv[1], writes
# argv[2], then waits for argv[3].
BURN = ("import os, sys, time\n"
        "while len(sys.argv) > 4 and not os.path.exists(sys.argv[4]):\n"
        "    time.sleep(0.01)\n"
        "while time.process_time() < float(sys.argv[1]):\n"
        "    sum(i * i for i in range(10000))\n"
        "open(sys.argv[2], 'w').write('done')\n"
        "while not os.path.exists(sys.argv[3]):\n"
        "    time.sleep(0.01)\n")
# A launcher: starts a router and a front that burn, prints their pids, waits for them.
LAUNCHER = ("import subprocess, sys\n"
            "burn, stop, d = sys.argv[1], sys.argv[2], sys.argv[3]\n"
            "kids = [subprocess.Popen([sys.executable, '-c', burn, s, f'{d}/{n}', stop]) for n, s in "
            "(('router', '0.4'), ('front', '0.6'))]\n"
            "print(*(k.pid for k in kids), flush=True)\n"
            "for k in kids:\n"
            "    k.wait()\n")


def _wait_for(*paths: Path) -> None:
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, "the burners never finished"
        time.sleep(0.02)


def test_each_stack_process_is_read_by_its_pid_and_the_client_as_the_rest_of_this_tree(tmp_path):
    stop = tmp_path / "stop"
    cluster = subprocess.Popen([sys.executable, "-c", LAUNCHER, BURN, str(stop), str(tmp_path)],
                               stdout=subprocess.PIPE, text=True)
    go = tmp_path / "go"  # the client burns only once the first reading is taken
    client = subprocess.Popen([sys.executable, "-c", BURN, "0.8", str(tmp_path / "client"), str(stop), str(go)])
    try:
        router, front = (int(pid) for pid in cluster.stdout.readline().split())
        before = StackCpu.read(router, [front], cluster.pid)
        go.write_text("go")
        _wait_for(tmp_path / "router", tmp_path / "front", tmp_path / "client")
        after = StackCpu.read(router, [front], cluster.pid)
    finally:
        stop.write_text("stop")
        cluster.wait(timeout=60)
        client.wait(timeout=60)
    used = after.used_since(before)
    # Each burnt its target in all; the first reading came after some of it (its start-up at least).
    assert 0.4 - before.router_s == pytest.approx(used["router"], abs=0.05)
    assert 0.6 - before.fronts_s == pytest.approx(used["fronts"], abs=0.05)
    assert 0.4 < used["router"] + used["fronts"] <= 1.0 + 0.05
    assert 0.6 < used["client"] <= 0.8 + 0.05  # less its start-up; this process's own CPU left out


def test_the_stacks_cpu_is_set_against_the_profiles_for_the_requests_and_tokens_the_router_served():
    registry, routes = CollectorRegistry(), RouteCounts()
    metrics = RouterMetrics(registry, routes=routes)
    routes.count(PromptRoute.COLOCATED)
    before = generate_latest(registry).decode()
    for route in (PromptRoute.PREFILL_POOL, PromptRoute.PREFILL_POOL, PromptRoute.DECODE_NODE, PromptRoute.COLOCATED):
        routes.count(route)
        drain(metrics, stream([last(0, [7] * 50, 50, 0.2, 0.7)]), FakeContext())
    served = Served.parse(generate_latest(registry).decode()).since(Served.parse(before))
    assert served == Served(requests=4, tokens=200, via_prefill_pool=2)  # two passed two fronts

    costs = ServingCosts(RouterCost(0.002, 0.0003, "x"), FrontCost(0.001, 0.0002, "x"), ClientCost.free())
    used = {"router": 2 * (4 * 0.002 + 200 * 0.0003), "fronts": 2 * 0.001 * 4 + 200 * 0.0002, "client": 0.3}
    speeds = stack_speeds(used, Served(4, 200, via_prefill_pool=4), costs)  # each passed two fronts
    assert set(speeds) == {"router", "fronts"}  # the client runs elsewhere: the profile charges it nothing
    assert speeds["router"] == StackSpeed(used["router"], 0.068) and speeds["router"].ratio == pytest.approx(2.0)
    assert speeds["fronts"].ratio == pytest.approx(1.0)  # a request passes two fronts
    assert not speeds["router"].known and stack_scales(speeds) == {}  # 68 ms predicted: too little to tell
    many = {role: StackSpeed(20 * s.cpu_s, 20 * s.predicted_s) for role, s in speeds.items()}
    assert stack_scales(many) == {"router": pytest.approx(2.0), "fronts": pytest.approx(1.0)}
    assert short_text(many) == "R 2.00 F 1.00"
    twice = scaled_costs(costs, {"router": 2.0})
    assert (twice.router.per_request_s, twice.router.per_token_s) == (0.004, 0.0006)
    assert twice.fronts == costs.fronts and twice.client == costs.client
