"""Suite-wide markers: everything under tests/integration and tests/e2e is `slow` (real models,
real processes), so `python -m pytest -m "not slow"` is the quick loop; the plain command
runs everything."""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_FOLDERS = ("integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).parent.name in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """The tiny random llama (float32, seed 0) most tests run, built once per session. Its folder is
    named "llama" (the model's name across a cluster). Read it; never change it."""
    import torch

    from pdserve.model_factory import make_model

    return make_model(tmp_path_factory.mktemp("shared") / "llama", "llama", "tiny", dtype=torch.float32)
