"""Cluster-wide facts are checked when a node registers: its fingerprint (model, dtype, block
size, KV layout) must agree with the router's own facts and with the nodes already registered.

The comparison itself (pdserve/router/cluster/node_facts.py), the registry's `admit`, the real router's
Registry service, and a node's real registration loop against it: a refused node's loop ends
with the router's one line instead of retrying.
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.common.refusal import EXIT_REFUSED
from pdserve.engine.config import EngineConfig
from pdserve.kv_transfer.base import FINGERPRINT_FIELDS, KV_LAYOUT_VERSION
from pdserve.node.config import NodeConfig
from pdserve.node.front.registration import RegistrationRefused, run_registration
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.errors import NodeRefused, status_of
from pdserve.router.cluster.node_facts import RouterFacts, disagreements
from pdserve.router.cluster.registry import NodeKind, NodeRegistry
from pdserve.testing.router import run, running_router
from tests.unit.test_node_heartbeat import snapshot

ROUTER = RouterFacts(model="tiny", block_size=8, num_layers=3, num_kv_heads=2, head_dim=16)


def fingerprint(**changes) -> node_pb2.NodeFingerprint:
    fields = dict(model="tiny", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=16, block_size=8,
                  layout_version=KV_LAYOUT_VERSION)
    return node_pb2.NodeFingerprint(**(fields | changes))


def test_the_registered_fingerprint_carries_exactly_the_kv_handshakes_fields():
    assert tuple(f.name for f in node_pb2.NodeFingerprint.DESCRIPTOR.fields) == FINGERPRINT_FIELDS


def test_a_node_like_the_router_and_its_nodes_agrees():
    assert disagreements(fingerprint(), ROUTER, [("d0", fingerprint()), ("p0", fingerprint())]) == []


def test_the_router_owns_model_block_size_and_kv_shape():
    node = fingerprint(model="other", block_size=16, head_dim=32)
    assert disagreements(node, ROUTER, []) == [
        "model: this node has other, the router tiny",
        "block_size: this node has 16, the router 8",
        "head_dim: this node has 32, the router 16",
    ]


def test_dtype_and_layout_must_match_the_nodes_already_registered():
    others = [("d0", fingerprint()), ("p0", fingerprint(layout_version=KV_LAYOUT_VERSION + 1))]
    assert disagreements(fingerprint(dtype="bfloat16"), ROUTER, others) == [
        "dtype: this node has bfloat16, node d0 float32 (set the same --dtype on every node)",
        f"layout_version: this node has {KV_LAYOUT_VERSION}, node p0 {KV_LAYOUT_VERSION + 1}",
    ]


def registry() -> NodeRegistry:
    return NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=0.0, clock=lambda: 0.0)


def test_the_registry_refuses_a_node_whose_dtype_differs_and_keeps_the_others():
    nodes = registry()
    nodes.admit(NodeKind.DECODE, "127.0.0.1:1", "d0", fingerprint(), ROUTER)
    with pytest.raises(NodeRefused) as err:
        nodes.admit(NodeKind.PREFILL, "127.0.0.1:2", "p0", fingerprint(dtype="bfloat16"), ROUTER)
    assert str(err.value) == "dtype: this node has bfloat16, node d0 float32 (set the same --dtype on every node)"
    assert status_of(err.value) == (grpc.StatusCode.FAILED_PRECONDITION, str(err.value))
    assert [e.node_id for e in nodes.live(NodeKind.DECODE)] == ["d0"] and nodes.live(NodeKind.PREFILL) == []


def test_colocated_nodes_are_held_to_the_same_dtype():
    nodes = registry()
    nodes.admit(NodeKind.COLOCATED, "127.0.0.1:1", "c0", fingerprint(), ROUTER)
    with pytest.raises(NodeRefused, match="^dtype: this node has bfloat16, node c0 float32"):
        nodes.admit(NodeKind.COLOCATED, "127.0.0.1:2", "c1", fingerprint(dtype="bfloat16"), ROUTER)


def test_a_node_registering_again_is_compared_with_the_others_not_with_itself():
    nodes = registry()
    nodes.admit(NodeKind.DECODE, "127.0.0.1:1", "d0", fingerprint(), ROUTER)
    entry = nodes.admit(NodeKind.DECODE, "127.0.0.1:1", "d0", fingerprint(dtype="bfloat16"), ROUTER)  # restarted
    assert entry.fingerprint.dtype == "bfloat16" and nodes.live(NodeKind.DECODE) == [entry]


async def register(address: str, request: node_pb2.RegisterRequest) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await node_pb2_grpc.RegistryStub(channel).Register(request)
        health = await pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest())
    assert health.decode_nodes == 0  # the node never joined
    return err.value


def test_the_router_refuses_a_node_without_a_fingerprint_or_with_another_block_size(router_model):
    async def scenario():
        async with running_router(router_model, block_size=8) as address:
            bare = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="d0")
            other = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="d0",
                                             fingerprint=fingerprint(block_size=16))
            return await register(address, bare), await register(address, other)

    missing, mismatch = run(scenario())
    assert missing.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert missing.details() == "fingerprint is required: the model, dtype, block size and KV layout the node runs"
    assert mismatch.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert mismatch.details() == "block_size: this node has 16, the router 8"


def test_a_refused_node_stops_registering_with_the_routers_line(router_model):
    async def scenario():
        async with running_router(router_model, block_size=8) as address:
            config = NodeConfig(EngineConfig("/m"), router=address, node_id="d0", heartbeat_interval_s=0.02)
            node = {name: getattr(fingerprint(block_size=16), name) for name in FINGERPRINT_FIELDS}  # as CoreStarted
            with pytest.raises(RegistrationRefused) as err:
                await run_registration(config, "127.0.0.1:7000", lambda: snapshot(0), node)
            return address, err.value

    address, refused = run(scenario())
    assert str(refused) == f"the router at {address} refused this node: block_size: this node has 16, the router 8"
    assert refused.exit_code == EXIT_REFUSED
