"""`pdserve bench serve-compare`'s summary: each architecture against colocated, and each hybrid
against the better pure mode under every SLO."""

from __future__ import annotations

from pdserve.bench.serve.metrics import Slo
from pdserve.bench.serve_compare import _budget_args, _parser, _summary_lines
from tests.unit.planner_profiles import synthetic_profile


def result(**goodput_by_slo: float | None) -> dict:
    return {"sweeps": {slo: {"goodput_per_device": value} for slo, value in goodput_by_slo.items()}}


def test_each_hybrid_is_set_against_the_better_pure_mode():
    slos = {"tpot-tight": Slo(4.0, 0.035), "ttft-tight": Slo(0.3, 0.2)}
    results = {"disaggregated": result(**{"tpot-tight": 4.0, "ttft-tight": 1.0}),
               "colocated": result(**{"tpot-tight": 3.0, "ttft-tight": 5.0}),
               "hybrid": result(**{"tpot-tight": 2.0, "ttft-tight": None}),
               "hybrid-budget": result(**{"tpot-tight": 5.0, "ttft-tight": 4.0})}
    lines = _summary_lines(results, slos, 0.9)
    assert lines[1] == ("  tpot-tight (TTFT 4 s, TPOT 0.035 s): disaggregated 4 (1.33x), colocated 3, "
                        "hybrid 2 (0.67x), hybrid-budget 5 (1.67x); hybrid/best pure 0.50x; "
                        "hybrid-budget/best pure 1.25x")
    assert lines[2].endswith("; hybrid/best pure 0.00x; hybrid-budget/best pure 0.80x")


def test_the_budgeted_hybrid_runs_only_when_asked_for():
    assert _parser().parse_args([]).architectures == "disaggregated,colocated,hybrid"


def test_the_budgeted_hybrids_router_flags_are_the_planners_rate_for_each_slo():
    """A 6 ms decode step under a 30 ms TPOT: 0.8 x 256 / 0.261 s = 785 tokens/s, a quarter 196;
    a TPOT one step fills leaves nothing, and every prompt goes to the prefill pool."""
    profile = synthetic_profile(base_s=0.005, per_token_s=0.001)
    assert _budget_args(profile, 0.25, Slo(4.0, 0.03)) == (
        "--disaggregation", "auto", "--local-prefill-tokens-per-s", "196")
    assert _budget_args(profile, 0.25, Slo(4.0, 0.006)) == ("--disaggregation", "always")


def test_prompt_routes_reads_the_routers_counter_by_route():
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.bench.serve_compare import prompt_routes
    from pdserve.router.dispatch.state import PromptRoute, RouteCounts
    from pdserve.router.fronts.metrics import routes_collector

    routes = RouteCounts()
    for route in (PromptRoute.DECODE_NODE, PromptRoute.DECODE_NODE, PromptRoute.PREFILL_POOL):
        routes.count(route)
    registry = CollectorRegistry()
    registry.register(routes_collector(routes))
    assert prompt_routes(generate_latest(registry).decode()) == {"colocated": 0, "prefill_pool": 1, "decode_node": 2}
