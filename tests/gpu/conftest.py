"""tests/gpu: what only a CUDA device can show. Every test here is marked `gpu` and skipped, with
the reason, where torch sees no CUDA device, so the CPU suite collects them and runs none.

`python -m pytest tests/gpu` on a machine with one GPU runs them (`-m gpu` selects them anywhere).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

NO_CUDA = "torch sees no CUDA device (torch.cuda.is_available() is false)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.path)).parents:
            continue
        item.add_marker(pytest.mark.gpu)
        item.add_marker(pytest.mark.slow)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))
