"""The serving stack's load in the simulator, by hand: an exponentially weighted rate of the CPU
charged, the stretch of a step that starts while it is high, and the router's slowdown while the
cores it may run on are busy."""

from __future__ import annotations

import math

import pytest

from pdserve.planner.stack_load import MAX_STACK_SHARE, CpuLoad, idle_weighted, router_slowdown, stretch


def test_nothing_charged_takes_no_share():
    assert CpuLoad(cores=2).share(5.0) == 0.0
    assert stretch(CpuLoad(cores=2).share(5.0)) == 1.0


def test_a_charge_is_a_rate_over_the_window_that_decays_with_time():
    load = CpuLoad(cores=2, window_s=0.5)
    load.charge(0.0, 0.1)
    assert load.rate(0.0) == pytest.approx(0.2)  # 0.1 s of CPU over a 0.5 s window: 0.2 of a core
    assert load.share(0.0) == pytest.approx(0.1)  # over 2 cores
    assert load.rate(0.5) == pytest.approx(0.2 / math.e)
    load.charge(0.5, 0.1)
    assert load.rate(0.5) == pytest.approx(0.2 / math.e + 0.2)


def test_a_steady_stream_of_charges_settles_near_its_mean_rate():
    """1 ms of CPU every 5 ms: 0.2 of a core once the window has filled."""
    load = CpuLoad(cores=1, window_s=0.5)
    for k in range(2000):
        load.charge(k * 0.005, 0.001)
    # Just after a charge the weighted rate is (c / W) / (1 − e^(−dt/W)): within 1% of c / dt here.
    assert load.rate(1999 * 0.005) == pytest.approx(0.2, rel=0.01)


def test_the_shares_on_one_nodes_cores_add_and_the_stretch_is_bounded():
    assert stretch(0.1, 0.2) == pytest.approx(1 / (1 - 0.3))
    assert stretch(0.5, 0.7) == pytest.approx(1 / (1 - MAX_STACK_SHARE))


def test_no_cores_no_share():
    load = CpuLoad(cores=0)
    load.charge(0.0, 1.0)
    assert load.share(0.0) == 0.0


def test_floating_work_goes_to_the_idle_cores():
    # One idle core of two (the other node's engine busy): it takes all of the floating work.
    assert idle_weighted(0.3, [1.0, 0.0], [1, 1]) == [0.3, 0.0]
    # Idle 0.6 and 0.1 of a core: six parts to one, each as a share of its own cores.
    shares = idle_weighted(0.7, [0.6, 0.1], [1, 1])
    assert shares == pytest.approx([0.6, 0.1])
    assert idle_weighted(0.4, [1.0, 1.0], [2, 2]) == pytest.approx([0.1, 0.1])  # 0.2 of a core on each of 2
    # No idle core anywhere: spread evenly over all cores.
    assert idle_weighted(0.4, [0.0, 0.0], [1, 3]) == pytest.approx([0.1, 0.1])


def test_the_router_slows_only_while_every_node_it_may_run_on_is_busy():
    assert router_slowdown([]) == router_slowdown([0.0]) == router_slowdown([0.0, 0.9]) == 1.0
    assert router_slowdown([0.6]) == pytest.approx(1.6)  # its one core busy 60% of the time: half speed then
    assert router_slowdown([0.6, 0.5]) == pytest.approx(1.3)  # both busy at once 30% of the time
    assert router_slowdown([1.7]) == 2.0  # a core shared with others: counted as half speed, no slower
