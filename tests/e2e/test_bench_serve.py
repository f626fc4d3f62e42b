"""`pdserve bench serve` against a real 1P1D cluster of the tiny float32 Llama on 127.0.0.1.

Checks what a user of the report relies on, never a timing: the JSON holds every
request of every run, all OK, each with exactly the prompt and output token counts
asked for; the plots are PNG files; every node ends with zero blocks in use.
"""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.testing.waiting import wait_until
from tests.e2e.cluster import NodeSettings, running_cluster
from pdserve.testing.metrics import counter
from pdserve.bench.serve import cli as serve_cli
from pdserve.bench.serve.workloads import ModelLimits, SyntheticWorkload, UniformLengths
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

from pdserve import cli

BLOCK_SIZE = 8
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Generous: these runs check counts and statuses, not latencies.
COMMON = ["--ttft-slo", "60", "--tpot-slo", "30", "--timeout-s", "120", "--no-progress"]


@pytest.fixture(scope="module")
def cluster(tiny_llama):
    model_dir = tiny_llama
    with running_cluster(str(model_dir), 1, 1, NodeSettings(block_size=BLOCK_SIZE), metrics=True) as running:
        yield running


def requests_of(doc, run_index):
    return doc["runs"][run_index]["requests"]


def assert_blocks_free(cluster):
    assert [s.used_blocks for s in cluster.wait_all_blocks_free(timeout_s=5)] == [0, 0]


def test_two_rates_of_uniform_requests_write_exact_json_and_plots(cluster, tmp_path):
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    argv = ["bench", "serve", "--addr", cluster.router, "--rates", "4,8", "--num-requests", "6",
            "--workload", "uniform", "--input-len-range", "8:24", "--output-len-range", "4:8", "--seed", "1",
            "--output-json", str(out), "--plot-dir", str(plots), *COMMON]

    assert cli.main(argv) == 0

    doc = json.loads(out.read_text())
    model = doc["model"]
    assert (model["vocab_size"], model["max_model_len"], model["block_size"]) == (960, 4096, BLOCK_SIZE)
    assert doc["config"]["rates"] == [4.0, 8.0] and doc["sweep"] is None
    # The same seeded requests at both rates: the lengths the workload module gives for seed 1.
    limits = ModelLimits(model["vocab_size"], model["max_model_len"], tuple(model["eos_token_ids"]))
    workload = SyntheticWorkload(UniformLengths((8, 24), (4, 8)), limits, seed=1)
    want = [(workload.request(i).input_len, workload.request(i).output_len) for i in range(6)]
    assert [run["rate"] for run in doc["runs"]] == [4.0, 8.0]
    for index, run in enumerate(doc["runs"]):
        requests = requests_of(doc, index)
        assert [r["status"] for r in requests] == ["OK"] * 6
        assert [(r["input_len"], r["output_len"]) for r in requests] == want
        assert [r["expected_output_len"] for r in requests] == [o for _, o in want]
        assert [len(r["itl_s"]) for r in requests] == [o - 1 for _, o in want]
        summary = run["summary"]
        assert (summary["num_requests"], summary["num_ok"], summary["statuses"]) == (6, 6, {"OK": 6})
        assert summary["ttft_s"]["count"] == 6 and summary["tpot_s"]["count"] == 6
        assert summary["itl_s"]["count"] == sum(o - 1 for _, o in want)
    for name in ("attainment_vs_rate.png", "latency_cdf.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > len(PNG_SIGNATURE)
    assert_blocks_free(cluster)


def test_jsonl_text_prompts_are_counted_by_the_server(cluster, tmp_path):
    dataset = tmp_path / "traffic.jsonl"
    prompts = [("The quick brown fox", 5), ("Disaggregated serving splits prefill and decode", 3)]
    dataset.write_text("".join(json.dumps({"prompt": p, "output_len": n}) + "\n" for p, n in prompts))
    out = tmp_path / "jsonl.json"
    argv = ["--addr", cluster.router, "--rate", "inf", "--num-requests", "3", "--workload", "jsonl",
            "--dataset", str(dataset), "--output-json", str(out), *COMMON]

    assert serve_cli.main(argv) == 0

    with grpc.insecure_channel(cluster.router) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        prompt_lens = [len(stub.Tokenize(pdserve_pb2.TokenizeRequest(text=p), timeout=30).token_ids) for p, _ in prompts]
    doc = json.loads(out.read_text())
    assert doc["config"]["rate"] == doc["runs"][0]["rate"] == "inf"
    requests = requests_of(doc, 0)
    assert [r["status"] for r in requests] == ["OK"] * 3
    assert [(r["input_len"], r["output_len"]) for r in requests] == [
        (prompt_lens[0], 5), (prompt_lens[1], 3), (prompt_lens[0], 5)]
    assert_blocks_free(cluster)


def test_warmup_requests_are_sent_first_and_a_run_spans_its_minimum_duration(cluster, tmp_path):
    out = tmp_path / "warm.json"
    served_before = counter(cluster.metrics["router"], "pdserve_requests", "status").get("OK", 0)
    # 2 requests asked for, at 10/s over at least 0.5 s: ceil(10 x 0.5) = 5 are sent.
    argv = ["--addr", cluster.router, "--rate", "10", "--num-requests", "2", "--min-duration-s", "0.5",
            "--warmup-requests", "3", "--workload", "fixed", "--input-len", "8", "--output-len", "3",
            "--output-json", str(out), *COMMON]

    assert serve_cli.main(argv) == 0

    requests = requests_of(json.loads(out.read_text()), 0)
    assert [r["status"] for r in requests] == ["OK"] * 5  # the warm-up is in no run
    def served() -> float:
        return counter(cluster.metrics["router"], "pdserve_requests", "status")["OK"] - served_before

    # The router counts a request once its stream has ended, which can be just after the client saw the end.
    wait_until(lambda: served() >= 3 + 5, lambda: f"the router counted {served()} of 3 + 5 requests", timeout_s=10)
    assert served() == 3 + 5
    assert_blocks_free(cluster)


def test_a_minimum_duration_with_a_duration_is_refused_naming_the_flag(cluster, capsys):
    argv = ["--addr", cluster.router, "--rate", "4", "--duration-s", "1", "--min-duration-s", "2", *COMMON]
    with pytest.raises(SystemExit) as exit_info:
        serve_cli.main(argv)
    assert exit_info.value.code == 2
    assert "--min-duration-s is for --num-requests" in capsys.readouterr().err


def test_chat_lengths_on_bursty_gamma_arrivals_for_a_duration(cluster, tmp_path):
    out = tmp_path / "chat.json"
    argv = ["--addr", cluster.router, "--rate", "6", "--arrival", "gamma", "--cv", "2", "--duration-s", "1",
            "--workload", "chat", "--chat-input-mean", "24", "--chat-output-mean", "6", "--seed", "3",
            "--output-json", str(out), *COMMON]

    assert serve_cli.main(argv) == 0

    requests = requests_of(json.loads(out.read_text()), 0)
    assert requests, "some requests were due within the second"
    assert all(r["due_s"] <= 1.0 for r in requests)
    assert [r["status"] for r in requests] == ["OK"] * len(requests)
    assert [r["output_len"] for r in requests] == [r["expected_output_len"] for r in requests]
    assert_blocks_free(cluster)


def test_the_openai_backend_measures_the_same_requests_through_the_http_api(cluster, tmp_path):
    out = tmp_path / "openai.json"
    argv = ["--backend", "openai", "--base-url", cluster.state.http, "--rate", "8", "--num-requests", "5",
            "--workload", "uniform", "--input-len-range", "8:24", "--output-len-range", "4:8", "--seed", "1",
            "--output-json", str(out), *COMMON]

    assert serve_cli.main(argv) == 0

    doc = json.loads(out.read_text())
    model = doc["model"]
    assert (model["backend"], model["model"], model["vocab_size"], model["max_model_len"]) == (
        "openai", "llama", 960, 4096)
    limits = ModelLimits(model["vocab_size"], model["max_model_len"])
    workload = SyntheticWorkload(UniformLengths((8, 24), (4, 8)), limits, seed=1)
    want = [(workload.request(i).input_len, workload.request(i).output_len) for i in range(5)]
    requests = requests_of(doc, 0)
    assert [r["status"] for r in requests] == ["OK"] * 5
    assert [(r["input_len"], r["output_len"]) for r in requests] == want
    assert [len(r["itl_s"]) for r in requests] == [o - 1 for _, o in want]
    assert all(r["request_id"].startswith("cmpl-") for r in requests)
    assert_blocks_free(cluster)


def test_the_openai_backend_refuses_a_model_the_server_does_not_list(cluster, capsys):
    argv = ["--backend", "openai", "--base-url", cluster.state.http, "--model", "gpt-4", "--rate", "1", *COMMON]
    assert serve_cli.main(argv) == 2
    assert "pass --model" in capsys.readouterr().err
