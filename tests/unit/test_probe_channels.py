"""A probe opens its own connection (common/channels.py `FRESH_CONNECTION`): a process coming up
answers the very next probe, not one after gRPC's per-address reconnect backoff, which the
probes that found nothing listening would otherwise have started for every channel of this
process (the launcher saw a started cluster 2–3 s late)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.cluster_plan import resolve_port
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
