"""Fixtures for a test module served on both small layouts of the tiny model: a colocated node
(`pdserve cluster --colocated 1`) and a 1P1D pair, each started once per module, and the check
after every test that no node holds a block, runs or waits on anything.

A module takes them by importing the three names (pytest finds fixtures a module imports).
"""

from __future__ import annotations

import pytest

from tests.e2e.cluster import NodeSettings, running_cluster


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def cluster(request, model_dir):
    pools = (0, 0, 1) if request.param == "colocated" else (1, 1, 0)
    with running_cluster(model_dir, pools[0], pools[1], NodeSettings(), num_colocated=pools[2]) as running:
        yield running


@pytest.fixture(autouse=True)
def no_blocks_left(request):
    yield
    if "cluster" in request.fixturenames:
        held = request.getfixturevalue("cluster").wait_all_blocks_free(timeout_s=30)
        assert {(s.used_blocks, s.reserved_blocks, s.num_running, s.num_waiting) for s in held} == {(0, 0, 0, 0)}
