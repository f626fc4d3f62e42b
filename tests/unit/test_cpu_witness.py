"""Where the machine's CPU went while a validation measured (pdserve/planner/cpu_witness.py): /proc
read for real, around processes that burn a known amount of CPU inside and outside this
process's tree."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.common.proc_stat import CLOCK_TICKS, ProcessTimes, parse_process_stat
from pdserve.planner.cpu_witness import CpuUse, CpuWitness, MachineTimes, Snapshot, tree_cpu_s

# Burns CPU until its own process time reaches the first argument, then writes the file the second names.
BURN = ("import sys, time\n"
        "while time.process_time() < float(sys.argv[1]):\n"
        "    sum(i * i for i in range(10000))\n"
        "open(sys.argv[2], 'w').write('done')\n")


def test_the_machine_line_parses_into_seconds():
    t = CLOCK_TICKS
    text = f"cpu  {10 * t} {t} {2 * t} {50 * t} {3 * t} 0 {t} {4 * t} {7 * t} 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert MachineTimes.parse(text) == MachineTimes(71.0, 53.0, 4.0)  # guest (7 s) is in user already
    with pytest.raises(ValueError, match="cpu line"):
        MachineTimes.parse("intr 1 2 3\n")


def test_a_process_stat_gives_its_parent_and_its_own_and_reaped_childrens_cpu():
    t = CLOCK_TICKS
    # The name may hold spaces and parentheses; fields after it: state, ppid, ..., utime at 14.
    text = f"42 (a (b) c) S 7 42 42 0 -1 4194560 1 2 3 4 {3 * t} {t} {2 * t} {t} 20 0 1 0 5 6 7\n"
    assert parse_process_stat(text) == ProcessTimes(7, 4.0, 3.0)


def test_the_tree_holds_the_root_and_every_descendant_only():
    processes = {pid: ProcessTimes(parent, cpu, 0.0) for pid, (parent, cpu) in
                 {1: (0, 100.0), 10: (1, 1.0), 11: (10, 2.0), 12: (11, 4.0), 20: (1, 8.0), 21: (20, 16.0)}.items()}
    processes[12] = ProcessTimes(11, 3.0, 1.0)  # a reaped child's time counts with its parent's
    assert tree_cpu_s(processes, 10) == 7.0
    assert tree_cpu_s(processes, 20) == 24.0
    assert tree_cpu_s(processes, 99) == 0.0


def test_the_window_splits_busy_time_into_the_trees_the_others_and_steal():
    before = Snapshot(MachineTimes(100.0, 60.0, 1.0), tree_s=5.0)
    after = Snapshot(MachineTimes(120.0, 66.0, 2.0), tree_s=15.0)
    use = CpuUse.between(before, after)  # 20 s of capacity: 6 idle, 1 stolen, 13 busy, 10 of them the tree's
    assert (use.capacity_s, use.steal_s, use.tree_s, use.others_s) == (20.0, 1.0, 10.0, 3.0)
    assert use.taken_share == 0.2 and use.suspect


def _burn(seconds: float, done: str, orphan: bool) -> None:
    """Start a process that burns `seconds` of CPU: a child of this one, or an orphan (its parent,
    a shell, exits at once, so it leaves this process's tree)."""
    argv = [sys.executable, "-c", BURN, str(seconds), done]
    if orphan:
        subprocess.run(["sh", "-c", '"$@" >/dev/null 2>&1 &', "sh", *argv], check=True)
    else:
        subprocess.run(argv, check=True)


@pytest.mark.parametrize("orphan", [False, True])
def test_cpu_burnt_inside_the_tree_is_its_own_and_outside_it_anothers(tmp_path, orphan):
    done = tmp_path / "done"
    witness = CpuWitness()
    witness.start()
    _burn(0.5, str(done), orphan)
    while not done.exists():  # the orphan is no child of ours: its file says its CPU is spent
        time.sleep(0.02)
    use = witness.stop()
    if orphan:  # the machine's busy time holds it, whether or not it has exited yet
        assert use.others_s >= 0.45
    else:  # waited for: its time is in this process's reaped children's
        assert use.tree_s >= 0.5
