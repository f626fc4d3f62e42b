"""`--device`: one place decides it (pdserve/engine/device.py), everything the engine makes lives there,
and cuda is refused by name where it cannot run.

The tensors are checked on device cpu, the device this suite has: the same code runs on cuda,
where a tensor left on the host would fail the forward instead.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.config import parse_node_args

from .node_pair import engine_config


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cuda_seen(monkeypatch):
    """Torch says CUDA is there (nothing is allocated on it: these tests stop at the config)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_an_unset_device_resolves_to_cpu_without_cuda(no_cuda, tiny_llama):
    config = EngineConfig(model=str(tiny_llama), dtype="float32").resolved()
    assert config.device == "cpu"
    assert config.torch_device == torch.device("cpu")


def test_an_unset_device_resolves_to_cuda_where_torch_sees_one(cuda_seen, tiny_llama):
    assert EngineConfig(model=str(tiny_llama), dtype="float32").resolved().device == "cuda"


def test_an_unset_device_stays_on_cpu_where_the_config_cannot_run_on_cuda(cuda_seen, tiny_llama):
    config = EngineConfig(model=str(tiny_llama), dtype="float32", tensor_parallel_size=2)
    assert config.resolved().device == "cpu"


def test_cuda_without_cuda_is_refused_naming_the_flag(no_cuda, tiny_llama):
    with pytest.raises(ValueError, match=r"^device cuda \(--device cuda\) was asked for, but torch sees no CUDA"):
        EngineConfig(model=str(tiny_llama), device="cuda")


@pytest.mark.parametrize("kind", ["prefill", "decode", "colocated"])
def test_every_node_kind_refuses_device_cuda_without_cuda_as_a_usage_error(no_cuda, tiny_llama, kind, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_node_args(["--model", str(tiny_llama), "--device", "cuda"], kind)
    assert exit_info.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["prefill", "decode", "colocated"])
def test_every_node_kind_takes_device_cpu(tiny_llama, kind):
    assert parse_node_args(["--model", str(tiny_llama), "--device", "cpu"], kind).engine.device == "cpu"


def test_an_unknown_device_is_refused_by_argparse(tiny_llama, capsys):
    with pytest.raises(SystemExit):
        parse_node_args(["--model", str(tiny_llama), "--device", "tpu"], "colocated")
    assert "--device: invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "named"), [
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
    ({"kv_cache_memory_fraction": 0.5}, "--kv-cache-memory-fraction"),
])
def test_cuda_refuses_what_has_no_device_path_by_name(cuda_seen, tiny_llama, extra, named):
    with pytest.raises(ValueError, match=r"^device cuda \(--device cuda\) does not") as refusal:
        EngineConfig(model=str(tiny_llama), device="cuda", **extra)
    assert named in str(refusal.value)


class _Recorder:
    """Wraps the runner's forward and sampler: keeps every tensor each step hands them."""

    def __init__(self, runner) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        forward, sampler = runner.forward.__call__, runner.sampler

        def record_forward(batch):
            meta = batch.metadata
            self.tensors.update(input_ids=batch.input_ids, positions=batch.positions,
                                logits_indices=batch.logits_indices, slot_mapping=meta.slot_mapping,
                                query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                                block_tables=meta.block_tables)
            logits = forward(batch)
            self.tensors["logits"] = logits
            return logits

        def record_sampler(logits, rows):
            self.tensors["sampled_logits"] = logits
            return sampler(logits, rows)

        runner.forward = record_forward
        runner.sampler = record_sampler


def test_every_tensor_the_engine_makes_is_on_the_configured_device(tiny_llama):
    config = dataclasses.replace(engine_config(str(tiny_llama), num_blocks=16, budget=16), device="cpu")
    core = EngineCore(config)
    device = config.torch_device
    assert core.loaded.device == device
    assert {p.device for p in core.loaded.model.parameters()} == {device}
    assert {c.device for c in [*core.runner.k_caches, *core.runner.v_caches]} == {device}
    recorder = _Recorder(core.runner)
    core.add_request("r", list(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                             logprobs=2, repetition_penalty=1.1))
    while core.has_unfinished():
        core.step()
    assert {name: t.device for name, t in recorder.tensors.items()} == dict.fromkeys(recorder.tensors, device)
    assert core.kv.pool.num_used_blocks == 0
