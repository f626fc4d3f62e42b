"""The planner's load mode: from the router's recent traffic to the prefill:decode split that serves it.

`pdserve cluster --rebalance` scrapes the router's /metrics every interval; two scrapes make a
`Window`: how many requests arrived per second (those that ended plus the change in those in
flight: under overload, more arrive than finish), the finished samples' prompt and output lengths read
back from the length histograms (each bucket's count spread evenly across the bucket; prompt and
output lengths paired at random, since the histograms do not keep pairs), and the share of
samples whose TTFT and whose TPOT fell in a bucket within the SLO (a lower bound: a bucket
straddling the SLO counts as missing it).

`Rebalancer.decide` leaves a cluster alone while the window meets the attainment target on both
SLOs, or holds too few samples to say. Otherwise it simulates the same N nodes in every split
p + d = N at the window's rate and mix (pdserve/planner/simulator.py, on the nodes' profile: the same
machinery as `pdserve plan`), each pool's steps stretched by the speed its nodes' steps ran at in
the window (pdserve/planner/step_speed.py: their CPU seconds over what the profile predicts for the
same steps; 1 where too few ran to tell), and answers one node moved toward the best split, when that split's
predicted attainment beats the current one's by `margin`. One node per decision and the
launcher's cooldown keep the pools from oscillating on noise.

Must never: read a clock, scrape anything itself (the launcher passes the texts), or load torch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.serve.metrics import Slo
from pdserve.engine.config import EngineConfig
from pdserve.engine.step_shape import StepTotals
from pdserve.planner.goodput import Traffic, simulate
from pdserve.planner.profile import Profile, ServingCosts
from pdserve.planner.cluster_spec import ClusterSpec, Pool
from pdserve.planner.step_speed import (
    NodeKey, StepSpeed, describe_speeds, parse_node_steps, pool_steps, step_scales,
)

PROMPT, OUTPUT = "pdserve_request_prompt_tokens", "pdserve_request_generation_tokens"
TTFT, TPOT = "pdserve_request_ttft_seconds", "pdserve_request_tpot_seconds"
ENDED, IN_FLIGHT = "pdserve_requests", "pdserve_requests_in_flight"
SIMULATED_REQUESTS = 64  # at least this many per simulated run: the window's mix, repeated


@dataclass(frozen=True)
class Scrape:
    """The router's series at one moment: the cumulative buckets of its histograms (name ->
    ((le, count), ...)), how many requests had arrived (ended, of any status, or in flight), and
    each node's step sums."""

    at_s: float
    buckets: dict[str, tuple[tuple[float, float], ...]]
    arrived: float = 0.0
    steps: dict[NodeKey, StepTotals] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, at_s: float) -> Scrape:
        wanted = {PROMPT, OUTPUT, TTFT, TPOT}
        buckets: dict[str, list[tuple[float, float]]] = {}
        arrived = 0.0
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                buckets[family.name] = sorted((float(s.labels["le"]), s.value) for s in family.samples
                                              if s.name.endswith("_bucket"))
            elif family.name in (ENDED, IN_FLIGHT):
                arrived += sum(s.value for s in family.samples if s.name in (f"{ENDED}_total", IN_FLIGHT))
        return cls(at_s, {name: tuple(b) for name, b in buckets.items()}, arrived, parse_node_steps(text))


def _delta(after: Scrape, before: Scrape, name: str) -> list[tuple[float, float]]:
    """(upper bound, count) of each bucket over the window, not cumulative; [] when the router
    restarted between the scrapes (its counters went back)."""
    now, then = dict(after.buckets.get(name, ())), dict(before.buckets.get(name, ()))
    cumulative = [(le, now[le] - then.get(le, 0.0)) for le in sorted(now)]
    if any(count < 0 for _, count in cumulative):
        return []
    counts, previous = [], 0.0
    for le, total in cumulative:
        counts.append((le, total - previous))
        previous = total
    return counts


def _spread(buckets: list[tuple[float, float]]) -> list[int]:
    """Each bucket's count as lengths evenly spread over (previous bound, bound]; the +Inf
    bucket's at the last finite bound."""
    lengths, low = [], 0.0
    for le, count in buckets:
        n = round(count)
        high = low if math.isinf(le) else le
        lengths += [max(1, round(low + (high - low) * (k + 0.5) / n)) for k in range(n)]
        low = high
    return lengths


def _share_within(buckets: list[tuple[float, float]], limit: float | None) -> float | None:
    total = sum(count for _, count in buckets)
    if not total:
        return None
    if limit is None:
        return 1.0
    return sum(count for le, count in buckets if le <= limit) / total


@dataclass(frozen=True)
class Window:
    rate: float  # requests arrived per second
    mix: tuple[tuple[int, int], ...]  # (prompt length, output length) of each finished sample
    ttft_share: float | None  # share within the TTFT SLO; None: no sample
    tpot_share: float | None
    steps: dict[str, StepTotals] = field(default_factory=dict)  # each pool's steps in the window

    @classmethod
    def between(cls, before: Scrape, after: Scrape, slo: Slo, seed: int = 0) -> Window:
        prompts, outputs = _spread(_delta(after, before, PROMPT)), _spread(_delta(after, before, OUTPUT))
        random.Random(seed).shuffle(outputs)
        seconds, arrived = after.at_s - before.at_s, after.arrived - before.arrived
        mix = tuple(zip(prompts, outputs))
        return cls(arrived / seconds if seconds > 0 and arrived > 0 else 0.0, mix,
                   _share_within(_delta(after, before, TTFT), slo.ttft_s),
                   _share_within(_delta(after, before, TPOT), slo.tpot_s), pool_steps(before.steps, after.steps))

    def describe(self) -> str:
        shares = ", ".join(f"{'-' if share is None else f'{share:.0%}'} within the {name} SLO"
                           for name, share in (("TTFT", self.ttft_share), ("TPOT", self.tpot_share)))
        return f"{self.rate:.3g} requests/s arrived, {len(self.mix)} samples finished, {shares}"

    def meets(self, target: float) -> bool:
        return all(share is None or share >= target for share in (self.ttft_share, self.tpot_share))


@dataclass(frozen=True, order=True)
class Split:
    prefill: int
    decode: int

    def describe(self) -> str:
        return f"{self.prefill}P{self.decode}D"


@dataclass(frozen=True)
class Move:
    """One node from the pool `source` to the pool `target`, toward `best`."""

    source: str  # "prefill" or "decode"
    target: str
    best: Split
    predicted: dict[Split, float]  # attainment of every split at the window's rate and mix
    speeds: dict[str, StepSpeed] = field(default_factory=dict)  # each pool's steps in the window

    def describe(self, current: Split) -> str:
        return (f"a {self.source} node becomes a {self.target} node ({current.describe()} toward "
                f"{self.best.describe()}; predicted attainment {_figures(self.predicted)}{_steps(self.speeds)})")


@dataclass(frozen=True)
class Hold:
    """The window missed the target, and no split is predicted to do better by the margin."""

    predicted: dict[Split, float]  # attainment of every split at the window's rate and mix
    speeds: dict[str, StepSpeed] = field(default_factory=dict)  # each pool's steps in the window

    def describe(self, current: Split) -> str:
        # The figures beside the window's own shares show where the simulator disagrees with the
        # cluster: a current split predicted to meet the target is one the load mode never leaves.
        return (f"no other split of {current.prefill + current.decode} nodes is predicted to do better by the "
                f"margin (predicted attainment {_figures(self.predicted)}{_steps(self.speeds)})")


def _figures(predicted: dict[Split, float]) -> str:
    return ", ".join(f"{s.describe()} {a:.0%}" for s, a in sorted(predicted.items()))


def _steps(speeds: dict[str, StepSpeed]) -> str:
    return f"; the window's steps: {describe_speeds(speeds)}" if speeds else ""


@dataclass(frozen=True)
class LoadModeConfig:
    slo: Slo
    target: float = 0.9  # attainment
    margin: float = 0.05  # predicted attainment the best split must gain over the current one
    min_samples: int = 8  # a window with fewer finished samples says nothing


class Rebalancer:
    def __init__(self, config: LoadModeConfig, prefill: EngineConfig, decode: EngineConfig, profile: Profile,
                 costs: ServingCosts = ServingCosts(), machine_cores: int | None = None) -> None:
        """`prefill`/`decode`: each pool's engine config; `profile`: the nodes' (one threads count);
        `machine_cores`: the cores the cluster runs on (`ClusterSpec.machine_cores`: fewer than the
        nodes' threads, they share them)."""
        self.config = config
        self._engines = {"prefill": prefill, "decode": decode}
        self._profile = profile
        self.costs = costs  # the serving stack's CPU the simulator charges to the nodes' cores
        self.machine_cores = machine_cores

    def decide(self, window: Window, current: Split) -> Move | Hold | None:
        """None: the window meets the target or says too little (nothing was simulated)."""
        if len(window.mix) < self.config.min_samples or window.meets(self.config.target):
            return None
        predicted = {split: self.attainment(split, window) for split in _splits(current.prefill + current.decode)}
        best = max(predicted, key=lambda s: (predicted[s], s == current))
        speeds = self.speeds(window)
        if best == current or predicted[best] < predicted[current] + self.config.margin:
            return Hold(predicted, speeds)
        source, target = ("decode", "prefill") if best.prefill > current.prefill else ("prefill", "decode")
        return Move(source, target, best, predicted, speeds)

    def speeds(self, window: Window) -> dict[str, StepSpeed]:
        """How fast each pool's steps ran in the window against the profile."""
        return {pool: StepSpeed.of(steps, self._profile.step, self._engines[pool].tensor_parallel_size)
                for pool, steps in window.steps.items() if pool in self._engines}

    def attainment(self, split: Split, window: Window) -> float:
        """Predicted for `split` at the window's rate and mix, each pool's steps as slow as they ran
        in the window (as profiled where too few ran to tell)."""
        spec = ClusterSpec(prefill=Pool(split.prefill, self._engines["prefill"], self._profile),
                           decode=Pool(split.decode, self._engines["decode"], self._profile), costs=self.costs,
                           machine_cores=self.machine_cores).with_step_scales(step_scales(self.speeds(window)))
        limit = self._profile.max_model_len

        def request(i: int) -> tuple[tuple[int, ...], int]:
            prompt, output = window.mix[i % len(window.mix)]
            prompt = min(prompt, limit - 1)
            return _prompt(i, prompt, self._profile.vocab_size), max(1, min(output, limit - prompt))

        traffic = Traffic(request, max(SIMULATED_REQUESTS, len(window.mix)))
        return simulate(spec, traffic, window.rate, self.config.slo, limit).attainment


def _splits(nodes: int) -> Iterable[Split]:
    return (Split(p, nodes - p) for p in range(1, nodes))


def _prompt(index: int, length: int, vocab_size: int) -> tuple[int, ...]:
    """Token ids of simulated request `index`, which no other starts with: the prefix cache finds nothing."""
    rng = random.Random(index)
    return tuple(rng.randrange(1, vocab_size) for _ in range(length))
