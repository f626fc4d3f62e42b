"""One config tree: a node's config holds the engine's and the transport's, its flags derive from them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from pdserve.cluster import ClusterConfig
from pdserve.common.config_flags import add_config_args, flag_name, values_from_args
from pdserve.engine.config import DEFAULT_BLOCK_SIZE, EngineConfig
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.node.config import NODE_OWNED_TRANSFER_FIELDS, NodeConfig, add_node_args, parse_node_args
from pdserve.router.config import RouterConfig


def _node_flags() -> set[str]:
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def test_every_engine_knob_is_a_node_flag():
    flags = _node_flags()
    assert {flag_name(f.name) for f in dataclasses.fields(EngineConfig)} <= flags


def test_every_transport_knob_is_a_kv_flag_except_the_nodes_own():
    flags = _node_flags()
    names = {f.name for f in dataclasses.fields(KVTransferConfig)} - set(NODE_OWNED_TRANSFER_FIELDS)
    assert {flag_name("kv_" + name) for name in names} <= flags
    assert not {flag_name("kv_" + name) for name in NODE_OWNED_TRANSFER_FIELDS} & flags


def test_flag_defaults_are_the_configs_defaults():
    assert parse_node_args(["--model", "/m"], "prefill") == NodeConfig(EngineConfig("/m"))


def test_flags_reach_every_branch_of_the_tree():
    config = parse_node_args(["--model", "/m", "--max-model-len", "64", "--no-enable-prefix-caching",
                              "--attention-backend", "reference", "--seed", "7", "--kv-port", "6001",
                              "--kv-progress-mode", "blocking", "--kv-chunk-bytes", "4096", "--lease-s", "2"],
                             "prefill")
    engine, transfer = config.engine, config.transfer
    assert (engine.max_model_len, engine.enable_prefix_caching, engine.attention_backend, engine.seed) == \
        (64, False, "reference", 7)
    assert (transfer.port, transfer.progress_mode, transfer.chunk_bytes) == (6001, "blocking", 4096)
    # The node's own facts reach the transport: a push is acknowledged within the lease.
    assert (config.lease_s, transfer.transfer_timeout_s) == (2.0, 2.0)


def test_a_node_pinned_to_cores_runs_a_thread_per_core_unless_told():
    assert parse_node_args(["--model", "/m", "--cpus", "0-2"], "decode").engine.num_threads == 3
    assert parse_node_args(["--model", "/m", "--cpus", "0-2", "--num-threads", "1"], "decode").engine.num_threads == 1
    assert parse_node_args(["--model", "/m", "--threads", "2"], "decode").engine.num_threads == 2


def test_the_block_size_default_has_one_home():
    assert EngineConfig("/m").block_size == RouterConfig(model="/m").block_size == ClusterConfig().block_size \
        == DEFAULT_BLOCK_SIZE


def test_a_required_field_is_a_required_flag_and_bools_take_no():
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        path: str = dataclasses.field(metadata={"help": "where"})
        fast: bool = True
        limit: int | None = None
        hidden: int = dataclasses.field(default=1, metadata={"flag": False})

    parser = argparse.ArgumentParser()
    add_config_args(parser, Knobs, prefix="x_")
    args = parser.parse_args(["--x-path", "p", "--no-x-fast", "--x-limit", "3"])
    assert Knobs(**values_from_args(args, Knobs, prefix="x_")) == Knobs("p", False, 3)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert not any("--x-hidden" in a.option_strings for a in parser._actions)


def test_the_node_config_does_not_load_torch():
    # The node's front builds its config; torch belongs to the engine core process only.
    code = ("import sys; from pdserve.node.config import parse_node_args; "
            "parse_node_args(['--model', '/m'], 'decode'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_auto_dtype_is_resolved_by_the_engine_not_the_config():
    config = EngineConfig("/m")
    assert config.dtype == "auto"
    assert config.resolved().dtype in ("float32", "bfloat16")
    assert EngineConfig("/m", dtype="float32").resolved().dtype == "float32"
    with pytest.raises(ValueError, match="dtype is still 'auto'"):
        config.torch_dtype


def test_the_routers_flags_are_its_config_tree():
    from pdserve.router.requests.admission import AdmissionLimits
    from pdserve.router.config import RequestLimits
    from pdserve.router.fronts.server import _parser, config_from_args

    parser = _parser()
    flags = {flag for action in parser._actions for flag in action.option_strings}
    leaves = [f for cls in (RouterConfig, RequestLimits, AdmissionLimits) for f in dataclasses.fields(cls)
              if f.metadata.get("flag", True) and not dataclasses.is_dataclass(f.default_factory
                                                                              if callable(f.default_factory) else None)]
    assert {flag_name(f.name) for f in leaves if f.name not in ("limits", "admission")} <= flags
    assert config_from_args(parser.parse_args(["--model", "/m"])) == RouterConfig(model="/m")
    config = config_from_args(parser.parse_args(["--model", "/m", "--max-inflight-requests", "3",
                                                 "--max-stop-strings", "2", "--decode", "127.0.0.1:7"]))
    assert (config.admission.max_inflight_requests, config.limits.max_stop_strings) == (3, 2)
    assert config.decode_addresses == ("127.0.0.1:7",)
