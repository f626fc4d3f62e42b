"""The channel options of pdserve/common/channels.py, against real gRPC servers on 127.0.0.1.

- A probe opens its own connection (`FRESH_CONNECTION`): a process coming up answers the very
  next probe, not one after gRPC's per-address reconnect backoff, which the probes that found
  nothing listening would otherwise have started for every channel of this process (the
  launcher saw a started cluster 2–3 s late).
- A channel between router and node (`RECONNECT_WITHIN_A_SECOND`) gives a connection time for a
  slow handshake: at 100 ms a router took a node that had just started for a lost one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster_plan import resolve_port
from pdserve.common.channels import reconnecting_channel
from pdserve.healthcheck import standard_status

HOST = "127.0.0.1"
PROBES_BEFORE = 20


def test_a_probe_right_after_a_refused_one_reaches_a_server_that_just_started():
    address = f"{HOST}:{resolve_port(HOST, 0)}"
    for _ in range(PROBES_BEFORE):  # as the launcher probes a router that is still importing
        try:
            standard_status(address, "", timeout_s=2.0)
            raise AssertionError("nothing listens there yet")
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE
    server = grpc.server(ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(address)
    server.start()
    try:
        # Within the backoff gRPC would keep for the address (1 s at first): answered at once.
        assert standard_status(address, "", timeout_s=2.0) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


class SlowHandshake:
    """A TCP relay to `backend` that opens each connection's way through `delay_s` late: a
    server whose HTTP/2 handshake is slow (a node just started, on busy cores)."""

    def __init__(self, backend: str, delay_s: float) -> None:
        self._backend, self._delay_s = backend, delay_s
        self._listener = socket.create_server((HOST, 0))
        self.address = f"{HOST}:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        time.sleep(self._delay_s)
        host, port = self._backend.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()


def test_a_peer_channel_waits_out_a_slow_handshake_instead_of_calling_the_peer_lost():
    server = grpc.server(ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    backend = f"{HOST}:{server.add_insecure_port(f'{HOST}:0')}"
    server.start()
    relay = SlowHandshake(backend, delay_s=0.3)  # three times the 100 ms these channels once allowed

    async def check() -> int:
        async with reconnecting_channel(relay.address) as channel:
            return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)).status

    try:
        assert asyncio.run(check()) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)
