"""Separate credentials under `pdserve cluster --api-keys-file`: client API keys open the public API
(gRPC metadata and HTTP bearer alike, exact tokens) and nothing else; the node join credential
(`--auth-token-file`) is what nodes, node registration and KV peers take.

A client key registering a node is refused PERMISSION_DENIED naming the credential it takes; a
client key on a node service is UNAUTHENTICATED (a node knows only the join credential), and so
is an unknown key on the public API; a KV peer presenting a client key is refused at its HELLO.
Keys reload when the file is replaced, without a restart. Every node ends with no block held.
"""

from __future__ import annotations

import importlib.util
import os

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.common.auth import call_metadata
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.ranks.kv_ranks import NodeKVDescriptor
from tests.e2e.cluster import NodeSettings, assert_every_block_free, running_cluster
from tests.e2e.test_auth import token_sender_main
from tests.e2e.test_kv_transfer_ucx import Cluster as ProcessPair, expect, spec_kwargs
from tests.integration.reference import assert_matches, greedy_references

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

NODE_TOKEN = "node-Join.credential-0123456789"
KEYS = ("sk-client-one-0123", "sk-client-two-4567")
PROMPT = [9, 4, 77, 301, 12, 12, 640, 5, 58, 2, 870]
NEW_TOKENS = 6
UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED,
                   "missing or wrong auth token: send metadata 'authorization: Bearer <token>'")
REGISTRY_REFUSED = (grpc.StatusCode.PERMISSION_DENIED,
                    "an API key opens only the public API, not pdserve.node.v1.Registry: that takes the node join "
                    "credential (--auth-token-file)")


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text("# clients\n" + "\n".join(KEYS) + "\n")
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=8, num_blocks=64), auth_token=NODE_TOKEN,
                         launcher_args=("--api-keys-file", str(keys_file))) as running:
        yield running, keys_file


def generate(router: str, key: str) -> list[int]:
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=PROMPT), sampling_params=(
        pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)))
    with grpc.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return [t for r in stub.Generate(request, timeout=60, metadata=call_metadata(key)) for t in r.token_ids]


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_each_client_key_opens_the_public_api_on_grpc_and_http(cluster, model_dir):
    running, _ = cluster
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    for key in KEYS:
        assert_matches([generate(running.router, key)], [reference])
        answer = openai.OpenAI(base_url=running.state.http, api_key=key, max_retries=0).completions.create(
            model="llama", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert answer.choices[0].text == AutoTokenizer.from_pretrained(model_dir).decode(reference.token_ids)
    assert refusal(lambda: generate(running.router, "sk-unknown")) == UNAUTHENTICATED
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=running.state.http, api_key="sk-unknown", max_retries=0).models.list()
    assert refused.value.status_code == 401 and refused.value.body["code"] == "UNAUTHENTICATED"
    assert_every_block_free(running)


def test_a_client_key_cannot_register_a_node_or_heartbeat(cluster):
    running, _ = cluster
    with grpc.insecure_channel(running.router) as channel:
        registry = node_pb2_grpc.RegistryStub(channel)
        register = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="rogue")
        assert refusal(lambda: registry.Register(register, timeout=10, metadata=call_metadata(KEYS[0]))) \
            == REGISTRY_REFUSED
        heartbeat = node_pb2.HeartbeatRequest(node_id="rogue")
        assert refusal(lambda: registry.Heartbeat(heartbeat, timeout=10, metadata=call_metadata(KEYS[1]))) \
            == REGISTRY_REFUSED
        assert refusal(lambda: registry.Register(register, timeout=10, metadata=call_metadata("sk-unknown"))) \
            == UNAUTHENTICATED
        health = pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=10,
                                                                  metadata=call_metadata(KEYS[0]))
    assert (health.prefill_nodes, health.decode_nodes) == (1, 1)  # the rogue never joined


def test_a_client_key_cannot_call_a_node_service(cluster):
    running, _ = cluster
    (prefill,), (decode,) = running.addresses("prefill"), running.addresses("decode")
    for address, stub_type in ((prefill, node_pb2_grpc.PrefillNodeStub), (decode, node_pb2_grpc.DecodeNodeStub)):
        with grpc.insecure_channel(address) as channel:
            stub = stub_type(channel)
            assert refusal(lambda: stub.GetStats(node_pb2.StatsRequest(), timeout=10,
                                                 metadata=call_metadata(KEYS[0]))) == UNAUTHENTICATED
    with grpc.insecure_channel(decode) as channel:
        layout = node_pb2_grpc.DecodeNodeStub(channel).GetKVLayout(node_pb2.KVLayoutRequest(), timeout=10,
                                                                    metadata=call_metadata(NODE_TOKEN))
    assert layout.layout_id  # the node credential opens it


def test_a_client_key_cannot_open_a_kv_connection(cluster):
    running, _ = cluster
    (decode,) = running.addresses("decode")
    with grpc.insecure_channel(decode) as channel:
        layout = node_pb2_grpc.DecodeNodeStub(channel).GetKVLayout(node_pb2.KVLayoutRequest(), timeout=10,
                                                                    metadata=call_metadata(NODE_TOKEN))
    rank0 = NodeKVDescriptor.from_bytes(layout.layout).ranks[0]
    pair = ProcessPair()
    try:
        _, out, _ = pair.start(token_sender_main, spec_kwargs("float32"), {"auth_token": KEYS[0]}, rank0.to_bytes())
        assert expect(out, "refused") == (f"KVTransferError: peer {rank0.name} refused the "
                                          "connection: authentication failed: missing or wrong auth token")
    finally:
        pair.stop()


def test_keys_reload_without_a_restart(cluster, model_dir):
    running, keys_file = cluster
    pids = dict(running.pids)
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    replacement = keys_file.with_name("api-keys.new")
    replacement.write_text(f"{KEYS[1]}\nsk-client-three-89ab\n")
    os.replace(replacement, keys_file)  # atomically: no reader sees half a file
    assert refusal(lambda: generate(running.router, KEYS[0])) == UNAUTHENTICATED  # revoked
    assert_matches([generate(running.router, "sk-client-three-89ab")], [reference])  # added
    assert_matches([generate(running.router, KEYS[1])], [reference])  # kept
    assert running.refresh().children["router"].pid == pids["router"]  # the same router process
    assert_every_block_free(running)


def test_the_launcher_makes_the_node_credential_when_only_keys_are_given(model_dir, tmp_path):
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(f"{KEYS[0]}\n")
    with running_cluster(model_dir, 1, 1, NodeSettings(block_size=8, num_blocks=64),
                         launcher_args=("--api-keys-file", str(keys_file))) as running:
        assert_matches([generate(running.router, KEYS[0])], greedy_references(model_dir, [PROMPT], [NEW_TOKENS]))
        with grpc.insecure_channel(running.router) as channel:
            register = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="rogue")
            assert refusal(lambda: node_pb2_grpc.RegistryStub(channel).Register(
                register, timeout=10, metadata=call_metadata(KEYS[0]))) == REGISTRY_REFUSED
        (decode,) = running.addresses("decode")
        with grpc.insecure_channel(decode) as channel:  # the nodes require the credential the launcher made
            assert refusal(lambda: node_pb2_grpc.DecodeNodeStub(channel).GetStats(
                node_pb2.StatsRequest(), timeout=10)) == UNAUTHENTICATED
        assert "node join credential: made for this cluster" in running.log("launcher")
