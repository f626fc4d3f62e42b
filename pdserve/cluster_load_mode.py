"""`pdserve cluster --rebalance`: the planner's load mode, moving nodes between the prefill and
decode pools while the cluster serves.

Owns the flags (`LoadModeSettings`, `--rebalance-*`), what the planner's `Rebalancer` needs from
the launcher (`build_rebalancer`: each pool's engine config parsed from its own command line, the
nodes' profile and the serving stack's costs from the planner's cache — measured first by
`pdserve profile` in a child process when missing, since the launcher never loads torch), and the
`LoadWatcher`: a thread that scrapes the router's /metrics every interval and offers the launcher
a `Move` once the cooldown since the last one has passed. The launcher (cluster.py) carries a move out: it retires a node of the
source pool (SIGTERM: the node drains and leaves) and starts one of the target pool on its cores.

Must never: start or stop a process itself, or decide a move (pdserve/planner/load_mode.py does).
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common.affinity import available_cpus
from pdserve.common.metrics_endpoint import scrape

if TYPE_CHECKING:  # the planner is imported only by a launcher that runs the load mode
    from pdserve.planner.load_mode import LoadModeConfig, Move, Rebalancer, Scrape, Split, Window

SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LoadModeSettings:
    ttft_slo: float | None = field(default=None, metadata={"help": "seconds (unset: any TTFT meets it)"})
    tpot_slo: float | None = field(default=None, metadata={"help": "seconds (unset: any TPOT meets it)"})
    attainment: float = field(default=0.9, metadata={"help": "share of samples that must meet both SLOs"})
    interval_s: float = field(default=20.0, metadata={"help": "seconds of traffic each decision reads"})
    cooldown_s: float = field(default=60.0, metadata={"help": "seconds after a move before the next may start"})
    margin: float = field(default=0.05, metadata={
        "help": "predicted attainment the best split must gain over the current one to move a node"})
    min_samples: int = field(default=8, metadata={"help": "finished samples a window needs to say anything"})
    retire_grace_s: float = field(default=120.0, metadata={
        "help": "how long a node leaving its pool may take to drain before it is killed"})
    profile_dir: str | None = field(default=None, metadata={
        "help": "the planner's profile cache (default: <pdserve cache>/profiles); measured there when missing"})

    def __post_init__(self) -> None:
        if self.ttft_slo is None and self.tpot_slo is None:
            raise ValueError("--rebalance needs --rebalance-ttft-slo and/or --rebalance-tpot-slo")
        for flag, value in (("--rebalance-ttft-slo", self.ttft_slo), ("--rebalance-tpot-slo", self.tpot_slo)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--rebalance-attainment must be in (0, 1], got {self.attainment}")
        if not (self.interval_s > 0 and self.retire_grace_s > 0 and self.cooldown_s >= 0 and self.margin >= 0
                and self.min_samples >= 1):
            raise ValueError("--rebalance-interval-s and --rebalance-retire-grace-s must be > 0, "
                             "--rebalance-cooldown-s and --rebalance-margin >= 0, --rebalance-min-samples >= 1")

    def load_mode(self) -> LoadModeConfig:
        from pdserve.bench.serve.metrics import Slo
        from pdserve.planner.load_mode import LoadModeConfig

        return LoadModeConfig(Slo(self.ttft_slo, self.tpot_slo), self.attainment, self.margin, self.min_samples)


def build_rebalancer(settings: LoadModeSettings, node_argvs: Sequence[tuple[str, ...]],
                     router_argv: Sequence[str] = (), python: str = sys.executable,
                     log: Callable[[str], None] = print) -> Rebalancer:
    """`node_argvs`: every node's command line, `python -m pdserve <kind> ...`; `router_argv`: the
    router's (its `--stream-interval` picks the stack's costs). A moved node keeps its cores, so
    every node must run as many torch threads: one profile serves every split."""
    from pdserve.node.config import parse_node_args
    from pdserve.planner.load_mode import Rebalancer
    from pdserve.planner.profile import NodeSetup, ProfileCache, machine_facts, model_hash, profile_key

    configs = [parse_node_args(list(argv[4:]), argv[3]) for argv in node_argvs]
    nodes = [(argv[3], config.engine) for argv, config in zip(node_argvs, configs)]
    threads = {engine.num_threads for _, engine in nodes}
    if len(threads) != 1 or None in threads:
        raise ValueError("--rebalance moves a node with its cores: every node needs the same number of threads "
                         f"(pin the pools evenly or give --threads-per-node), got {sorted(threads, key=str)}")
    engines = dict(nodes)
    decode, count = engines["decode"], threads.pop()
    setup = NodeSetup(count, _dtype(decode.dtype), decode.block_size)
    cache = ProfileCache(settings.profile_dir)
    digest, machine = model_hash(decode.model), machine_facts()
    key = profile_key(digest, machine, setup)
    if cache.load(key) is None:
        log(f"load mode: profiling {setup.describe()} and the serving stack first (pdserve profile; cached for "
            "the next start)")
        argv = [python, "-m", "pdserve", "profile", "--model", decode.model, "--threads", str(count),
                "--dtype", decode.dtype, "--block-size", str(decode.block_size), "--no-progress"]
        subprocess.run(argv + (["--profile-dir", settings.profile_dir] if settings.profile_dir else []), check=True,
                       stdout=subprocess.DEVNULL)
    # Pinned (`--cpus`), the launcher split the pools' cores among the nodes: each has its own.
    # Unpinned, they share this process's cores.
    machine_cores = None if all(config.cpus for config in configs) else len(available_cpus())
    return Rebalancer(settings.load_mode(), engines["prefill"], decode, cache.load(key),
                      _stack_costs(cache, digest, machine, _stream_interval(router_argv), log), machine_cores)


def _stream_interval(router_argv: Sequence[str]) -> int:
    """The router's `--stream-interval` (its default when not given)."""
    import argparse

    from pdserve.common.config_flags import add_config_args
    from pdserve.router.config import RouterConfig

    parser = argparse.ArgumentParser(add_help=False)
    add_config_args(parser, RouterConfig, only=("stream_interval",))
    return parser.parse_known_args(list(router_argv))[0].stream_interval


def _stack_costs(cache, digest: str, machine: dict, stream_interval: int, log: Callable[[str], None]):
    """The router's and the nodes' fronts' CPU from the planner's cache at the router's stream
    interval (the clients run elsewhere: not charged); at one token per response when the interval
    was never measured here (an over-estimate), none when the stack never was (a profile taken
    with --skip-router)."""
    from pdserve.planner.profile import FrontCost, RouterCost, ServingCosts, stack_keys

    router_at, front_at, _ = stack_keys(digest, machine, stream_interval)
    router, fronts = cache.load(router_at, RouterCost), cache.load(front_at, FrontCost)
    if (router is None or fronts is None) and stream_interval != 1:
        log(f"load mode: the serving stack's CPU at --stream-interval {stream_interval} was never measured for "
            f"this model here (`pdserve plan --stream-intervals {stream_interval}` measures it): the simulator "
            "charges its cost at one token per response")
        return _stack_costs(cache, digest, machine, 1, log)
    if router is None or fronts is None:
        log("load mode: the serving stack's CPU was never measured for this model here (`pdserve profile` "
            "measures it): the simulator charges none")
        return ServingCosts()
    return ServingCosts(router, fronts)


def _dtype(name: str) -> str:
    from pdserve.engine.dtype_choice import resolve_dtype

    return resolve_dtype(name)


def scrape_url(url: str) -> Callable[[], str]:
    return lambda: scrape(url, SCRAPE_TIMEOUT_S)


class LoadWatcher:
    """Every `interval_s`, one window of the router's traffic; a `Move` offered on `moves` when the
    rebalancer decides one, no move is in progress (`busy()`) and the cooldown has passed."""

    def __init__(self, rebalancer: Rebalancer, settings: LoadModeSettings, scrape: Callable[[], str],
                 split: Callable[[], Split], busy: Callable[[], bool], log: Callable[[str], None]) -> None:
        self._rebalancer, self._settings, self._scrape = rebalancer, settings, scrape
        self._split, self._busy, self._log = split, busy, log
        self.moves: queue.Queue[tuple[Move, Split]] = queue.Queue()
        self._last_move = float("-inf")
        self._thread: threading.Thread | None = None

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="load-mode", daemon=True)
        self._thread.start()

    def moved(self) -> None:
        """The launcher finished a move: the cooldown counts from now."""
        self._last_move = time.monotonic()

    def _run(self, stop: threading.Event) -> None:
        from pdserve.planner.load_mode import Window

        previous = self._take()
        while not stop.wait(self._settings.interval_s):
            current = self._take()
            if previous is not None and current is not None:
                self._consider(Window.between(previous, current, self._rebalancer.config.slo))
            previous = current

    def _take(self) -> Scrape | None:
        from pdserve.planner.load_mode import Scrape

        try:
            return Scrape.parse(self._scrape(), time.monotonic())
        except OSError as err:  # the router restarting: the next window starts after it
            self._log(f"load mode: the router's metrics could not be read ({err}); trying again next interval")
            return None

    def _consider(self, window: Window) -> None:
        if self._busy() or time.monotonic() - self._last_move < self._settings.cooldown_s:
            return
        from pdserve.planner.load_mode import Hold

        split = self._split()
        decision = self._rebalancer.decide(window, split)
        if isinstance(decision, Hold):
            self._log(f"load mode: {window.describe()}; {decision.describe(split)}")
        elif decision is not None:
            self.moves.put((decision, split))
