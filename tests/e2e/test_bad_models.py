"""What cannot be served is refused at start, in one line, by the commands users run.

Real processes (`python -m pdserve ...`): the router, each node kind and `pdserve cluster`
refuse a bad model folder with one line naming it and exit 2 before serving anything (the
launcher fails the launch with that line at once); a node whose block size differs from the
router's is refused at registration, exits 78 with the router's line instead of registering
again, and the router serves on with the node it has. The bad folders are built locally
(tests/unit/test_model_checks.py), nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.common.refusal import EXIT_REFUSED, EXIT_USAGE
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.testing.waiting import settled, wait_until
from tests.e2e.cluster import HOST, free_port
from tests.integration.reference import assert_matches, greedy_references
from tests.unit.test_model_checks import masked_lm, no_tokenizer, sliding_window

START_TIMEOUT_S = 240.0  # processes importing torch and loading a model on a shared 2-core box
RPC_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def good(tiny_model) -> Path:
    """The good folder every bad one is built from (copied first: the shared one is never changed)."""
    return tiny_model


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def gpt_neo(good, tmp_path):
    from pdserve.model_factory import SMALL_TOKENIZER_VOCAB, build_tokenizer
    from pdserve.tiny_models import build_tiny_model

    return build_tiny_model("gpt_neo", tmp_path / "gpt_neo", build_tokenizer(SMALL_TOKENIZER_VOCAB))


@pytest.mark.parametrize("build, reason", [
    (no_tokenizer, "no tokenizer (tokenizer.json or tokenizer_config.json) there"),
    (masked_lm, "BertForMaskedLM is not a causal language model (...ForCausalLM)"),
])
def test_the_router_refuses_a_bad_folder_in_one_line(good, tmp_path, build, reason):
    folder = build(good, tmp_path)
    done = pdserve("router", "--model", str(folder), "--port", "0")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.strip() == f"pdserve router: --model {folder}: {reason}"
    assert "listening" not in done.stdout


@pytest.mark.parametrize("kind, build, reason", [
    ("prefill", masked_lm, "BertForMaskedLM is not a causal language model (...ForCausalLM)"),
    ("decode", no_tokenizer, "no tokenizer (tokenizer.json or tokenizer_config.json) there"),
    ("colocated", sliding_window, "mistral: sliding window 64 < max_position_embeddings 4096; "
                                  "the engine's attention has no sliding window"),
    # Passes every check before loading (the router accepts it): refused by the node's first steps.
    ("decode", gpt_neo, "GPTNeoForCausalLM: the engine's paged attention ran for layers none of 2 in one step; "
                        "this model class computes attention its own way"),
])
def test_every_node_kind_refuses_a_bad_folder_in_one_line(good, tmp_path, kind, build, reason):
    folder = build(good, tmp_path)
    # The router address has nothing behind it: the node never gets that far.
    done = pdserve(kind, "--model", str(folder), "--port", "0", "--router", f"{HOST}:1", "--dtype", "float32")
    assert done.returncode == EXIT_USAGE
    assert last_line(done.stderr) == f"pdserve {kind}: --model {folder}: {reason}"
    assert "Traceback" not in done.stderr and "listening" not in done.stdout


def test_the_cluster_launch_fails_at_once_with_the_refusal_line(good, tmp_path):
    folder = masked_lm(good, tmp_path)
    done = pdserve("cluster", "--model", str(folder), "--port", "0", "--http-port", "0", "--colocated", "1")
    # The router and the node start together and both refuse the folder: the first to exit is named.
    first = "router" if "failed: router exited" in done.stdout else "colocated-0"
    line = (f"pdserve {first.removesuffix('-0')}: --model {folder}: "
            "BertForMaskedLM is not a causal language model (...ForCausalLM)")
    assert done.returncode == 1
    assert f"pdserve cluster failed: {first} exited with code {EXIT_USAGE}\n" in done.stdout
    assert f"  | {line}\n" in done.stdout


class Process:
    """A `python -m pdserve ...` child with its output in files (read while it runs)."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.out, self.err = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_for(self, text: str) -> None:
        wait_until(lambda: text in self.out.read_text() or self.proc.poll() is not None,
                   lambda: f"{text!r} is printed:\n{self.err.read_text()[-4000:]}", START_TIMEOUT_S, 0.1)
        assert text in self.out.read_text(), self.err.read_text()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)


PROMPT = [5, 17, 42, 99, 7]


def generate(router: str) -> list[int]:
    params = pdserve_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=PROMPT), sampling_params=params)
    with grpc.insecure_channel(router) as channel:
        responses = pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=RPC_TIMEOUT_S)
        return [token for response in responses for token in response.token_ids]


def used_blocks_once_idle(node: str) -> int:
    """The colocated node's used blocks, once it runs nothing (bounded poll)."""
    with grpc.insecure_channel(node) as channel:
        stub = node_pb2_grpc.ColocatedNodeStub(channel)
        return settled(lambda: stub.GetStats(node_pb2.StatsRequest(), timeout=RPC_TIMEOUT_S),
                       lambda stats: not stats.used_blocks, RPC_TIMEOUT_S).used_blocks


def health(router: str) -> pdserve_pb2.HealthResponse:
    with grpc.insecure_channel(router) as channel:
        return pdserve_pb2_grpc.GenerationStub(channel).Health(pdserve_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)


def test_a_node_with_another_block_size_is_refused_and_the_router_serves_on(good, tmp_path):
    router_address = f"{HOST}:{free_port()}"
    node_flags = ["--model", str(good), "--port", "0", "--router", router_address, "--dtype", "float32",
                  "--num-blocks", "64", "--threads", "1"]
    router = Process("router", ["router", "--model", str(good), "--port", router_address.rsplit(":", 1)[1],
                                "--block-size", "8", "--heartbeat-timeout-s", "30"], tmp_path)
    processes = [router]
    try:
        router.wait_for("listening on")
        processes.append(same := Process("same", ["colocated", *node_flags, "--block-size", "8"], tmp_path))
        processes.append(other := Process("other", ["colocated", *node_flags, "--block-size", "16"], tmp_path))
        assert other.proc.wait(timeout=START_TIMEOUT_S) == EXIT_REFUSED
        line = f"pdserve colocated: the router at {router_address} refused this node: " \
               "block_size: this node has 16, the router 8"
        assert last_line(other.err.read_text()) == line
        same.wait_for("listening on")
        settled(lambda: health(router_address).colocated_nodes, bool, START_TIMEOUT_S, 0.1)
        assert_matches([generate(router_address)], greedy_references(str(good), [PROMPT], [4]))
        assert health(router_address).colocated_nodes == 1
        node_address = next(line for line in same.out.read_text().splitlines()
                            if "node listening on " in line).rsplit(" ", 1)[-1]
        assert used_blocks_once_idle(node_address) == 0
        assert "WARNING refused colocated node" in router.err.read_text()
        assert "block_size: this node has 16, the router 8" in router.err.read_text()
    finally:
        for process in reversed(processes):
            process.stop()
