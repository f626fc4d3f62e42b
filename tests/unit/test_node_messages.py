"""Front <-> core messages, the KV done message, node config flags, errors and proto conversions."""

from __future__ import annotations

import argparse

import grpc
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import TransferStats
from pdserve.node.config import NodeConfig, add_node_args, config_from_args, parse_node_args
from pdserve.node.front.convert import stats_to_proto, tokens_to_proto
from pdserve.proto.convert import finish_reason_to_proto, logprobs_to_proto, params_from_proto, params_to_proto
from pdserve.node.errors import ErrorCode, grpc_status
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.node.messages import (Abort, BeamOption, BeamResult, BeamsDone, CoreFailed, CoreStarted, StreamSubmit, FirstToken, Logprobs, MessageError,
                                   PrefillSubmit, PromptLogprobs, Ready, RequestFailed, Shutdown, StatsData, StatsQuery,
                                   StatsReply, Tokens, decode, encode)
from pdserve.proto import pdserve_pb2

PARAMS = SamplingParams(temperature=0.7, top_k=5, seed=-3, max_tokens=9, stop=("x", "yz"),
                        stop_token_ids=(3, 4), logprobs=2)
LOGPROBS = Logprobs(-0.25, [7, 9], [-0.25, -1.5])
PROMPT_LOGPROBS = PromptLogprobs([4, 7], [Logprobs(-3.0, [9], [-0.5]), LOGPROBS])

MESSAGES = [
    PrefillSubmit("r1", [1, 2, 3], PARAMS, 1, "127.0.0.1:5000/abc", [4, 5], kv_layout='{"ranks": []}'),
    StreamSubmit("r2", [9], SamplingParams(), 0),
    StreamSubmit("r2p", [9, 4, 7], SamplingParams(prompt_logprobs=3), 0),
    PrefillSubmit("r1b", [1, 2], PARAMS, 0, "127.0.0.1:5000/abc", [4], [17, 18]),  # a resume
    StreamSubmit("r2b", [9], SamplingParams(), 2, [5, 6, 7]),
    StreamSubmit("r2beam", [9, 8], SamplingParams(temperature=0.0, max_tokens=4), 0, beam=BeamOption(3, 0.5)),
    BeamsDone("r2beam", [BeamResult([1, 2, 3, 4], "length", -4.5, -1.125), BeamResult([5, 2], "stop", -1.0, -2.0)],
              2, 0),
    Abort("r3"),
    StatsQuery(7),
    Shutdown(),
    CoreStarted({"model": "tiny", "dtype": "float32", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16,
                 "block_size": 8, "layout_version": 1}),
    CoreStarted({"model": "tiny"}, "127.0.0.1:5000/abc", '{"ranks": [], "epoch": "abc"}'),
    CoreFailed("boom"),
    CoreFailed("--model /m: no config.json there", refused=True),
    Ready("r4", "127.0.0.1:5000/abc", [0, 1, 2]),
    FirstToken("r5", 11, LOGPROBS, 16, 0.5, 0.01, 12288),
    FirstToken("r6", 12, None, 0, 0.5, 0.0, 0),
    FirstToken("r6p", 12, None, 0, 0.5, 0.0, 0, PROMPT_LOGPROBS),
    Tokens("r7p", [1], [None], None, None, PROMPT_LOGPROBS),
    Tokens("r7", [1, 2], [LOGPROBS, None], "length", None),
    Tokens("r8", [], [], "stop", 3),
    RequestFailed("r9", ErrorCode.RESOURCE_EXHAUSTED, "short of blocks"),
    StatsReply(3, StatsData("decode", 10, 4, 2, 1, 3, 0, TransferStats(100, 2, 1, 0, 0.25), 8, 4)),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    raw = encode(msg)
    assert isinstance(raw, bytes) and raw.startswith(b"{")  # JSON, never pickle
    assert decode(raw) == msg


@pytest.mark.parametrize("raw", [b"", b"[]", b'{"type": "Nope", "body": {}}', b'{"type": "Abort", "body": {}}',
                                 b'{"type": "RequestFailed", "body": {"req_id": "a", "code": "?", "message": ""}}',
                                 # params come whole, as the front built them: the core rebuilds, never re-defaults
                                 b'{"type": "StreamSubmit", "body": {"req_id": "a", "prompt_token_ids": [1], '
                                 b'"params": {"n": 1}, "sample_index": 0}}'])
def test_garbage_is_a_message_error(raw):
    with pytest.raises(MessageError):
        decode(raw)


@pytest.mark.parametrize("done", [KVDone(DoneStatus.OK, 5, LOGPROBS), KVDone(DoneStatus.OK, 0),
                                  KVDone(DoneStatus.ABORTED)])
def test_kv_done_round_trips(done):
    assert KVDone.from_bytes(done.to_bytes()) == done


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"status": "ok"}', b'{"status": "maybe"}'])
def test_malformed_kv_done_is_a_value_error(raw):
    with pytest.raises(ValueError):
        KVDone.from_bytes(raw)


def test_every_error_code_has_a_grpc_status():
    assert {code: grpc_status(code) for code in ErrorCode}[ErrorCode.FAILED_PRECONDITION] \
        is grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_status(ErrorCode.DEADLINE_EXCEEDED) is grpc.StatusCode.DEADLINE_EXCEEDED


def test_flags_follow_the_cli_contract():
    config = parse_node_args(["--model", "/m", "--port", "0", "--router", "127.0.0.1:6000", "--num-blocks", "64",
                              "--dtype", "float32", "--lease-s", "2.5", "--threads", "1"], "decode")
    engine = EngineConfig(model="/m", num_blocks=64, dtype="float32", num_threads=1)
    assert config == NodeConfig(engine, kind="decode", router="127.0.0.1:6000", lease_s=2.5)
    assert config.host == "127.0.0.1" and config.transfer.host == "127.0.0.1"
    assert config.engine.num_blocks == 64 and config.transfer.transfer_timeout_s == 2.5


def test_flags_can_be_added_to_another_parser():
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    config = config_from_args(parser.parse_args(["--model", "/m", "--node-id", "p0"]), "prefill")
    assert config.node_id == "p0" and config.resolved_node_id("127.0.0.1:1") == "p0"
    assert NodeConfig(EngineConfig("/m")).resolved_node_id("127.0.0.1:1") == "prefill-127.0.0.1:1"


@pytest.mark.parametrize("bad", [dict(kind="both"), dict(port=70000), dict(router="nowhere"), dict(lease_s=0),
                                 dict(retired_id_leases=0.5)])
def test_bad_config_names_the_field(bad):
    with pytest.raises(ValueError, match=f"^{next(iter(bad))} "):
        NodeConfig(EngineConfig("/m"), **bad)


def test_a_bad_engine_flag_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        parse_node_args(["--model", "/m", "--max-num-seqs", "0"], "decode")
    assert "max_num_seqs must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_node_args(["--model", "/m", "--dtype", "int8"], "decode")
    assert "argument --dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_params_from_proto_takes_the_routers_seed_and_unset_defaults():
    proto = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[3], ignore_eos=True, seed=1)
    params = params_from_proto(proto, seed=99)
    assert params == SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(3,), ignore_eos=True, seed=99)
    with pytest.raises(ValueError):
        params_from_proto(pdserve_pb2.SamplingParams(top_p=2.0), seed=0)


def test_proto_conversions():
    lp = logprobs_to_proto(7, LOGPROBS)
    assert lp.token_id == 7 and [t.token_id for t in lp.top] == [7, 9]
    assert finish_reason_to_proto(None) == pdserve_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_reason_to_proto("stop") == pdserve_pb2.FINISH_REASON_STOP
    stats = stats_to_proto(MESSAGES[-1].stats)
    assert (stats.kind, stats.used_blocks, stats.kv_transfer.bytes, stats.prefix_cache_hits) == ("decode", 4, 100, 4)


def test_prompt_logprobs_convert_to_the_public_shape():
    event = tokens_to_proto(Tokens("r", [1], [None], None, None, PROMPT_LOGPROBS))
    assert [(e.token_id, e.logprob, [t.token_id for t in e.top]) for e in event.prompt_logprobs] == \
        [(4, -3.0, [9]), (7, -0.25, [7, 9])]
    assert not tokens_to_proto(Tokens("r", [1], [None])).prompt_logprobs
    params = SamplingParams(prompt_logprobs=0)
    assert params_from_proto(params_to_proto(params), seed=0).prompt_logprobs == 0
    assert not params_to_proto(SamplingParams()).HasField("prompt_logprobs")
