"""Suite-wide markers: everything under tests/integration and tests/e2e is `slow` (real models,
real processes), so `python -m pytest -m "not slow"` is the quick loop; the plain command
runs everything.

A failed test's report carries the log tails of every cluster among its fixtures (anything with
`log_tails()`: tests/e2e/cluster.py's), whose logs are gone once the cluster stops.

And the shared model fixtures, each built once per session: a test reads them, never changes them
(a test that needs a changed folder copies one first).
"""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_FOLDERS = ("integration", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).parent.name in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        tails = getattr(value, "log_tails", None)
        if callable(tails):
            report.sections.append((f"cluster logs ({name})", tails()))


def _tiny_llama(folder: Path) -> Path:
    import torch

    from pdserve.model_factory import make_model

    return make_model(folder, "llama", "tiny", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """The tiny random llama (float32, seed 0) most tests run, built once per session. Its folder is
    named "llama" (the model's name across a cluster). Read it; never change it."""
    return _tiny_llama(tmp_path_factory.mktemp("shared") / "llama")


@pytest.fixture(scope="session")
def tiny_models(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """A tiny random model (float32, seed 0) of each native architecture, in a folder named by it;
    the llama is `tiny_llama`. Read them; never change them."""
    import torch

    from pdserve.model_factory import ARCHS, make_model

    root = tmp_path_factory.mktemp("shared-archs")
    return {arch: tiny_llama if arch == "llama" else make_model(root / arch, arch, "tiny", dtype=torch.float32)
            for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The same tiny llama in a folder named "tiny": the model name "tiny" is what the router's
    tests (and the ones they share a router with) see. Read it; never change it."""
    return _tiny_llama(tmp_path_factory.mktemp("shared") / "tiny")


@pytest.fixture(scope="session")
def router_model(tiny_model):
    """(folder, the router's view of it): what `pdserve.testing.router.running_router` serves."""
    from pdserve.router.model import load_router_model

    return str(tiny_model), load_router_model(tiny_model)
