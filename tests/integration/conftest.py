"""Real transformers models on disk, shared by the tests that run the engine in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def model_dirs(tiny_models) -> dict[str, Path]:
    """llama, qwen2, mistral and qwen3 (tests/conftest.py's `tiny_models`)."""
    return {arch: tiny_models[arch] for arch in ("llama", "qwen2", "mistral", "qwen3")}
