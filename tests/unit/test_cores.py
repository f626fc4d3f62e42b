"""Cores as devices: cpu-list parsing and formatting, splitting a pool's cores, a node's `--cpus`."""

from __future__ import annotations

import os
import threading

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.common.affinity import (
    available_cpus, check_available, format_cpu_list, parse_cpu_list, split_cpus, threads_pinned_to,
)
from pdserve.node.config import NodeConfig, parse_node_args


@pytest.mark.parametrize("text, cpus", [
    ("0", (0,)),
    ("0-1", (0, 1)),
    ("0,2-3", (0, 2, 3)),
    ("4-4,1", (1, 4)),
    (" 2 , 0 ", (0, 2)),
])
def test_cpu_lists_parse_like_taskset(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text, message", [
    ("", "empty item"),
    ("0,,1", "empty item"),
    ("a", "'a' is not a core number"),
    ("1-", "'1-' is not a core number"),
    ("3-1", "'3-1' is not a range"),
    ("-1", "'-1' is not a core number"),
    ("0-2,1", "core 1 named more than once"),
])
def test_bad_cpu_lists_are_refused_naming_the_flag(text, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_cpu_list(text, "--decode-cores")
    assert str(err.value).startswith("--decode-cores: ")


def test_cpu_lists_format_compactly():
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list((3,)) == "3"
    assert parse_cpu_list(format_cpu_list([0, 2, 3, 9])) == (0, 2, 3, 9)


def test_a_pools_cores_split_evenly_and_contiguously():
    assert split_cpus((0, 1, 2, 3), 2, "--prefill-cores") == [(0, 1), (2, 3)]
    assert split_cpus((0, 1, 2, 3, 4), 2, "--prefill-cores") == [(0, 1, 2), (3, 4)]
    assert split_cpus((4, 6, 7), 3, "--prefill-cores") == [(4,), (6,), (7,)]
    with pytest.raises(ValueError, match=r"^--decode-cores: 1 cores \(3\) for 2 nodes"):
        split_cpus((3,), 2, "--decode-cores")


def test_a_core_not_on_this_machine_is_named():
    check_available((0, 1), "--cpus", {0, 1, 2})
    with pytest.raises(ValueError, match=r"^--colocated-cores: core 7-8 is not on this machine \(usable cores: 0-3\)"):
        check_available((0, 7, 8), "--colocated-cores", {0, 1, 2, 3})


def test_a_nodes_torch_threads_follow_its_cores_unless_set():
    assert NodeConfig(EngineConfig("m")).engine.num_threads is None
    assert NodeConfig(EngineConfig("m"), cpus=(0, 2, 3)).engine.num_threads == 3
    assert NodeConfig(EngineConfig("m", num_threads=1), cpus=(0, 2, 3)).engine.num_threads == 1
    with pytest.raises(ValueError, match="cpus must be a non-empty list"):
        NodeConfig(EngineConfig("m"), cpus=())


def test_the_node_cli_takes_a_cpu_list_for_every_kind(capsys):
    for kind in ("prefill", "decode", "colocated"):
        config = parse_node_args(["--model", "m", "--cpus", "0,2-3"], kind, {})
        assert (config.kind, config.cpus, config.engine.num_threads) == (kind, (0, 2, 3), 3)
    with pytest.raises(SystemExit):
        parse_node_args(["--model", "m", "--cpus", "3-1"], "colocated", {})
    assert "argument --cpus: '3-1' is not a range" in capsys.readouterr().err


def test_every_thread_is_pinned_inside_the_block_and_back_after_it():
    """A thread running before the block (as gRPC's are) is pinned too, not only the caller."""
    everything = available_cpus()
    one = {min(everything)}
    go, seen, done = threading.Event(), [], threading.Event()

    def worker():
        go.wait()
        seen.append(os.sched_getaffinity(0))
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with threads_pinned_to(one):
        assert os.sched_getaffinity(0) == one
        go.set()
        done.wait(10)
    thread.join(10)
    assert seen == [one]
    assert os.sched_getaffinity(0) == everything
    with threads_pinned_to(None):
        assert os.sched_getaffinity(0) == everything
