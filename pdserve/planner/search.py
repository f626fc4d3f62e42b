"""The configurations a plan compares on N devices (cores on CPU), each simulated and ranked.

A `Candidate` is a `Layout` — colocated × k with N/k cores each, or p prefill nodes and d decode
nodes splitting the cores (each pool's cores evenly across its nodes, as `pdserve cluster
--*-cores` pins them; a node runs one torch thread per core; the router pinned to either pool's
cores, `ROUTER_POOLS`), each split also as the hybrid
(decode nodes started `--local-prefill`, the router at `--disaggregation auto` with each
`--local-prefill-max-tokens` bound asked for) — and the engine `Knobs` both pools
run (`--max-num-batched-tokens`, `--max-num-seqs`, `--chunk-schedule`) with the router's
`--stream-interval`, each pool at each
tensor-parallel size asked for that divides its nodes' cores (`--tensor-parallel-size`: the
node's cores split among its ranks). A candidate becomes the simulator's `ClusterSpec` (given the
profile of each (cores, TP) node setup) and the `pdserve cluster` command line that runs it.
Ranking: goodput per device, then the lower TTFT p90 and TPOT p90 at that rate; within `TIE_BAND` of
the best, the most headroom against the SLOs first (`ranked`).

Must never: measure or load torch; profiles come in.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve.sweep import SweepConfig
from pdserve.engine.config import EngineConfig
from pdserve.engine.step_shape import StepShape
from pdserve.planner.goodput import Prediction, Traffic, predict_goodput, start_rate
from pdserve.planner.profile import Profile, ServingCosts
from pdserve.planner.cluster_spec import ClusterSpec, Pool
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch.hybrid import Disaggregation, PrefillChoice

# The router's own default bound, the hybrid variant a plan tries unless told otherwise.
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = RouterConfig(model="").local_prefill_max_tokens

# Where a split's router is pinned, each tried. Never unpinned: the OS then runs it (and a client on
# the same machine) on whichever core it finds idle, and which that is flips with the load — on a
# 1P1D pair, the prefill core 85% of the time at 5 req/s, the decode core at 10.7 req/s, where it
# stretched the decode steps 3-4x. A pinned router runs where the simulator puts it.
ROUTER_POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class Layout:
    colocated: int = 0
    colocated_cores: int = 0  # per node
    prefill: int = 0
    prefill_cores: int = 0
    decode: int = 0
    decode_cores: int = 0
    # A hybrid split: decode nodes prefill prompts the router's `auto` rule sends them, within
    # this bound (`--local-prefill-max-tokens`); None: every request goes through the prefill pool.
    local_prefill_max_tokens: int | None = None
    # A hybrid's prompt budget (`--local-prefill-tokens-per-s`): prompt tokens a second each decode
    # node may compute for itself; None: no such bound.
    local_prefill_tokens_per_s: float | None = None
    # Decode nodes that are the prefill pool too (`--serve-prefill`, no prefill nodes): a hybrid pool.
    serve_prefill: bool = False
    # Each pool's tensor-parallel size (`--tensor-parallel-size`): a node's cores split among its ranks.
    colocated_tp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    # A split's router, pinned to this pool's cores (`--router-cores`): "prefill" or "decode".
    # None (colocated, and a serve-prefill pool: every core alike): unpinned.
    router_on: str | None = None

    def __post_init__(self) -> None:
        if self.router_on is not None and (self.colocated or self.serve_prefill or self.router_on not in ROUTER_POOLS):
            raise ValueError(f"router_on: {self.router_on!r} is not a pool of this split ({', '.join(ROUTER_POOLS)})")

    @property
    def mode(self) -> str:
        if self.colocated:
            return "colocated"
        return "disaggregated" if self.local_prefill_max_tokens is None and not self.serve_prefill else "hybrid"

    @property
    def devices(self) -> int:
        return self.colocated * self.colocated_cores + self.prefill * self.prefill_cores + self.decode * self.decode_cores

    @property
    def prefill_span(self) -> tuple[int, int]:
        """The prefill pool's cores, [start, end): the first ones."""
        return 0, self.prefill * self.prefill_cores

    @property
    def decode_span(self) -> tuple[int, int]:
        """The decode pool's cores, [start, end): those after the prefill pool's."""
        return self.prefill * self.prefill_cores, self.devices

    @property
    def router_span(self) -> tuple[int, int] | None:
        """The cores the router is pinned to, [start, end): its pool's; None: unpinned."""
        if self.router_on is None:
            return None
        return self.prefill_span if self.router_on == "prefill" else self.decode_span

    @property
    def router_cores(self) -> tuple[int, ...] | None:
        return None if self.router_span is None else tuple(range(*self.router_span))

    @property
    def setups(self) -> set[tuple[int, int]]:
        """(cores, TP) of every pool's nodes: the profiles this layout needs."""
        pools = ((self.colocated_cores, self.colocated_tp), (self.prefill_cores, self.prefill_tp),
                 (self.decode_cores, self.decode_tp))
        return {(cores, tp) for cores, tp in pools if cores}

    def pool_setup(self, kind: str) -> tuple[int, int]:
        """(cores, TP) of each node of one kind: "colocated", "prefill" or "decode"."""
        return getattr(self, f"{kind}_cores"), getattr(self, f"{kind}_tp")

    def describe(self) -> str:
        if self.colocated:
            node = _per_node(self.colocated, self.colocated_cores, self.colocated_tp)
            return f"colocated x{self.colocated} ({node})"
        if self.serve_prefill:
            return f"{self.decode}D serving prefill ({_per_node(self.decode, self.decode_cores, self.decode_tp)})"
        split = (f"{self.prefill}P ({_per_node(self.prefill, self.prefill_cores, self.prefill_tp)}) + "
                 f"{self.decode}D ({_per_node(self.decode, self.decode_cores, self.decode_tp)})")
        if self.local_prefill_max_tokens is not None:
            budget = "" if self.local_prefill_tokens_per_s is None else f" {self.local_prefill_tokens_per_s:.0f} tok/s"
            split += f" hybrid<={self.local_prefill_max_tokens}{budget}"
        return split if self.router_on is None else f"{split}, router on {self.router_on[0].upper()}"


def _per_node(nodes: int, cores: int, tp: int = 1) -> str:
    return f"{cores} core{'s' * (cores > 1)}{f' TP {tp}' * (tp > 1)}{' each' * (nodes > 1)}"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(devices: int, local_prefill_max_tokens: tuple[int, ...] = (),
            tp_sizes: tuple[int, ...] = (1,)) -> Iterator[Layout]:
    """Colocated × k for every k dividing N, then every split of the N cores between a prefill and
    a decode pool with every node count dividing each pool's cores, each split followed by its
    hybrid at every bound in `local_prefill_max_tokens`; with those hybrids, k decode nodes that
    serve prefill for every k > 1 dividing N; each of these at every pool's TP size in `tp_sizes`
    that divides its nodes' cores."""
    for base in _base_layouts(devices, local_prefill_max_tokens):
        yield from _with_tp(base, tp_sizes)


def _with_tp(layout: Layout, tp_sizes: tuple[int, ...]) -> Iterator[Layout]:
    def sizes(cores: int) -> list[int]:
        return [tp for tp in sorted(set(tp_sizes)) if cores % tp == 0]

    if layout.colocated:
        for tp in sizes(layout.colocated_cores):
            yield replace(layout, colocated_tp=tp)
        return
    if layout.serve_prefill:
        for tp in sizes(layout.decode_cores):
            yield replace(layout, decode_tp=tp)
        return
    for p_tp in sizes(layout.prefill_cores):
        for d_tp in sizes(layout.decode_cores):
            yield replace(layout, prefill_tp=p_tp, decode_tp=d_tp)


def _base_layouts(devices: int, local_prefill_max_tokens: tuple[int, ...]) -> Iterator[Layout]:
    for k in _divisors(devices):
        yield Layout(colocated=k, colocated_cores=devices // k)
    if local_prefill_max_tokens:  # hybrids asked for: the pools of decode nodes that serve prefill too
        for k in _divisors(devices)[1:]:
            yield Layout(decode=k, decode_cores=devices // k, serve_prefill=True)
    for prefill_cores in range(1, devices):
        decode_cores = devices - prefill_cores
        for p in _divisors(prefill_cores):
            for d in _divisors(decode_cores):
                for router_on in ROUTER_POOLS:
                    split = Layout(prefill=p, prefill_cores=prefill_cores // p, decode=d,
                                   decode_cores=decode_cores // d, router_on=router_on)
                    yield split
                    yield from (replace(split, local_prefill_max_tokens=bound) for bound in local_prefill_max_tokens)


@dataclass(frozen=True)
class Knobs:
    max_num_batched_tokens: int
    max_num_seqs: int
    chunk_schedule: str = "fixed"
    # The router's `--stream-interval`: tokens per response. Above 1 the stack's CPU per token falls
    # (fewer messages; pdserve/planner/measure_stack.py measures it at each interval), TTFT and the last
    # token are not held, so TPOT is its own; the gaps a client sees between responses grow.
    stream_interval: int = 1

    def router_args(self) -> list[str]:
        return [] if self.stream_interval == 1 else ["--stream-interval", str(self.stream_interval)]

    def node_args(self, tp: int = 1) -> list[str]:
        args = ["--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs", str(self.max_num_seqs)]
        if self.chunk_schedule != "fixed":
            args += ["--chunk-schedule", self.chunk_schedule]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        return args


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    knobs: Knobs

    def spec(self, base: EngineConfig, profiles: dict[tuple[int, int], Profile], costs: ServingCosts) -> ClusterSpec:
        """`base`: every node's engine config (model, dtype, block size, KV capacity)."""
        config = replace(base, max_num_batched_tokens=self.knobs.max_num_batched_tokens,
                         max_num_seqs=self.knobs.max_num_seqs, chunk_schedule=self.knobs.chunk_schedule)
        lay = self.layout

        def pool(count: int, cores: int, tp: int) -> Pool | None:
            if not count:
                return None
            return Pool(count, replace(config, num_threads=cores, tensor_parallel_size=tp), profiles[(cores, tp)])

        bound = DEFAULT_LOCAL_PREFILL_MAX_TOKENS if lay.serve_prefill else lay.local_prefill_max_tokens
        choice = None if bound is None else PrefillChoice(Disaggregation.AUTO, bound, lay.local_prefill_tokens_per_s)
        return ClusterSpec(pool(lay.colocated, lay.colocated_cores, lay.colocated_tp),
                           pool(lay.prefill, lay.prefill_cores, lay.prefill_tp),
                           pool(lay.decode, lay.decode_cores, lay.decode_tp), costs, choice, lay.serve_prefill,
                           stack_on=lay.router_on)

    def command(self, model: str, dtype: str, block_size: int) -> list[str]:
        """The `pdserve cluster` argv that runs this candidate on cores 0..N-1."""
        argv = ["pdserve", "cluster", "--model", model, "--dtype", dtype, "--block-size", str(block_size),
                *self._nodes_argv()]
        router_args = self._routing_args() + self.knobs.router_args()
        return argv + (["--router-args", shlex.join(router_args)] if router_args else [])

    def _nodes_argv(self) -> list[str]:
        """The pools, their cores and their nodes' flags."""
        lay = self.layout
        if lay.colocated:
            return ["--colocated", str(lay.colocated), "--colocated-cores", _cores(0, lay.devices),
                    "--colocated-args", shlex.join(self.knobs.node_args(lay.colocated_tp))]
        if lay.serve_prefill:
            return ["--prefill", "0", "--decode", str(lay.decode), "--decode-cores", _cores(0, lay.devices),
                    "--decode-args", f"{shlex.join(self.knobs.node_args(lay.decode_tp))} --serve-prefill"]
        argv = ["--prefill", str(lay.prefill), "--decode", str(lay.decode),
                "--prefill-cores", _cores(*lay.prefill_span), "--decode-cores", _cores(*lay.decode_span)]
        if lay.router_span is not None:
            argv += ["--router-cores", _cores(*lay.router_span)]
        argv += ["--prefill-args", shlex.join(self.knobs.node_args(lay.prefill_tp))]
        decode_args = shlex.join(self.knobs.node_args(lay.decode_tp))
        return argv + ["--decode-args", decode_args if lay.local_prefill_max_tokens is None
                       else f"{decode_args} --local-prefill"]

    def _routing_args(self) -> list[str]:
        """The router's flags for where prompts go: a hybrid's choice and its bounds."""
        lay = self.layout
        if lay.serve_prefill:
            return ["--disaggregation", Disaggregation.AUTO.value]
        if lay.colocated or lay.local_prefill_max_tokens is None:
            return []
        args = ["--disaggregation", Disaggregation.AUTO.value, "--local-prefill-max-tokens",
                str(lay.local_prefill_max_tokens)]
        if lay.local_prefill_tokens_per_s is not None:
            args += ["--local-prefill-tokens-per-s", f"{lay.local_prefill_tokens_per_s:.0f}"]
        return args


# The prompt chunk a decode node's prefill speed is read at, for its TPOT budget.
BUDGET_CHUNK_TOKENS = 256


def tpot_prompt_budget(profile: Profile, tpot_slo: float | None) -> float | None:
    """Prompt tokens a second a decode node of `profile` can compute for itself and still stream
    at `tpot_slo`: a node that spends a share F of its time on prompts stretches its decode steps'
    spacing by 1/(1-F), so F = 1 - step/TPOT, with the step of one decode over a chunk's context;
    times its prefill speed on `BUDGET_CHUNK_TOKENS`-token chunks. None: no TPOT target, or one
    step alone takes all of it (the node has no time to give)."""
    if tpot_slo is None:
        return None
    chunk = BUDGET_CHUNK_TOKENS
    step = profile.step.time(StepShape.of([(chunk, 1)]))
    share = 1.0 - step / tpot_slo
    if share <= 0:
        return None
    return share * chunk / profile.step.time(StepShape.of([(0, chunk)]))


# The shares of `tpot_prompt_budget` a plan tries: all of it keeps the mean TPOT at the target,
# the tail needs less (how much less depends on the workload, so the simulator decides).
BUDGET_FRACTIONS = (1.0, 0.5, 0.25)


def budget_rates(profile: Profile, tpot_slo: float | None, fractions: tuple[float, ...]) -> list[int]:
    """`--local-prefill-tokens-per-s` values: each of `fractions` of `tpot_prompt_budget`, in whole
    tokens, those of at least one."""
    rate = tpot_prompt_budget(profile, tpot_slo)
    if rate is None:
        return []
    return [r for r in (round(rate * f) for f in fractions) if r > 0]


def with_prompt_budgets(layouts: list[Layout], profiles: dict[tuple[int, int], Profile],
                        tpot_slo: float | None) -> list[Layout]:
    """Every layout, each hybrid followed by its copies bounded by `BUDGET_FRACTIONS` of the TPOT
    budget of its decode nodes (`budget_rates`) when there is one."""
    out = []
    for lay in layouts:
        out.append(lay)
        if lay.mode == "hybrid" and not lay.serve_prefill and lay.local_prefill_tokens_per_s is None:
            rates = budget_rates(profiles[(lay.decode_cores, lay.decode_tp)], tpot_slo, BUDGET_FRACTIONS)
            out += [replace(lay, local_prefill_tokens_per_s=rate) for rate in rates]
    return out


def _cores(start: int, end: int) -> str:
    return str(start) if end - start == 1 else f"{start}-{end - 1}"


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    prediction: Prediction

    @property
    def goodput_per_device(self) -> float:
        return self.prediction.goodput_rps / self.candidate.layout.devices

    def rank_key(self) -> tuple[float, float, float]:
        summary = self.prediction.run.summary
        ttft = summary.ttft_s.p90 if summary.ttft_s else float("inf")
        tpot = summary.tpot_s.p90 if summary.tpot_s else 0.0
        return -self.goodput_per_device, ttft, tpot


def evaluate(candidate: Candidate, base: EngineConfig, profiles: dict[int, Profile], traffic: Traffic, slo: Slo,
             sweep: SweepConfig, max_model_len: int, costs: ServingCosts = ServingCosts(),
             step_scales: Mapping[str, float] | None = None) -> Evaluated:
    """`step_scales`: each pool's steps this many times as long as profiled (how fast a validation
    measured them, pdserve/planner/step_speed.py); None: as profiled."""
    spec = candidate.spec(base, profiles, costs).with_step_scales(step_scales or {})
    sweep = replace(sweep, start_rate=start_rate(spec, traffic)) if sweep.rate_min is None else sweep
    return Evaluated(candidate, predict_goodput(spec, traffic, slo, max_model_len, sweep))


# Candidates predicted within this share of the best goodput per device are a tie: the planner's
# own measured median error is 0-11% here (docs/benchmarks.md), so the order inside the band is
# noise. In the two validated plans whose recommendation measured below the best (89%, 92%), the
# best measured was in the band with the most headroom.
TIE_BAND = 0.05


def ranked(results: list[Evaluated], slo: Slo) -> list[Evaluated]:
    """By goodput per device, then the lower TTFT p90 and TPOT p90; but those within `TIE_BAND` of
    the best go first by their headroom (`slo_share`, least first): the one a prediction error
    pushes past an SLO last."""
    by_goodput = sorted(results, key=Evaluated.rank_key)
    if not by_goodput or by_goodput[0].goodput_per_device <= 0:
        return by_goodput
    floor = by_goodput[0].goodput_per_device * (1 - TIE_BAND)
    tied = [e for e in by_goodput if e.goodput_per_device >= floor]  # a prefix of by_goodput
    return sorted(tied, key=lambda e: slo_share(e, slo)) + by_goodput[len(tied):]


def slo_share(e: Evaluated, slo: Slo) -> float:
    """The larger of its predicted TTFT p90 and TPOT p90 at its goodput rate, each as a share of
    its SLO (an SLO not set counts 0)."""
    summary = e.prediction.run.summary
    shares = [(dist.p90 / limit if dist is not None else math.inf)
              for dist, limit in ((summary.ttft_s, slo.ttft_s), (summary.tpot_s, slo.tpot_s)) if limit]
    return max(shares, default=0.0)
