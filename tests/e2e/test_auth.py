"""The shared-secret token on a real cluster and on a real KV transfer handshake.

A router, a prefill and a decode node run as processes on 127.0.0.1 with one token (the
router and the prefill node read it from `--auth-token-file`, the decode node from
`$PDSERVE_AUTH_TOKEN`). Without the token, or with a wrong one, the public API, both
node services and the router's Registry answer UNAUTHENTICATED; with it the cluster
serves transformers' exact tokens, and every node ends with zero blocks in use. At the
transport level, a KV peer with a wrong token is refused before its fingerprint is
even looked at, and one with the right token moves bytes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import grpc
import pytest

from pdserve.common.auth import TOKEN_ENV, call_metadata
from tests.e2e.cluster import HOST, free_port
from pdserve.cluster_supervisor import ChildSpec, ClusterSupervisor
from pdserve.healthcheck import HealthcheckConfig, check
from pdserve.kv_transfer import KVDescriptor
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.fronts.client import generate
from pdserve.testing.waiting import settled, wait_until

from ..integration.reference import assert_matches, greedy_references
from .test_kv_transfer_ucx import SRC_BLOCKS, Cluster, expect, make_caches, receiver_main, spec_kwargs

TOKEN = "e2e-Secret.token-0123456789"
BLOCK_SIZE = 8
START_TIMEOUT_S = 240.0
PROMPT = [3, 17, 99, 250, 7, 7, 512, 40, 41, 42, 900, 1]
NEW_TOKENS = 8


def _refused(exc_info: pytest.ExceptionInfo) -> tuple[grpc.StatusCode, str]:
    return exc_info.value.code(), exc_info.value.details()


UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED,
                   "missing or wrong auth token: send metadata 'authorization: Bearer <token>'")


# -- a cluster with a token ------------------------------------------------------------
def _node_argv(kind: str, model_dir: str, port: int, router: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "pdserve", kind, "--model", model_dir, "--host", HOST, "--port", str(port),
            "--router", router, "--node-id", f"{kind}-0", "--kv-host", HOST, "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--num-blocks", "64", "--max-num-batched-tokens", "64",
            "--threads", "1")


def _wait_serving(router: str, supervisor: ClusterSupervisor) -> None:
    config = HealthcheckConfig(timeout_s=2.0, auth_token=TOKEN)
    def serving() -> bool:
        if check(router, "router", config).healthy:
            return True
        supervisor.raise_if_exited()
        return False

    wait_until(serving, f"the cluster at {router} serves", START_TIMEOUT_S, interval_s=0.25)


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    router, prefill, decode = (f"{HOST}:{free_port()}" for _ in range(3))
    with ClusterSupervisor() as supervisor:
        supervisor.start(ChildSpec("router", (
            sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--host", HOST,
            "--port", router.rsplit(":", 1)[1], "--block-size", str(BLOCK_SIZE), "--heartbeat-timeout-s", "30",
            "--auth-token-file", str(token_file))))
        supervisor.start(ChildSpec("prefill-0", _node_argv("prefill", model_dir, int(prefill.rsplit(":", 1)[1]),
                                                           router) + ("--auth-token-file", str(token_file))))
        supervisor.start(ChildSpec("decode-0", _node_argv("decode", model_dir, int(decode.rsplit(":", 1)[1]), router),
                                   env={TOKEN_ENV: TOKEN}))
        try:
            _wait_serving(router, supervisor)
            yield router, prefill, decode
        finally:
            supervisor.stop_all(grace_s=10)


def _greedy_request() -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=PROMPT),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))


def _generate_sync(router: str, metadata: tuple = ()) -> list[int]:
    with grpc.insecure_channel(router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        return [t for r in stub.Generate(_greedy_request(), timeout=60, metadata=metadata) for t in r.token_ids]


def _stats(stub_type, address: str, metadata: tuple) -> node_pb2.NodeStats:
    with grpc.insecure_channel(address) as channel:
        return stub_type(channel).GetStats(node_pb2.StatsRequest(), timeout=10, metadata=metadata)


# -- tests -----------------------------------------------------------------------------
def test_the_public_api_needs_the_token(cluster, model_dir):
    router, _, _ = cluster
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    for metadata in ((), call_metadata("wrong-token"), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as err:
            _generate_sync(router, metadata)
        assert _refused(err) == UNAUTHENTICATED
    with grpc.insecure_channel(router) as channel, pytest.raises(grpc.RpcError) as err:
        pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=10)
    assert _refused(err) == UNAUTHENTICATED
    assert not check(router, "router", HealthcheckConfig(timeout_s=5.0)).healthy

    assert_matches([_generate_sync(router, call_metadata(TOKEN))], [reference])
    # The client and the health probe attach the token to every call of their channel.
    completion = asyncio.run(generate(router, _greedy_request(), None, 60.0, token=TOKEN))
    assert_matches([completion.token_ids], [reference])
    verdict = check(router, "router", HealthcheckConfig(timeout_s=5.0, auth_token=TOKEN))
    assert verdict.healthy, verdict.reason


def test_node_services_need_the_token(cluster):
    _, prefill, decode = cluster
    for stub_type, address in ((node_pb2_grpc.PrefillNodeStub, prefill), (node_pb2_grpc.DecodeNodeStub, decode)):
        for metadata in ((), call_metadata("wrong-token")):
            with pytest.raises(grpc.RpcError) as err:
                _stats(stub_type, address, metadata)
            assert _refused(err) == UNAUTHENTICATED
    # A stream that would reserve blocks on the decode node never starts.
    request = node_pb2.SampleRequest(request_id="intruder", prompt_token_ids=PROMPT, seed=1,
                                     sampling_params=pdserve_pb2.SamplingParams(max_tokens=4))
    with grpc.insecure_channel(decode) as channel, pytest.raises(grpc.RpcError) as err:
        list(node_pb2_grpc.DecodeNodeStub(channel).Decode(request, timeout=10))
    assert _refused(err) == UNAUTHENTICATED
    assert _stats(node_pb2_grpc.DecodeNodeStub, decode, call_metadata(TOKEN)).used_blocks == 0


def test_the_registry_needs_the_token(cluster):
    router, _, _ = cluster
    with grpc.insecure_channel(router) as channel:
        stub = node_pb2_grpc.RegistryStub(channel)
        register = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="rogue")
        for metadata in ((), call_metadata("wrong-token")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Register(register, timeout=10, metadata=metadata)
            assert _refused(err) == UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.Heartbeat(node_pb2.HeartbeatRequest(node_id="decode-0"), timeout=10, metadata=metadata)
            assert _refused(err) == UNAUTHENTICATED
        health = pdserve_pb2_grpc.GenerationStub(channel).Health(
            pdserve_pb2.HealthRequest(), timeout=10, metadata=call_metadata(TOKEN))
    assert (health.prefill_nodes, health.decode_nodes) == (1, 1)  # the rogue node never joined


def test_every_node_ends_with_no_blocks_in_use(cluster):
    _, prefill, decode = cluster
    stats = settled(lambda: [_stats(node_pb2_grpc.PrefillNodeStub, prefill, call_metadata(TOKEN)),
                             _stats(node_pb2_grpc.DecodeNodeStub, decode, call_metadata(TOKEN))],
                    lambda stats: all(s.used_blocks == 0 and s.reserved_blocks == 0 for s in stats), 10)
    assert [(s.kind, s.used_blocks, s.reserved_blocks) for s in stats] == [("prefill", 0, 0), ("decode", 0, 0)]


# -- the KV transfer handshake ---------------------------------------------------------
def token_sender_main(spec_kw: dict, cfg_kw: dict, desc: bytes, out, cmd) -> None:
    from pdserve.kv_transfer import KVCacheSpec, KVDescriptor, KVTransferConfig, KVTransferError, UcxTransport

    k, v = make_caches(spec_kw, SRC_BLOCKS, seed=1)
    transport = UcxTransport(KVTransferConfig(**cfg_kw))
    transport.register(k, v, KVCacheSpec(**spec_kw))
    try:
        transport.connect(KVDescriptor.from_bytes(desc))
    except KVTransferError as exc:
        out.put(("refused", f"{type(exc).__name__}: {exc}"))
        transport.close()
        return
    handle = transport.push("req-auth", [0, 1], [5, 6])
    out.put(("pushed", handle.wait(20.0).name))
    transport.close()


ucx_only = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")


@ucx_only
@pytest.mark.parametrize("sender_token", [None, "wrong-token"])
def test_a_kv_peer_without_the_token_is_refused(sender_token):
    kv = Cluster()
    try:
        # A different block size too: the token is checked first, the fingerprint never.
        _, r_out, r_cmd = kv.start(receiver_main, spec_kwargs("bfloat16"), {"auth_token": TOKEN})
        desc = expect(r_out, "desc")
        _, s_out, _ = kv.start(token_sender_main, spec_kwargs("bfloat16", block_size=32),
                               {"auth_token": sender_token}, desc)
        remote = KVDescriptor.from_bytes(desc)
        assert expect(s_out, "refused") == (f"KVTransferError: peer {remote.name} refused the "
                                            "connection: authentication failed: missing or wrong auth token")
        r_cmd.put(("report", 0.0))
        report = expect(r_out, "report")
        r_cmd.put(("exit", 0))
        assert report["refusals"] == []  # no fingerprint was compared
        assert report["stats"]["bytes"] == 0 and report["stats"]["transfers"] == 0
    finally:
        kv.stop()


@ucx_only
def test_a_kv_peer_with_the_token_moves_bytes():
    kv = Cluster()
    try:
        _, r_out, r_cmd = kv.start(receiver_main, spec_kwargs("bfloat16"), {"auth_token": TOKEN})
        desc = expect(r_out, "desc")
        _, s_out, _ = kv.start(token_sender_main, spec_kwargs("bfloat16"), {"auth_token": TOKEN}, desc)
        assert expect(s_out, "pushed") == "SUCCESS"
        r_cmd.put(("report", 0.0))
        report = expect(r_out, "report")
        r_cmd.put(("exit", 0))
        assert (report["stats"]["blocks"], report["stats"]["transfers"], report["stats"]["failures"]) == (2, 1, 0)
    finally:
        kv.stop()


def test_standard_health_answers_without_the_token_and_reflection_needs_it(cluster):
    """A probe (Kubernetes, grpc_health_probe) sends no token and learns only SERVING or not;
    listing the services through reflection is behind the token like everything else."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for address in cluster:
        with grpc.insecure_channel(address) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                ProtoReflectionDescriptorDatabase(channel).get_services()
            assert _refused(err) == UNAUTHENTICATED
