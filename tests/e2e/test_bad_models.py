"""What cannot be served is refused at start, in one line, by the commands users run.

Real processes (`python -m pdserve ...`): the router, each node kind and `pdserve cluster`
refuse a bad model folder with one line naming it and exit 2 before serving anything (the
launcher fails the launch with that line at once). The bad folders are built locally
(tests/unit/test_model_checks.py), nothing is downloaded.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.common.refusal import EXIT_USAGE
from pdserve.model_factory import make_model
from tests.e2e.cluster import HOST
from tests.unit.test_model_checks import masked_lm, no_tokenizer, sliding_window

START_TIMEOUT_S = 240.0  # processes importing torch and loading a model on a shared 2-core box


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("good") / "tiny", "llama", "tiny", dtype=torch.float32)


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=START_TIMEOUT_S, stdin=subprocess.DEVNULL)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


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
])
def test_every_node_kind_refuses_a_bad_folder_in_one_line(good, tmp_path, kind, build, reason):
    folder = build(good, tmp_path)
    # The router address has nothing behind it: the node never gets that far.
    done = pdserve(kind, "--model", str(folder), "--port", "0", "--router", f"{HOST}:1", "--dtype", "float32")
    assert done.returncode == EXIT_USAGE
    assert last_line(done.stderr) == f"pdserve {kind}: --model {folder}: {reason}"
    assert "Traceback" not in done.stderr and "listening" not in done.stdout


def test_the_cluster_launch_fails_at_once_with_the_routers_line(good, tmp_path):
    folder = masked_lm(good, tmp_path)
    done = pdserve("cluster", "--model", str(folder), "--port", "0", "--colocated", "1")
    line = f"pdserve router: --model {folder}: BertForMaskedLM is not a causal language model (...ForCausalLM)"
    assert done.returncode == 1
    assert f"pdserve cluster failed: router exited with code {EXIT_USAGE}\n  | {line}\n" in done.stdout
