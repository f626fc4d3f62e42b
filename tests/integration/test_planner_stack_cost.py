"""`pdserve profile`'s serving-stack measurement on the tiny model: a real colocated cluster
started as users start it, and the router's, the node front's and the client's CPU per request
and per token read from their processes."""

from __future__ import annotations

from pdserve.planner.measure_stack import measure_stack_cost, per_request_and_token


def test_the_router_the_front_and_the_client_each_cost_cpu_per_token(tiny_llama):
    costs = measure_stack_cost(str(tiny_llama))
    for cost, process in ((costs.router, "router's process"), (costs.fronts, "node's front process"),
                          (costs.client, "client")):
        assert cost.per_token_s > 0 and cost.per_request_s >= 0
        assert process in cost.method and "8 at once, all on one core" in cost.method


def test_the_costs_are_measured_at_a_stream_interval(tiny_llama):
    costs = measure_stack_cost(str(tiny_llama), stream_interval=4)
    for cost in (costs.router, costs.fronts, costs.client):
        assert cost.per_token_s > 0 and cost.method.endswith("all on one core, stream interval 4")


def test_two_runs_separate_the_cost_per_request_from_the_cost_per_token():
    # 10 requests: 20 tokens for 0.03 s, then 320 tokens for 0.18 s -> 0.5 ms/token, 2 ms/request.
    per_request, per_token = per_request_and_token([(20, 0.03), (320, 0.18)], 10)
    assert (round(per_request, 6), round(per_token, 6)) == (0.002, 0.0005)
    assert per_request_and_token([(20, 0.03), (320, 0.01)], 10) == (0.003, 0.0)  # noise: never negative
