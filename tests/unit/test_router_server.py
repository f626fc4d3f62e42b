"""The router server's other services and the `pdserve generate` client, against fake nodes.

Health (serving once a prefill and a decode node are live, not once one goes silent),
model info, tokenize, node registration errors, static nodes from flags, and the
client's streamed text, JSON output and exit codes. Everything in-process on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.fronts import client
from pdserve.router.fronts.server import _parser, config_from_args
from pdserve.testing.fake_nodes import Calls, FakeDecode, FakePrefill, Script, decode_stats, prefill_stats
from pdserve.testing.node_server import FakeNode, fake_nodes, started
from pdserve.testing.router import run, running_router
from pdserve.testing.waiting import until

LENGTH = pdserve_pb2.FINISH_REASON_LENGTH


def script_for(ids: list[int]) -> Script:
    events = [node_pb2.DecodeTokens(token_ids=ids[1:], finish_reason=LENGTH, stop_token_id=-1)]
    return Script(first_token=lambda i: ids[0], decode_events=lambda i: events)


async def health(address: str) -> pdserve_pb2.HealthResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest())


async def wait_for_health(address: str, decode_nodes: int, timeout_s: float = 5.0) -> pdserve_pb2.HealthResponse:
    async def serving() -> pdserve_pb2.HealthResponse | None:
        status = await health(address)
        return status if status.serving and status.decode_nodes == decode_nodes else None

    return await until(serving, timeout_s, interval_s=0.05)


def test_model_info_and_tokenize(router_model):
    async def scenario():
        async with running_router(router_model, block_size=8) as address:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = pdserve_pb2_grpc.GenerationStub(channel)
                info = await stub.GetModelInfo(pdserve_pb2.GetModelInfoRequest())
                tokens = await stub.Tokenize(pdserve_pb2.TokenizeRequest(text="hello world"))
                return info, list(tokens.token_ids)

    info, tokens = run(scenario())
    assert (info.model, info.vocab_size, info.max_model_len) == ("tiny", 960, 4096)
    assert (info.dtype, info.block_size, list(info.eos_token_ids)) == ("float32", 8, [0])
    assert tokens == router_model[1].tokenizer.encode("hello world")


def test_health_follows_registration_and_heartbeats(router_model):
    async def scenario():
        async with running_router(router_model, heartbeat_timeout_s=1.0, maintenance_interval_s=0.05) as address:
            before = await health(address)
            async with fake_nodes(address, Script(), prefill=1, decode=2) as (_, nodes):
                serving = await health(address)
                decode = nodes[1]
                decode.heartbeats = False
                dropped = await wait_for_health(address, decode_nodes=1)  # silent past the timeout
                decode.heartbeats = True  # answered known=false: it registers again
                back = await wait_for_health(address, decode_nodes=2)
                return before, serving, dropped, back

    before, serving, dropped, back = run(scenario())
    assert (before.serving, before.prefill_nodes, before.decode_nodes) == (False, 0, 0)
    assert (serving.serving, serving.prefill_nodes, serving.decode_nodes) == (True, 1, 2)
    assert (dropped.serving, dropped.decode_nodes) == (True, 1)
    assert (back.serving, back.decode_nodes) == (True, 2)


@pytest.mark.parametrize("kind, address, message", [("gpu", "127.0.0.1:1", "kind must be"), ("decode", "", "address")])
def test_register_refuses_bad_nodes(router_model, kind, address, message):
    async def scenario():
        async with running_router(router_model) as router_address:
            async with grpc.aio.insecure_channel(router_address) as channel:
                registry = node_pb2_grpc.RegistryStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await registry.Register(node_pb2.RegisterRequest(kind=kind, address=address, node_id="x"))
                return err.value

    error = run(scenario())
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and message in error.details()


def test_static_nodes_from_flags_serve_without_registering(router_model):
    ids = router_model[1].tokenizer.encode(" the quick brown")
    script, calls = script_for(ids), Calls()

    async def scenario():
        nodes = [FakeNode("prefill", FakePrefill(script, calls, prefill_stats()), "", "p-static"),
                 FakeNode("decode", FakeDecode(script, calls, decode_stats()), "", "d-static")]
        async with started(nodes, register=False) as (prefill, decode):
            flags = {"prefill_addresses": (prefill.address,), "decode_addresses": (decode.address,)}
            async with running_router(router_model, maintenance_interval_s=0.05, **flags) as address:
                await wait_for_health(address, decode_nodes=1)
                return await client.generate(address, pdserve_pb2.GenerateRequest(text="hi"), None)

    completion = run(scenario())
    assert completion.token_ids == ids and completion.as_dict()["finish_reason"] == "length"


def test_client_streams_text_and_prints_json(router_model, capsys):
    ids = router_model[1].tokenizer.encode(" the quick brown")

    async def scenario(argv_tail: list[str]) -> int:
        async with running_router(router_model) as address, fake_nodes(address, script_for(ids)):
            argv = ["--addr", address, "--max-tokens", str(len(ids)), "--temperature", "0", *argv_tail]
            return await asyncio.to_thread(client.main, argv)

    assert run(scenario(["hello"])) == 0
    assert capsys.readouterr().out == router_model[1].tokenizer.decode(ids) + "\n"
    assert run(scenario(["--json", "--token-ids", "5,6,7", "--stop", "zzz", "--seed", "3"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == ids and out["text"] == router_model[1].tokenizer.decode(ids)
    assert out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == len(ids)
    assert out["usage"]["prompt_tokens"] == 3 and out["timings"]["kv_transfer_bytes"] == 4096


def test_client_reports_the_status_and_exits_non_zero(router_model, capsys):
    async def scenario() -> int:
        async with running_router(router_model) as address:
            return await asyncio.to_thread(client.main, ["--addr", address, "hello"])

    assert run(scenario()) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: no prefill and no decode node")


def test_router_flags_become_a_config():
    args = _parser().parse_args(
        ["--model", "m", "--port", "0", "--prefill", "127.0.0.1:7001", "--decode", "127.0.0.1:7002",
         "--decode", "127.0.0.1:7003", "--heartbeat-timeout-s", "1.5"]
    )
    config = config_from_args(args)
    assert (config.host, config.port, config.heartbeat_timeout_s) == ("127.0.0.1", 0, 1.5)
    assert config.prefill_addresses == ("127.0.0.1:7001",)
    assert config.decode_addresses == ("127.0.0.1:7002", "127.0.0.1:7003")
    with pytest.raises(ValueError, match="HOST:PORT"):
        config_from_args(_parser().parse_args(["--model", "m", "--decode", "nohost"]))
