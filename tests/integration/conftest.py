"""Real transformers models on disk, shared by the tests that run the engine in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.model_factory import make_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch, "tiny", dtype=torch.float32, seed=0) for arch in ("llama", "qwen2", "mistral", "qwen3")}
