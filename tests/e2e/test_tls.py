"""`pdserve cluster --tls`: a private CA, mutual TLS between the router and the nodes and between
the nodes, TLS on the public API (gRPC and HTTP).

Router + 1 prefill + 1 decode node on 127.0.0.1 started with `--tls` alone, as a user starts them:
the launcher makes the CA, the certificate and the node join credential (which authenticates the
KV data plane: no KV transport runs TLS here), and the clients use the files it names.
Generation over TLS gRPC and over HTTPS gives transformers' exact tokens; plaintext to any TLS
port is refused, so is a client that trusts another CA, and so is a node whose certificate
another CA signed (it cannot register); every node ends with zero blocks in use.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from transformers import AutoTokenizer

from pdserve.cluster_supervisor import ChildSpec, ClusterSupervisor
from pdserve.cluster_tls import make_cluster_tls
from pdserve.common.tls import TlsConfig, sync_channel
from pdserve.healthcheck import HealthcheckConfig, check
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.fronts.client import generate
from pdserve.testing.waiting import wait_until
from tests.e2e.cluster import HOST, START_TIMEOUT_S, NodeSettings, free_port, running_cluster

from ..integration.reference import assert_matches, greedy_references

PROMPT = [9, 4, 77, 301, 12, 12, 640, 5, 58, 2, 870]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1, 1, NodeSettings(num_blocks=64), launcher_args=("--tls",)) as running:
        yield running


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> TlsConfig:
    """Another cluster's CA and certificate: valid, but not this cluster's."""
    return make_cluster_tls(tmp_path_factory.mktemp("other-ca"))


def greedy() -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=PROMPT),
        sampling_params=pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))


def https_completion(base_url: str, context: ssl.SSLContext, token: str) -> dict:
    body = json.dumps({"model": "llama", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(base_url + "/completions", body, {"Content-Type": "application/json",
                                                                       "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60, context=context) as response:
        return json.loads(response.read())


def test_generation_over_tls_grpc_and_https_is_exact(cluster, model_dir):
    tls = cluster.state.tls()
    assert cluster.state.http.startswith("https://")
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    completion = asyncio.run(generate(cluster.router, greedy(), None, 60, cluster.token, tls))
    assert_matches([completion.token_ids], [reference])
    answer = https_completion(cluster.state.http, tls.client_ssl_context(), cluster.token)
    assert answer["choices"][0]["text"] == AutoTokenizer.from_pretrained(model_dir).decode(reference.token_ids)
    assert check(cluster.router, "router", HealthcheckConfig(timeout_s=10, auth_token=cluster.token, tls=tls)).healthy
    stats = cluster.wait_all_blocks_free(timeout_s=10)
    assert [(s.kind, s.used_blocks) for s in stats] == [("prefill", 0), ("decode", 0)]
    assert stats[0].kv_transfer.bytes == stats[1].kv_transfer.bytes > 0  # the KV moved prefill -> decode


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_the_serving_bench_runs_over_tls(cluster, tmp_path, backend):
    from pdserve.bench.serve import cli as serve_cli

    tls, out = cluster.state.tls(), tmp_path / "serve.json"
    where = ["--addr", cluster.router] if backend == "grpc" else ["--base-url", cluster.state.http]
    argv = ["--backend", backend, *where, *tls.flags(), "--auth-token-file", cluster.state.auth_token_file, "--rate", "8", "--num-requests", "3", "--workload",
            "uniform", "--input-len-range", "8:16", "--output-len-range", "4:6", "--output-json", str(out),
            "--ttft-slo", "60", "--tpot-slo", "30", "--timeout-s", "120", "--no-progress"]
    assert serve_cli.main(argv) == 0
    assert [r["status"] for r in json.loads(out.read_text())["runs"][0]["requests"]] == ["OK"] * 3
    stats = cluster.wait_all_blocks_free(timeout_s=10)
    assert [(s.kind, s.used_blocks) for s in stats] == [("prefill", 0), ("decode", 0)]


def test_plaintext_to_a_tls_port_is_refused(cluster):
    for address in (cluster.router, *cluster.prefill, *cluster.decode):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
            pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE, address
    plain = cluster.state.http.replace("https://", "http://", 1)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain.removesuffix("/v1") + "/health", timeout=10)


def test_a_client_that_trusts_another_ca_is_refused(cluster, other_ca):
    with sync_channel(cluster.router, other_ca) as channel, pytest.raises(grpc.RpcError) as err:
        pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(urllib.error.URLError) as refused:
        https_completion(cluster.state.http, other_ca.client_ssl_context(), cluster.token)
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)


def test_a_node_whose_certificate_another_ca_signed_cannot_register_or_call_a_node(cluster, other_ca):
    tls = cluster.state.tls()
    # It trusts this cluster's CA (it would accept the router), but the router does not trust it.
    rogue = TlsConfig(tls.ca_file, other_ca.cert_file, other_ca.key_file)
    register = node_pb2.RegisterRequest(kind="decode", address="127.0.0.1:1", node_id="rogue")
    with sync_channel(cluster.router, rogue) as channel, pytest.raises(grpc.RpcError) as err:
        node_pb2_grpc.RegistryStub(channel).Register(register, timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    with sync_channel(cluster.decode[0], rogue) as channel, pytest.raises(grpc.RpcError) as err:
        node_pb2_grpc.DecodeNodeStub(channel).GetKVLayout(node_pb2.KVLayoutRequest(), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    # A certificate of its own CA only, no client certificate at all: refused the same way.
    with sync_channel(cluster.prefill[0], TlsConfig(tls.ca_file)) as channel, pytest.raises(grpc.RpcError) as err:
        node_pb2_grpc.PrefillNodeStub(channel).GetStats(node_pb2.StatsRequest(), timeout=10)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    health = cluster.health()
    assert (health.prefill_nodes, health.decode_nodes) == (1, 1)
    stats = cluster.wait_all_blocks_free(timeout_s=10)
    assert [(s.kind, s.used_blocks, s.reserved_blocks) for s in stats] == [("prefill", 0, 0), ("decode", 0, 0)]


def test_a_real_node_with_another_cas_certificate_never_joins(cluster, other_ca, model_dir, tmp_path):
    """`pdserve decode` as a user would start it, pointed at the cluster with the right CA and the
    join credential, but a certificate of another CA: every Register fails the handshake."""
    tls = cluster.state.tls()
    argv = (sys.executable, "-m", "pdserve", "decode", "--model", model_dir, "--host", HOST, "--port",
            str(free_port()), "--router", cluster.router, "--node-id", "rogue", "--kv-host", HOST, "--dtype", "float32",
            "--block-size", "8", "--num-blocks", "64", "--max-num-batched-tokens", "64", "--threads", "1",
            "--tls-ca-file", tls.ca_file, "--tls-cert-file", other_ca.cert_file, "--tls-key-file", other_ca.key_file,
            "--auth-token-file", cluster.state.auth_token_file)
    log = tmp_path / "rogue.log"  # the supervisor opens it with the child's first line
    with ClusterSupervisor(log_dir=tmp_path) as supervisor:
        supervisor.start(ChildSpec("rogue", argv))
        try:
            wait_until(lambda: log.exists() and "unreachable; retrying quietly (UNAVAILABLE" in log.read_text(),
                       "the rogue node's Register fails", START_TIMEOUT_S, interval_s=0.25)
            health = cluster.health()
            assert (health.prefill_nodes, health.decode_nodes) == (1, 1)
        finally:
            supervisor.stop_all(grace_s=10)


def test_pdserve_generate_without_a_client_certificate_is_told_what_it_lacks(cluster, capsys):
    from pdserve.router.fronts import client

    tls = cluster.state.tls()
    base = ["--addr", cluster.router, "--auth-token-file", cluster.state.auth_token_file, "--max-tokens", "2",
            "--token-ids", "9,4,77"]
    assert client.main([*base, "--tls-ca-file", tls.ca_file]) == 1
    assert "requires a client certificate the CA signed: --tls-cert-file and --tls-key-file" in capsys.readouterr().err
    assert client.main([*base, *tls.flags(), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]) == 2


def test_the_torch_kv_transport_runs_inside_the_same_trust(model_dir):
    """`--kv-transport torch` under `pdserve cluster --tls`: its HELLO carries the join credential
    the launcher made, and the KV crosses; exact tokens, no block left."""
    torch_kv = ("--kv-transport", "torch")
    (reference,) = greedy_references(model_dir, [PROMPT], [NEW_TOKENS])
    with running_cluster(model_dir, 1, 1, NodeSettings(num_blocks=64), prefill_args=torch_kv, decode_args=torch_kv,
                         launcher_args=("--tls",)) as cluster:
        completion = asyncio.run(generate(cluster.router, greedy(), None, 60, cluster.token, cluster.state.tls()))
        assert_matches([completion.token_ids], [reference])
        stats = cluster.wait_all_blocks_free(timeout_s=10)
        assert [(s.kind, s.used_blocks) for s in stats] == [("prefill", 0), ("decode", 0)]
        assert stats[0].kv_transfer.bytes == stats[1].kv_transfer.bytes > 0
