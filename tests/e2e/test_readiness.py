"""No request before the cluster can serve it: a router started alone, then a node joins.

Until a route for a request exists (a colocated node, or a prefill and a decode node) every
readiness signal says "not yet", with the same reason: HTTP `/health` on the API port and on
the metrics port (503), `/v1/models` (503, OpenAI's error JSON: what OpenAI clients poll),
grpc.health.v1 (NOT_SERVING; the Registry SERVING: the router is alive, nodes can join), and a
request is refused 503. Once a colocated node registers, all of them turn at once, and a
request is served.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.healthcheck import node_stats
from pdserve.testing.waiting import wait_until
from tests.e2e.cluster import START_TIMEOUT_S
from tests.e2e.test_clean_edges import NODE_FLAGS, Command, get, health_url, line_value

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NO_ROUTE = ("no route for a request yet (0 prefill, 0 decode and 0 colocated nodes live): the router serves "
            "once a colocated node, or a prefill and a decode node, have registered")


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def readiness(address: str, api: str, metrics: str) -> dict:
    models_status, models_body = get(f"{api}/models")
    return {"health": get(f"{api.removesuffix('/v1')}/health"), "metrics_health": get(health_url(metrics)),
            "models": (models_status, json.loads(models_body)), "grpc": health_of(address),
            "registry": health_of(address, "pdserve.node.v1.Registry")}


def test_a_router_is_ready_only_once_a_node_registers(model_dir):
    with Command("router", "--model", model_dir, "--port", "0", "--http-port", "0", "--metrics-port", "0") as router:
        router.wait_for("pdserve router metrics on ")
        address = line_value(router.stdout, "pdserve router listening on ")
        api = line_value(router.stdout, "pdserve router OpenAI-compatible HTTP API on ")
        metrics = line_value(router.stdout, "pdserve router metrics on ")
        not_ready = {"message": NO_ROUTE, "type": "service_unavailable", "param": None, "code": "UNAVAILABLE"}
        assert readiness(address, api, metrics) == {
            "health": (503, f"not serving: {NO_ROUTE}\n"), "metrics_health": (503, f"not serving: {NO_ROUTE}\n"),
            "models": (503, {"error": not_ready}), "grpc": NOT_SERVING, "registry": SERVING}
        status, body = post(f"{api}/completions", {"prompt": "Hello", "max_tokens": 4})
        assert (status, body["error"]["code"]) == (503, "UNAVAILABLE")
        # It tokenizes and reads a config, runs no model: torch stays out of its process
        # (pdserve/router/fronts/entry.py), seconds of CPU at every start.
        assert "libtorch" not in Path(f"/proc/{router.proc.pid}/maps").read_text()

        with Command("colocated", "--model", model_dir, "--port", "0", "--router", address, *NODE_FLAGS) as node:
            node.wait_for("pdserve colocated node listening on ")
            wait_until(lambda: health_of(address) == SERVING, "the router serves", START_TIMEOUT_S)
            ready = readiness(address, api, metrics)
            serving = f"serving: router on {address}, 0 prefill, 0 decode and 1 colocated nodes live\n"
            assert (ready["health"], ready["metrics_health"], ready["grpc"]) == ((200, serving), (200, serving),
                                                                                 SERVING)
            assert ready["models"][0] == 200 and ready["models"][1]["data"][0]["id"] == model_dir.rsplit("/", 1)[-1]
            status, body = post(f"{api}/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True})
            assert (status, body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (200, 4,
                                                                                                        "length")
            node_address = line_value(node.stdout, "pdserve colocated node listening on ")
            stats = wait_until(lambda: (s := node_stats(node_address, "colocated")).used_blocks == 0 and s,
                               "the node holds no block", 30)
            assert (stats.used_blocks, stats.reserved_blocks) == (0, 0)
