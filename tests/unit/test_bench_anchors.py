"""Parsing what llama.cpp's bench tools print (pdserve/bench/anchor_tools.py). The anchors themselves
run only under `pdserve bench throughput --anchors`, never in the test suite; these outputs were
captured from llama-bench and llama-batched-bench built from the llama-cpp-python sdist."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.anchor_tools import parse_batched_bench, parse_llama_bench

LLAMA_BENCH_JSON = """
[
  {"build_commit": "0c1e570", "model_type": "llama 256M BF16", "n_threads": 2, "n_prompt": 16, "n_gen": 0, "avg_ns": 33667904, "avg_ts": 475.230059, "stddev_ts": 0.0},
  {"build_commit": "0c1e570", "model_type": "llama 256M BF16", "n_threads": 2, "n_prompt": 0, "n_gen": 4, "avg_ns": 59117497, "avg_ts": 67.661863, "stddev_ts": 0.0}
]
"""
BATCHED_BENCH_JSONL = (
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 8, '
    '"tg": 4, "pl": 2, "n_kv": 24, "t_pp": 0.033245, "speed_pp": 481.27536, "t_tg": 0.170421, "speed_tg": 46.94257, "t": 0.203666, "speed": 117.839989}\n'
)


def test_llama_bench_json_gives_prompt_and_decode_rates():
    result = parse_llama_bench(LLAMA_BENCH_JSON)
    assert result.prompt_tokens_per_s == pytest.approx(475.230059)
    assert result.decode_tokens_per_s == pytest.approx(67.661863)


def test_llama_bench_without_a_decode_test_is_refused():
    only_prompt = json.dumps([json.loads(LLAMA_BENCH_JSON)[0]])
    with pytest.raises(ValueError, match="lacks a pp or tg test"):
        parse_llama_bench(only_prompt)


def test_batched_bench_output_rate_counts_generated_tokens_over_the_whole_run():
    result = parse_batched_bench("log line before the table\n" + BATCHED_BENCH_JSONL)
    assert result.parallel == 2
    # pl * tg generated tokens over t = t_pp + t_tg seconds.
    assert result.output_tokens_per_s == pytest.approx(2 * 4 / 0.203666)
    assert result.decode_tokens_per_s == pytest.approx(46.942570)


def test_batched_bench_without_rows_is_refused():
    with pytest.raises(ValueError, match="no jsonl row"):
        parse_batched_bench("main: error\n")
