"""Each node kind as a row of pdserve/node_kinds.py: its policy, its node core's KV stages, whether
it computes prompts of its own, its services; what the core process loads; a light front."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.policy import ColocatedPolicy
from pdserve.node.config import NodeConfig
from pdserve.node.core.core_part import CorePart
from pdserve.node.front.servicers import StreamServicer
from pdserve.node_kinds import KINDS
from pdserve.prefill_node.policy import PrefillPolicy
from pdserve.prefill_node.server import PrefillServicer


def config(kind: str, **flags) -> NodeConfig:
    return NodeConfig(EngineConfig("/m"), kind=kind, **flags)


@pytest.mark.parametrize("kind, flags, policy, hands_off, stages, own_prompts, services", [
    ("prefill", {}, PrefillPolicy, True, ["pdserve.prefill_node.kv_export"], False, {"PrefillNode": PrefillServicer}),
    ("decode", {}, ColocatedPolicy, False, ["pdserve.decode_node.kv_import"], False, {"DecodeNode": StreamServicer}),
    ("decode", {"local_prefill": True}, ColocatedPolicy, False, ["pdserve.decode_node.kv_import"], True,
     {"DecodeNode": StreamServicer, "ColocatedNode": StreamServicer}),
    ("decode", {"serve_prefill": True}, ColocatedPolicy, False,
     ["pdserve.decode_node.kv_import", "pdserve.prefill_node.kv_export"], True,
     {"DecodeNode": StreamServicer, "ColocatedNode": StreamServicer, "PrefillNode": PrefillServicer}),
    ("colocated", {}, ColocatedPolicy, False, [], True, {"ColocatedNode": StreamServicer}),
], ids=["prefill", "decode", "hybrid-decode", "serve-prefill-decode", "colocated"])
def test_each_kind_is_a_row(kind, flags, policy, hands_off, stages, own_prompts, services):
    row = KINDS[kind]
    part = row.core_part(config(kind, **flags))
    assert part.policy is policy and part.policy().hands_off_after_first_token() is hands_off
    assert [f.__module__ for f in part.load_stage_factories()] == stages
    assert part.uses_kv_transport is bool(stages)
    assert part.local_prefill is own_prompts
    assert row.services_for(config(kind, **flags)) == services


@pytest.mark.parametrize("flag", ["local_prefill", "serve_prefill"])
@pytest.mark.parametrize("kind", ["prefill", "colocated"])
def test_only_a_decode_node_takes_its_prompt_options(kind, flag):
    with pytest.raises(ValueError, match=flag):
        config(kind, **{flag: True})


def test_a_malformed_core_part_is_refused():
    with pytest.raises(ValueError, match="module:function"):
        CorePart(ColocatedPolicy, ("pdserve.decode_node.kv_import",))
    with pytest.raises(TypeError, match="not a KV stage factory"):
        CorePart(ColocatedPolicy, ("pdserve.decode_node.kv_import:missing",)).load_stage_factories()


def test_no_front_loads_torch_transformers_or_ucx():
    code = ("import sys, pdserve.node_kinds, pdserve.node.front.server; "
            "print(sorted(m for m in ('torch', 'transformers', 'ucxx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
