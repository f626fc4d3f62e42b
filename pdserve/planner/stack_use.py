"""How much CPU the serving stack took while a validation measured a layout, against the profile.

The simulator charges the router's, the node fronts' and (when it shares the machine) the
client's CPU from what `pdserve profile` measured, per request and per streamed token
(`ServingCosts`). A validation reads what they really took over its sweep: each process's CPU
from /proc (the router's and the fronts' by their pids in the cluster's state file; the client's
as this process's tree less the cluster's and this process's own), and the requests and tokens the
router counted (its /metrics before and after). Per kind of process:

    stack speed = its CPU / what the profile's costs give for those requests and tokens

Above 1 it cost more than profiled: measured on the 2-core AVX2 machine, the sweeping client took
1.9× the profile's closed-loop client per token and the router 1.35× (docs/benchmarks.md). A plan
predicts a validated candidate again with its costs scaled by these (pdserve/planner/cli.py), beside
its step speeds (pdserve/planner/step_speed.py): what is left of the error is then the simulator's.

A request passes one front, and a second when its prompt went through the prefill pool (the
router's `pdserve_prompt_routes_total{route="prefill_pool"}`).

Must never: start or stop anything (it reads /proc and /metrics texts).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner.cpu_witness import process_table, tree_cpu_s
from pdserve.planner.profile import CpuCost, ServingCosts

STACK_ROLES = ("router", "fronts", "client")
# Less predicted CPU than this in a window, and its ratio is a few clock ticks' noise.
MIN_PREDICTED_S = 0.5


@dataclass(frozen=True, slots=True)
class StackCpu:
    """CPU seconds since each process started, at one moment."""

    router_s: float
    fronts_s: float  # every node front's own (not its engine core's)
    cluster_s: float  # the launcher and every process under it
    tree_s: float  # this process and every process under it: the cluster, the client
    own_s: float  # this process's own
    pids: tuple[int, ...] = ()  # the router's, then the fronts': a restart between two readings changes them

    @classmethod
    def read(cls, router_pid: int, front_pids: Sequence[int], cluster_pid: int, proc: Path = Path("/proc")) -> StackCpu:
        processes = process_table(proc)

        def own(pid: int) -> float:
            return processes[pid].own_s if pid in processes else 0.0

        me = os.getpid()
        return cls(own(router_pid), sum(own(pid) for pid in front_pids), tree_cpu_s(processes, cluster_pid),
                   tree_cpu_s(processes, me), own(me), (router_pid, *front_pids))

    def used_since(self, earlier: StackCpu) -> dict[str, float]:
        """CPU seconds of each kind of stack process between `earlier` and this; the router's and
        the fronts' left out when one of them restarted in between (a new pid: its CPU started
        again from zero)."""
        client = (self.tree_s - earlier.tree_s) - (self.cluster_s - earlier.cluster_s) - (self.own_s - earlier.own_s)
        used = {"client": max(0.0, client)}
        if self.pids == earlier.pids:
            used.update(router=self.router_s - earlier.router_s, fronts=self.fronts_s - earlier.fronts_s)
        return used


@dataclass(frozen=True)
class StackSpeed:
    cpu_s: float
    predicted_s: float  # what the profile's costs give for the window's requests and tokens

    @property
    def known(self) -> bool:
        return self.predicted_s >= MIN_PREDICTED_S and self.cpu_s > 0

    @property
    def ratio(self) -> float:
        return self.cpu_s / self.predicted_s if self.predicted_s > 0 else 1.0

    def plus(self, other: StackSpeed) -> StackSpeed:
        return StackSpeed(self.cpu_s + other.cpu_s, self.predicted_s + other.predicted_s)

    def record(self) -> dict:
        return {"cpu_s": self.cpu_s, "predicted_s": self.predicted_s, "ratio": self.ratio if self.known else None}


@dataclass(frozen=True)
class Served:
    """What the router had served at one moment, from its /metrics."""

    requests: float = 0.0  # ended, whatever their status
    tokens: float = 0.0  # streamed to clients
    via_prefill_pool: float = 0.0  # requests whose prompt a prefill pool computed: they pass two fronts

    @classmethod
    def parse(cls, metrics_text: str) -> Served:
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(metrics_text):
            for s in family.samples:
                if family.name in ("pdserve_requests", "pdserve_generated_tokens") and s.name.endswith("_total"):
                    totals[family.name] = totals.get(family.name, 0.0) + s.value
                elif family.name == "pdserve_prompt_routes" and s.labels.get("route") == "prefill_pool":
                    totals[family.name] = s.value
        return cls(totals.get("pdserve_requests", 0.0), totals.get("pdserve_generated_tokens", 0.0),
                   totals.get("pdserve_prompt_routes", 0.0))

    def since(self, earlier: Served) -> Served:
        return Served(self.requests - earlier.requests, self.tokens - earlier.tokens,
                      self.via_prefill_pool - earlier.via_prefill_pool)


def stack_speeds(used: dict[str, float], served: Served, costs: ServingCosts) -> dict[str, StackSpeed]:
    """Each kind of stack process's CPU against the profile's for what was `served`; a kind the
    profile charges nothing (a client it was told runs elsewhere), or whose CPU could not be read
    (`StackCpu.used_since`), is left out."""
    requests = {"router": served.requests, "fronts": served.requests + served.via_prefill_pool,
                "client": served.requests}
    speeds = {}
    for role, cost in zip(STACK_ROLES, (costs.router, costs.fronts, costs.client)):
        predicted = cost.per_request_s * requests[role] + cost.per_token_s * served.tokens
        if predicted > 0 and role in used:
            speeds[role] = StackSpeed(used[role], predicted)
    return speeds


def stack_scales(speeds: dict[str, StackSpeed]) -> dict[str, float]:
    return {role: speed.ratio for role, speed in speeds.items() if speed.known}


def scaled_costs(costs: ServingCosts, scales: dict[str, float]) -> ServingCosts:
    """`costs` with each kind's per-request and per-token CPU times its scale (1 where none)."""
    def scaled(cost: CpuCost, role: str) -> CpuCost:
        factor = scales.get(role, 1.0)
        return replace(cost, per_request_s=cost.per_request_s * factor, per_token_s=cost.per_token_s * factor)

    return ServingCosts(scaled(costs.router, "router"), scaled(costs.fronts, "fronts"), scaled(costs.client, "client"))


def short_text(speeds: dict[str, StackSpeed]) -> str:
    """"R 1.35 F 0.95 C 1.94": each kind's ratio by its initial; "-" where too little ran."""
    return " ".join(f"{role[0].upper()} {speeds[role].ratio:.2f}" for role in STACK_ROLES
                    if role in speeds and speeds[role].known) or "-"
