"""The standard gRPC services on a real cluster: what probes and grpcurl ask of any gRPC server.

- `grpc.health.v1.Health` (the grpc_health_probe call): the router and every node answer
  SERVING for the overall status and for their own services; a router with no nodes answers
  NOT_SERVING (it runs, but cannot serve a request) but SERVING for its Registry (nodes can
  join: it is alive); an unknown service is NOT_FOUND.
- Reflection lists each server's services (what `grpcurl -plaintext HOST:PORT list` prints).
- A bad request's INVALID_ARGUMENT carries a `google.rpc.BadRequest` detail naming the field.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.cluster import NodeSettings, assert_every_block_free, free_port, running_cluster

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
NODE_SERVICES = {"prefill": "pdserve.node.v1.PrefillNode", "decode": "pdserve.node.v1.DecodeNode"}
ROUTER_SERVICES = ["pdserve.v1.Generation", "pdserve.node.v1.Registry"]
STANDARD = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings()) as running:
        yield running


@pytest.fixture(autouse=True)
def no_blocks_left(cluster):
    """Every test ends with no block used or reserved on any node."""
    yield
    assert_every_block_free(cluster)


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def listed_services(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())


def test_health_and_reflection_on_the_router_and_every_node(cluster):
    assert health_of(cluster.router) == SERVING
    assert [health_of(cluster.router, s) for s in ROUTER_SERVICES] == [SERVING, SERVING]
    assert listed_services(cluster.router) == sorted(ROUTER_SERVICES + STANDARD)
    for kind in ("prefill", "decode"):
        address = cluster.addresses(kind)[0]
        assert health_of(address) == health_of(address, NODE_SERVICES[kind]) == SERVING
        assert listed_services(address) == sorted([NODE_SERVICES[kind], *STANDARD])
    with pytest.raises(grpc.RpcError) as unknown:
        health_of(cluster.router, "no.such.Service")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_a_router_without_nodes_runs_but_is_not_serving(model_dir):
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in router.stdout:  # the router says when it listens
            if "listening on" in line:
                break
        address = f"127.0.0.1:{port}"
        assert health_of(address) == NOT_SERVING
        assert health_of(address, "pdserve.v1.Generation") == NOT_SERVING
        # Alive, waiting for nodes: what Kubernetes' liveness probe asks (deploy/k8s/).
        assert health_of(address, "pdserve.node.v1.Registry") == SERVING
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_invalid_argument_carries_a_bad_request_detail_naming_the_field(cluster):
    with grpc.insecure_channel(cluster.router) as channel:
        request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=[5, 6]),
                                              sampling_params=pdserve_pb2.SamplingParams(max_tokens=4, top_p=7.0))
        with pytest.raises(grpc.RpcError) as refused:
            list(pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(refused.value)
        detail = error_details_pb2.BadRequest()
        assert status is not None and len(status.details) == 1 and status.details[0].Unpack(detail)
        assert [v.field for v in detail.field_violations] == ["top_p"]
        assert detail.field_violations[0].description == refused.value.details()
