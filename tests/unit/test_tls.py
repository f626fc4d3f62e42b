"""TLS (pdserve/common/tls.py) and the certificates `pdserve cluster --tls` makes (pdserve/cluster_tls.py):
through a real gRPC server on 127.0.0.1, who gets in and who is refused."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat

import grpc
import pytest

from pdserve.cluster_tls import make_cluster_tls
from pdserve.common.auth import TOKEN_ENV, open_channel
from pdserve.common.tls import TlsConfig, TlsError, add_port, tls_from_args
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc


class _Servicer(pdserve_pb2_grpc.GenerationServicer):
    async def Health(self, request, context):
        return pdserve_pb2.HealthResponse(decode_nodes=7)


async def _health(server_tls: TlsConfig, client_tls: TlsConfig | None, target_host: str = "127.0.0.1"):
    """The Health answer through a mutual-TLS server, or the status code the client got."""
    server = grpc.aio.server()
    pdserve_pb2_grpc.add_GenerationServicer_to_server(_Servicer(), server)
    port = add_port(server, "127.0.0.1:0", server_tls)
    await server.start()
    try:
        async with open_channel(f"{target_host}:{port}", tls=client_tls) as channel:
            try:
                return (await pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(),
                                                                              timeout=10)).decode_nodes
            except grpc.aio.AioRpcError as exc:
                return exc.code()
    finally:
        await server.stop(0)


@pytest.fixture(scope="module")
def cluster_tls(tmp_path_factory):
    return make_cluster_tls(tmp_path_factory.mktemp("tls"), ["10.1.2.3", "node.example"])


@pytest.fixture(scope="module")
def other_tls(tmp_path_factory):
    return make_cluster_tls(tmp_path_factory.mktemp("other"))


def test_the_files_and_their_modes(cluster_tls):
    assert stat.S_IMODE(_mode(cluster_tls.key_file)) == 0o600
    assert stat.S_IMODE(_mode(cluster_tls.cert_file)) == 0o644
    assert b"PRIVATE KEY" not in cluster_tls.ca_pem and b"PRIVATE KEY" not in cluster_tls.cert_pem


def test_the_certificate_names_every_address_it_is_dialled_by(cluster_tls):
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cluster_tls.cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "node.example"]


def test_a_peer_with_a_certificate_the_ca_signed_gets_in(cluster_tls):
    assert asyncio.run(_health(cluster_tls, cluster_tls)) == 7
    assert asyncio.run(_health(cluster_tls, cluster_tls, target_host="localhost")) == 7


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "another CA's certificate",
                                    "trusting another CA"])
def test_who_is_refused(cluster_tls, other_tls, client):
    client_tls = {
        "plaintext": None,
        "no client certificate": TlsConfig(cluster_tls.ca_file),
        # It trusts the server, but the server does not trust it: it cannot register or call.
        "another CA's certificate": TlsConfig(cluster_tls.ca_file, other_tls.cert_file, other_tls.key_file),
        "trusting another CA": TlsConfig(other_tls.ca_file, other_tls.cert_file, other_tls.key_file),
    }[client]
    assert asyncio.run(_health(cluster_tls, client_tls)) == grpc.StatusCode.UNAVAILABLE


def test_the_https_contexts_agree(cluster_tls):
    server, client = cluster_tls.server_ssl_context(), cluster_tls.client_ssl_context()
    assert server.verify_mode == ssl.CERT_NONE  # the HTTP front asks no certificate: API keys authenticate
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname


def test_the_flags(cluster_tls, tmp_path):
    class Args:
        tls_ca_file, tls_cert_file, tls_key_file = cluster_tls.ca_file, cluster_tls.cert_file, cluster_tls.key_file

    assert tls_from_args(Args, server=True) == cluster_tls
    assert tls_from_args(Args, server=True).flags() == ("--tls-ca-file", cluster_tls.ca_file, "--tls-cert-file",
                                                         cluster_tls.cert_file, "--tls-key-file", cluster_tls.key_file)
    Args.tls_key_file = None
    with pytest.raises(TlsError, match="missing --tls-key-file"):
        tls_from_args(Args, server=True)
    Args.tls_cert_file = None
    assert tls_from_args(Args, server=False) == TlsConfig(cluster_tls.ca_file)  # a client may trust only
    with pytest.raises(TlsError, match=f"--tls-ca-file {tmp_path}/missing: cannot read it"):
        TlsConfig(str(tmp_path / "missing"))
    (tmp_path / "junk").write_text("not a certificate")
    with pytest.raises(TlsError, match="--tls-cert-file .*junk: not a PEM file"):
        TlsConfig(cluster_tls.ca_file, str(tmp_path / "junk"), cluster_tls.key_file)


def test_the_router_and_node_flags_load_it(cluster_tls):
    from pdserve.node.config import parse_node_args
    from pdserve.router.fronts.server import _parser, config_from_args

    flags, env = list(cluster_tls.flags()), {TOKEN_ENV: "join-credential"}
    assert config_from_args(_parser().parse_args(["--model", "m", *flags])).tls == cluster_tls
    assert parse_node_args(["--model", "m", *flags], "decode", env).tls == cluster_tls
    assert parse_node_args(["--model", "m"], "decode").tls is None
    with pytest.raises(SystemExit):  # a usage error naming the missing flags
        parse_node_args(["--model", "m", "--tls-ca-file", cluster_tls.ca_file], "prefill", env)


def test_a_node_with_a_kv_plane_takes_tls_only_with_the_join_credential(cluster_tls):
    from pdserve.engine.config import EngineConfig
    from pdserve.node.config import NodeConfig

    for kind in ("prefill", "decode"):
        with pytest.raises(ValueError, match="KV data plane .* authenticated by the node join credential"):
            NodeConfig(EngineConfig(model="m"), kind=kind, tls=cluster_tls)
        assert NodeConfig(EngineConfig(model="m"), kind=kind, tls=cluster_tls, auth_token="t").transfer.auth_token == "t"
    assert NodeConfig(EngineConfig(model="m"), kind="colocated", tls=cluster_tls).tls == cluster_tls  # no KV plane


def test_the_cluster_launcher_hands_its_tls_to_every_child(cluster_tls):
    from pdserve.cluster import ClusterConfig, build_plan

    plan = build_plan(ClusterConfig(num_prefill=2, tls=cluster_tls), "/m", 50051, python="py")
    for child in (plan.router, *plan.nodes):
        argv = list(child.argv)
        assert argv[argv.index("--tls-ca-file") + 1] == cluster_tls.ca_file, child.name
        assert argv[argv.index("--tls-cert-file") + 1] == cluster_tls.cert_file, child.name
    assert plan.http_url("127.0.0.1").startswith("https://")
    with pytest.raises(ValueError, match="--tls makes the cluster's own CA"):
        ClusterConfig(tls=cluster_tls, make_tls=True)
    with pytest.raises(ValueError, match="--decode-args must not set --tls-ca-file"):
        ClusterConfig(decode_args=("--tls-ca-file", "/x"))


def test_cluster_tls_makes_a_join_credential_for_the_kv_plane_when_there_is_none(tmp_path):
    from contextlib import ExitStack

    from pdserve.cluster_config import ClusterConfig
    from pdserve.cluster_tls import with_cluster_tls
    from pdserve.common.auth import read_token_file

    with ExitStack() as cleanup:
        made = with_cluster_tls(ClusterConfig(make_tls=True, tls_dir=str(tmp_path / "a")), cleanup, None)
        assert made.tls.ca_file == str(tmp_path / "a" / "ca.pem") and not made.make_tls
        assert made.auth_token_file == str(tmp_path / "a" / "token")
        assert stat.S_IMODE(_mode(made.auth_token_file)) == 0o600 and len(read_token_file(made.auth_token_file)) >= 32
        given = with_cluster_tls(ClusterConfig(make_tls=True, tls_dir=str(tmp_path / "b")), cleanup, "t")
        assert given.auth_token_file is None and not (tmp_path / "b" / "token").exists()
        with pytest.raises(ValueError, match="--tls-cert-file needs the node join credential"):
            with_cluster_tls(ClusterConfig(tls=made.tls), cleanup, None)
        temporary = with_cluster_tls(ClusterConfig(make_tls=True), cleanup, "t")
    assert not os.path.exists(temporary.tls.ca_file)  # a directory of its own, removed with the launcher


def test_the_ready_banner_names_what_a_client_passes(cluster_tls):
    from pdserve.cluster_config import ClusterConfig
    from pdserve.cluster_tls import client_flags

    assert client_flags(ClusterConfig()) == ()
    assert client_flags(ClusterConfig(tls=cluster_tls)) == cluster_tls.flags()  # the token in the environment
    assert client_flags(ClusterConfig(tls=cluster_tls, auth_token_file="/t")) == (*cluster_tls.flags(),
                                                                                  "--auth-token-file", "/t")


def _mode(path: str) -> int:
    return os.stat(path).st_mode
