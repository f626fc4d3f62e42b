"""`pdserve profile --tp 2`'s measuring on a tiny model: its ranks started as a node starts them
(this process as rank 0, a real worker process as rank 1), every step of the grid timed on both,
and the profile describing one rank's share of the KV."""

from __future__ import annotations

import json
import os

import torch

from pdserve.model_factory import make_model
from pdserve.planner.measure import measure_profile, step_shapes
from pdserve.planner.profile import NodeSetup, machine_facts


def test_a_tp_2_profile_is_measured_on_two_ranks(tmp_path):
    model = make_model(tmp_path / "tiny", "llama", "tiny", dtype=torch.float32, num_kv_heads=2)
    shape = json.loads((model / "config.json").read_text())
    machine, cpus = machine_facts(), os.sched_getaffinity(0)
    setup = NodeSetup(2, "float32", 16, tensor_parallel_size=2)
    profile = measure_profile(str(model), setup, progress=False)
    assert profile.setup == setup
    assert profile.machine == machine  # this machine's, not rank 0's pinned share of it
    assert len(profile.samples) == len(list(step_shapes(profile.max_model_len)))
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    # K and V of every layer, for the one KV head of the two this rank holds, 16 tokens of float32.
    assert profile.kv_block_bytes == 2 * shape["num_hidden_layers"] * 1 * 16 * head_dim * 4
    assert os.sched_getaffinity(0) == cpus  # rank 0 gave back its cores when the group closed
    # A KV push costs CPU on both ends (each process's UCX threads), measured beside its time.
    transfer, pushed = profile.transfer, 64 // 16 * profile.kv_block_bytes
    assert transfer.method.startswith("UCX push") and transfer.time(pushed) > 0
    assert transfer.send_cpu(1, pushed) > 0 and transfer.receive_cpu(1, pushed) > 0
