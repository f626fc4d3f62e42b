"""Each node kind's `CorePart`: what its front declares, what the core process loads, and a light front."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.colocated_node.core import ColocatedCore
from pdserve.colocated_node.server import CORE as COLOCATED
from pdserve.decode_node.core import DecodeCore
from pdserve.decode_node.server import CORE as DECODE
from pdserve.engine.policy import ColocatedPolicy
from pdserve.node.core_part import CorePart
from pdserve.prefill_node.core import PrefillCore
from pdserve.prefill_node.policy import PrefillPolicy
from pdserve.prefill_node.server import CORE as PREFILL


@pytest.mark.parametrize("part, policy, hands_off, uses_kv, handler", [
    (PREFILL, PrefillPolicy, True, True, PrefillCore),
    (DECODE, ColocatedPolicy, False, True, DecodeCore),
    (COLOCATED, ColocatedPolicy, False, False, ColocatedCore),
], ids=["prefill", "decode", "colocated"])
def test_each_kind_declares_its_policy_transport_and_handler(part, policy, hands_off, uses_kv, handler):
    assert part.policy is policy and part.policy().hands_off_after_first_token() is hands_off
    assert part.uses_kv_transport is uses_kv
    factory = part.load_handler_factory()
    assert factory.__module__ == handler.__module__ and factory.__annotations__["return"] == handler.__name__


def test_a_malformed_core_part_is_refused():
    with pytest.raises(ValueError, match="module:function"):
        CorePart(ColocatedPolicy, "pdserve.colocated_node.core")
    with pytest.raises(TypeError, match="not a core handler factory"):
        CorePart(ColocatedPolicy, "pdserve.colocated_node.core:ColocatedCoreMissing").load_handler_factory()


def test_no_front_loads_torch_transformers_or_ucx():
    code = ("import sys, pdserve.prefill_node.server, pdserve.decode_node.server, pdserve.colocated_node.server; "
            "print(sorted(m for m in ('torch', 'transformers', 'ucxx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr
