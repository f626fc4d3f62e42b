"""The edges every command shares, one seam at a time: a busy port's one-line error, the stop
signal's exit status, and `/health` on the metrics endpoint (a fake health check, a node's
phases, the real router server in-process).

The commands themselves (Ctrl-C, busy ports, a dead engine core) run as real processes in
tests/e2e/test_clean_edges.py.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from pdserve.common.lifecycle import PARENT_PID_ENV, ExitStatus, StopSignals, status_after, supervisor_of
from pdserve.common.metrics_endpoint import Health, MetricsEndpoint
from pdserve.common.ports import Listen, PortUnavailable, check_free, unavailable
from pdserve.node.front.metrics import NodeHealth
from pdserve.router.config import RouterConfig
from pdserve.router.fronts.server import RouterServer
from pdserve.testing.router import run

HOST = "127.0.0.1"


@pytest.fixture
def held_port():
    """A port something listens on (a plain socket, as any other program would hold it)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


# -- ports ----------------------------------------------------------------------------------


def test_a_held_port_is_refused_naming_the_flag_and_the_address(held_port):
    with pytest.raises(PortUnavailable) as refused:
        check_free(Listen("--metrics-port", HOST, held_port))
    assert str(refused.value) == f"--metrics-port {held_port}: {HOST}:{held_port} is already in use"
    assert refused.value.listen == Listen("--metrics-port", HOST, held_port)


def test_a_port_held_on_one_address_is_busy_on_every_interface(held_port):
    with pytest.raises(PortUnavailable) as refused:
        check_free(Listen("--kv-port", "0.0.0.0", held_port))
    assert str(refused.value) == f"--kv-port {held_port}: 0.0.0.0:{held_port} is already in use"


def test_a_free_port_and_port_0_pass(held_port):
    check_free(Listen("--port", HOST, 0))
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        free = sock.getsockname()[1]  # bound, not listening: closed again below
    check_free(Listen("--port", HOST, free))


def test_a_failed_bind_says_why(held_port):
    # Without the OS's error (gRPC gives none), a probe of the address finds it.
    assert str(unavailable(Listen("--port", HOST, held_port))) == (
        f"--port {held_port}: {HOST}:{held_port} is already in use")
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES))
    assert str(unavailable(Listen("--port", HOST, 80), denied)) == (
        f"--port 80: {HOST}:80 cannot be bound: {os.strerror(errno.EACCES)}")
    assert Listen("--port", "::1", 5).address == "[::1]:5"


# -- exit statuses --------------------------------------------------------------------------


def test_ctrl_c_ends_with_130_and_sigterm_with_0():
    assert status_after(signal.SIGINT) is ExitStatus.INTERRUPTED == 130
    assert status_after(signal.SIGTERM) is ExitStatus.OK
    assert status_after(None) is ExitStatus.OK


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, ExitStatus.INTERRUPTED), (signal.SIGTERM, ExitStatus.OK)])
def test_a_stop_signal_sets_the_event_and_says_how_to_exit(signum, status):
    async def scenario() -> tuple[int | None, ExitStatus]:
        loop = asyncio.get_running_loop()
        signals = StopSignals()
        signals.install(loop)
        try:
            os.kill(os.getpid(), signum)
            await signals.event.wait()
            return signals.received, signals.exit_status
        finally:
            for installed in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(installed)

    assert run(scenario()) == (signum, status)


def test_a_supervised_process_stops_once_its_supervisor_is_gone():
    parent = [42]

    async def scenario() -> tuple[bool, int | None, ExitStatus]:
        loop = asyncio.get_running_loop()
        signals = StopSignals()
        signals.install(loop, supervisor_pid=42, parent_pid=lambda: parent[0])
        try:
            await asyncio.sleep(0)
            still_running = not signals.event.is_set()
            parent[0] = 1  # the supervisor died: the process was handed to init
            await asyncio.wait_for(signals.event.wait(), 10)
            return still_running, signals.received, signals.exit_status
        finally:
            for installed in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(installed)

    assert run(scenario()) == (True, signal.SIGTERM, ExitStatus.OK)


def test_the_supervisor_pid_comes_from_the_environment_only_when_set():
    assert supervisor_of({PARENT_PID_ENV: "1234"}) == 1234
    assert supervisor_of({}) is None and supervisor_of({PARENT_PID_ENV: ""}) is None


# -- /health on the metrics endpoint ---------------------------------------------------------


class FakeHealth:
    """Stands in for a process's health check; the test says what it answers."""

    def __init__(self, verdict: Health | Exception) -> None:
        self.verdict = verdict

    def __call__(self) -> Health:
        if isinstance(self.verdict, Exception):
            raise self.verdict
        return self.verdict


@pytest.fixture
def endpoint():
    registry = CollectorRegistry()
    Counter("pdserve_test_events", "events", registry=registry).inc(3)
    health = FakeHealth(Health(True, "the test server on 127.0.0.1:1"))
    served = MetricsEndpoint.start(HOST, 0, registry, health)
    try:
        yield served, health
    finally:
        served.stop()


def test_health_answers_200_while_the_process_serves(endpoint):
    served, _ = endpoint
    assert served.health_url == f"http://{HOST}:{served.port}/health"
    assert get(served.health_url) == (200, "serving: the test server on 127.0.0.1:1\n")
    status, text = get(served.url)
    assert status == 200 and "pdserve_test_events_total 3.0" in text.splitlines()


def test_health_answers_503_with_the_reason_when_it_does_not(endpoint):
    served, health = endpoint
    health.verdict = Health(False, "its engine core is down")
    assert get(served.health_url) == (503, "not serving: its engine core is down\n")
    health.verdict = RuntimeError("boom")
    assert get(served.health_url) == (503, "not serving: the health check failed: RuntimeError: boom\n")
    assert get(served.url)[0] == 200  # the metrics are served whatever the health says


def test_the_endpoint_refuses_a_held_port(held_port):
    with pytest.raises(OSError) as refused:
        MetricsEndpoint.start(HOST, held_port, CollectorRegistry(), FakeHealth(Health(True, "-")))
    assert refused.value.errno == errno.EADDRINUSE


def test_a_node_serves_only_between_start_and_stop_while_its_core_runs():
    core = {"alive": True}
    health = NodeHealth("decode", lambda: core["alive"])
    assert health() == Health(False, "decode node starting: its engine core is loading the model")
    health.serving("127.0.0.1:7001")
    assert health() == Health(True, "decode node on 127.0.0.1:7001, engine core running")
    core["alive"] = False
    assert health() == Health(False, "decode node on 127.0.0.1:7001: its engine core is down")
    health.stopping()
    assert health() == Health(False, "decode node stopping")


def test_the_router_serves_health_only_while_it_can_serve(router_model):
    path, loaded = router_model

    def verdict(server: RouterServer) -> tuple[int, str]:
        health = server.health()
        return 200 if health.serving else 503, health.reason

    async def scenario() -> tuple[int, list[tuple[int, str]]]:
        server = RouterServer(RouterConfig(model=path, port=0, metrics_port=0), loaded)
        seen = [verdict(server)]
        port = await server.start()
        seen.append(await asyncio.to_thread(get, server.metrics_url.replace("/metrics", "/health")))
        await server.stop(0)
        seen.append(verdict(server))
        return port, seen

    port, seen = run(scenario())
    assert seen == [(503, "router starting"),
                    (503, "not serving: no route for a request yet (0 prefill, 0 decode and 0 colocated nodes "
                          "live): the router serves once a colocated node, or a prefill and a decode node, have "
                          "registered\n"),
                    (503, "router stopping")]
