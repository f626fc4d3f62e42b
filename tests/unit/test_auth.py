"""The shared-secret token: loading it at the CLI edge, the server interceptor, the client side.

The interceptor runs in a real grpc.aio server on 127.0.0.1 with a small Generation
servicer (one unary and one server-streaming method), so the exact status codes a caller
sees are the ones gRPC delivers.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.common.auth import (TOKEN_ENV, Credentials, TokenError, bearer_of, add_auth_args, call_metadata, check_token,
                          insecure_channel, server_interceptors, token_from_cli)
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

TOKEN = "s3cret-Token_42"


# -- loading ---------------------------------------------------------------------------
def test_the_file_wins_over_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert token_from_cli(str(path), {TOKEN_ENV: "from-env"}) == TOKEN
    assert token_from_cli(None, {TOKEN_ENV: "from-env\n"}) == "from-env"


def test_no_file_and_no_variable_is_no_auth():
    assert token_from_cli(None, {}) is None
    assert token_from_cli(None, {TOKEN_ENV: ""}) is None  # compose passes an unset variable as ""


@pytest.mark.parametrize(
    "content, message",
    [
        ("\n", "the auth token is empty"),
        ("two words", "the auth token may hold only visible ASCII (no spaces), found [' ']"),
        ("tökén", "the auth token may hold only visible ASCII (no spaces), found ['é', 'ö']"),
    ],
)
def test_unusable_token_files_are_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "token"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(TokenError) as err:
        token_from_cli(str(path), {})
    assert str(err.value) == f"--auth-token-file {path}: {message}"


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(TokenError, match=r"^--auth-token-file .*missing: cannot read it"):
        token_from_cli(str(tmp_path / "missing"), {TOKEN_ENV: TOKEN})


def test_a_bad_variable_names_the_variable():
    with pytest.raises(TokenError, match=rf"^\${TOKEN_ENV}: the auth token may hold only visible ASCII"):
        token_from_cli(None, {TOKEN_ENV: "a\tb"})


def test_the_flag_and_the_metadata():
    import argparse

    parser = argparse.ArgumentParser()
    add_auth_args(parser)
    assert parser.parse_args(["--auth-token-file", "/t"]).auth_token_file == "/t"
    assert parser.parse_args([]).auth_token_file is None
    assert call_metadata(TOKEN) == (("authorization", f"Bearer {TOKEN}"),)
    assert call_metadata(None) == ()
    assert server_interceptors(None) == []
    assert check_token(TOKEN, "x") == TOKEN


@pytest.mark.parametrize(
    "metadata, allowed",
    [
        ((("authorization", f"Bearer {TOKEN}"),), True),
        ((("x-other", "1"), ("authorization", f"Bearer {TOKEN}")), True),
        ((("authorization", f"Bearer {TOKEN}x"),), False),
        ((("authorization", TOKEN),), False),  # no scheme
        ((("authorization", f"bearer {TOKEN}"),), False),
        ((("authorization", b"Bearer \xff"),), False),
        ((), False),
        (None, False),
    ],
)
def test_the_interceptor_compares_the_whole_header(metadata, allowed):
    assert (Credentials(TOKEN).refusal("pdserve.v1.Generation", bearer_of(metadata)) is None) is allowed


# -- a real server ---------------------------------------------------------------------
class _Servicer(pdserve_pb2_grpc.GenerationServicer):
    async def Health(self, request, context):
        return pdserve_pb2.HealthResponse(serving=True, decode_nodes=7)

    async def Generate(self, request, context):
        for index in range(2):
            yield pdserve_pb2.GenerateResponse(request_id=request.request_id, index=index)


async def _call_both(server_token: str | None, client_token: str | None,
                     metadata: tuple = ()) -> tuple[object, object]:
    """(Health result or status code, Generate indices or status code)."""
    server = grpc.aio.server(interceptors=server_interceptors(server_token))
    pdserve_pb2_grpc.add_GenerationServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with insecure_channel(f"127.0.0.1:{port}", client_token) as channel:
            stub = pdserve_pb2_grpc.GenerationStub(channel)
            try:
                health = (await stub.Health(pdserve_pb2.HealthRequest(), timeout=10, metadata=metadata)).decode_nodes
            except grpc.aio.AioRpcError as exc:
                health = (exc.code(), exc.details())
            try:
                call = stub.Generate(pdserve_pb2.GenerateRequest(request_id="r"), timeout=10, metadata=metadata)
                stream = [r.index async for r in call]
            except grpc.aio.AioRpcError as exc:
                stream = (exc.code(), exc.details())
            return health, stream
    finally:
        await server.stop(0)


REFUSED = (grpc.StatusCode.UNAUTHENTICATED,
           "missing or wrong auth token: send metadata 'authorization: Bearer <token>'")


@pytest.mark.parametrize(
    "server_token, client_token, metadata, expected",
    [
        (TOKEN, TOKEN, (), (7, [0, 1])),
        (TOKEN, None, (), (REFUSED, REFUSED)),
        (TOKEN, "wrong", (), (REFUSED, REFUSED)),
        (TOKEN, None, call_metadata(TOKEN), (7, [0, 1])),  # per-call metadata, as the load generator sends it
        (None, None, (), (7, [0, 1])),  # no token configured: everyone is allowed
        (None, TOKEN, (), (7, [0, 1])),
    ],
)
def test_unary_and_streaming_calls_through_a_real_server(server_token, client_token, metadata, expected):
    assert asyncio.run(_call_both(server_token, client_token, metadata)) == expected


# -- the CLI edges -----------------------------------------------------------------------
def test_router_and_node_flags_load_the_token(tmp_path):
    from pdserve.node.config import parse_node_args
    from pdserve.router.fronts.server import _parser, config_from_args

    path = tmp_path / "token"
    path.write_text(TOKEN)
    router_args = _parser().parse_args(["--model", "m", "--auth-token-file", str(path)])
    assert config_from_args(router_args).auth_token == TOKEN
    assert config_from_args(_parser().parse_args(["--model", "m"]), {TOKEN_ENV: "env-token"}).auth_token == "env-token"
    assert config_from_args(_parser().parse_args(["--model", "m"])).auth_token is None
    node = parse_node_args(["--model", "m", "--auth-token-file", str(path)], "decode")
    assert node.auth_token == TOKEN and node.transfer.auth_token == TOKEN
    assert parse_node_args(["--model", "m"], "prefill", {TOKEN_ENV: "env-token"}).auth_token == "env-token"
    assert parse_node_args(["--model", "m"], "prefill").auth_token is None


def test_the_cluster_launcher_hands_the_token_file_to_every_child():
    from pdserve.cluster import ClusterConfig, build_plan

    plan = build_plan(ClusterConfig(num_prefill=2, auth_token_file="/run/secrets/t"), "/m", 50051, python="py")
    for child in (plan.router, *plan.nodes):
        argv = list(child.argv)
        assert argv[argv.index("--auth-token-file") + 1] == "/run/secrets/t", child.name
    plain = build_plan(ClusterConfig(), "/m", 50051, python="py")
    assert all("--auth-token-file" not in child.argv for child in (plain.router, *plain.nodes))
    with pytest.raises(ValueError, match="--router-args must not set --auth-token-file"):
        ClusterConfig(router_args=("--auth-token-file", "/x"))
