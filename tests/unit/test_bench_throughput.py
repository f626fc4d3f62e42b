"""`pdserve bench throughput` end to end on a tiny model: the JSON it writes, never its timings."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench import throughput

NUM_REQUESTS = 4
MAX_TOKENS = 8


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_writes_all_three_measurements_and_the_floor(tiny_model, tmp_path, restore_threads):
    out = tmp_path / "throughput.json"
    argv = [
        "--model-dir", str(tiny_model),
        "--num-requests", str(NUM_REQUESTS),
        "--max-tokens", str(MAX_TOKENS),
        "--min-prompt", "8",
        "--max-prompt", "24",
        "--batch-size", "2",
        "--threads", "1",
        "--copy-mib", "8",
        "--out", str(out),
    ]

    assert throughput.main(argv) == 0

    data = json.loads(out.read_text())
    lens = data["workload"]["prompt_lens"]
    assert len(lens) == NUM_REQUESTS and all(8 <= n <= 24 for n in lens)
    for key in ("engine", "hf_generate", "hf_generate_batch"):
        result = data[key]
        assert result["error"] is None
        assert result["output_lens"] == [MAX_TOKENS] * NUM_REQUESTS
        assert result["output_tokens"] == NUM_REQUESTS * MAX_TOKENS
        assert result["seconds"] > 0 and result["tokens_per_s"] > 0
        assert result["cpu_seconds"] > 0 and result["tokens_per_cpu_s"] > 0
    engine = data["engine"]
    assert engine["num_decode_steps"] >= 1
    assert engine["decode_step_mean_s"] > 0
    assert engine["decode_batch_mean"] > 0
    floor = data["floor"]
    # Weights: bytes of the fp32 tiny model's parameters, the tied/untied count done by torch.
    assert floor["weight_bytes"] > 0 and floor["copy_bandwidth_bytes_per_s"] > 0
    assert 0 < floor["floor_s"] <= floor["floor_with_kv_s"]
    for key in ("engine_over_generate", "engine_over_generate_batch", "engine_over_generate_per_cpu_s",
                "engine_over_generate_batch_per_cpu_s", "decode_step_over_floor"):
        assert data["ratios"][key] > 0


def test_skip_hf_leaves_the_transformers_entries_empty(tiny_model, tmp_path, restore_threads):
    out = tmp_path / "throughput.json"
    argv = ["--model-dir", str(tiny_model), "--num-requests", "2", "--max-tokens", "3", "--min-prompt", "4",
            "--max-prompt", "6", "--threads", "1", "--copy-mib", "8", "--skip-hf", "--out", str(out)]

    assert throughput.main(argv) == 0

    data = json.loads(out.read_text())
    assert data["engine"]["output_lens"] == [3, 3]
    assert data["hf_generate"] is None and data["hf_generate_batch"] is None
    assert data["ratios"]["engine_over_generate"] is None
    assert data["ratios"]["engine_over_generate_batch"] is None


def test_workload_is_seeded_and_never_uses_the_special_token():
    args = throughput._parse_args(["--num-requests", "16", "--min-prompt", "3", "--max-prompt", "9", "--seed", "7"])

    first = throughput.make_workload(5, args)
    again = throughput.make_workload(5, args)

    assert first == again
    assert all(3 <= len(p) <= 9 for p in first.prompts)
    assert all(1 <= t < 5 for p in first.prompts for t in p)


def test_a_failing_generate_batch_is_reported_not_raised(tiny_model, tmp_path, restore_threads, monkeypatch):
    from transformers import GenerationMixin

    def refuse(self, *args, **kwargs):
        raise NotImplementedError("continuous batching needs an accelerator")

    monkeypatch.setattr(GenerationMixin, "generate_batch", refuse)
    out = tmp_path / "throughput.json"
    argv = ["--model-dir", str(tiny_model), "--num-requests", "2", "--max-tokens", "3", "--min-prompt", "4",
            "--max-prompt", "6", "--threads", "1", "--copy-mib", "8", "--out", str(out)]

    assert throughput.main(argv) == 0

    data = json.loads(out.read_text())
    assert data["hf_generate_batch"]["error"] == "NotImplementedError: continuous batching needs an accelerator"
    assert data["hf_generate_batch"]["output_tokens"] == 0
    assert data["ratios"]["engine_over_generate_batch"] is None
    assert data["hf_generate"]["output_lens"] == [3, 3]
