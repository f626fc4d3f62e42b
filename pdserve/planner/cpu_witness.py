"""What else took the machine's CPU while a validation measured a candidate.

A validation measures a cluster's goodput on this machine at one time. On a shared machine that
time is not all the cluster's: a neighbouring virtual machine may hold the host's core (steal,
/proc/stat's eighth column), and a process outside the cluster may run on the cores the plan
gave it. Either lowers the goodput measured, and the planner would count it as its own error.
Measured on an AVX2 machine (2026-12-07, docs/benchmarks.md): one validation swept colocated ×2
of the demo model at 7.98 requests/s; ten minutes later a sweep of the same command by hand
measured 15.6, and another validation of the same plan 13.6–17.1, with nothing in the logs to
tell the first run apart.

`CpuWitness` reads the machine's CPU time (/proc/stat) and the CPU time of this process's tree
(itself and its descendants, the cluster and the client among them: utime + stime + the reaped
children's, so a process that ends inside the window keeps its time) when a measurement starts
and when it ends. The difference is the window's `CpuUse`: its capacity (every core's time), the
steal, the tree's own CPU and the others' (busy time outside the tree). A process orphaned out
of the tree counts as another's.

Must never: start or stop anything; it only reads /proc.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.proc_stat import CLOCK_TICKS, ProcessTimes, parse_process_stat

# A measurement during which other work held at least this share of the machine's CPU time is
# reported as suspect (a slow spell of 2× above came with no other sign).
SUSPECT_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class MachineTimes:
    """/proc/stat's first line, in seconds since boot."""

    total_s: float  # user + nice + system + idle + iowait + irq + softirq + steal (guest is in user)
    idle_s: float  # idle + iowait
    steal_s: float

    @classmethod
    def parse(cls, stat_text: str) -> MachineTimes:
        fields = stat_text.splitlines()[0].split()
        if fields[0] != "cpu":
            raise ValueError(f"/proc/stat does not start with the machine's cpu line: {fields[0]!r}")
        ticks = [int(x) for x in fields[1:9]]
        return cls(sum(ticks) / CLOCK_TICKS, (ticks[3] + ticks[4]) / CLOCK_TICKS, ticks[7] / CLOCK_TICKS)


def tree_cpu_s(processes: dict[int, ProcessTimes], root: int) -> float:
    """The CPU seconds of `root` and its descendants, each with the children it reaped (so a
    process that ended inside a window keeps its time there)."""
    children: dict[int, list[int]] = {}
    for pid, times in processes.items():
        children.setdefault(times.parent, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        if pid in processes:
            total += processes[pid].own_s + processes[pid].children_s
        stack.extend(children.get(pid, ()))
    return total


def process_table(proc: Path = Path("/proc")) -> dict[int, ProcessTimes]:
    """Every process's CPU times and parent, by pid."""
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found[int(entry.name)] = parse_process_stat((entry / "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):  # ended while the listing was read
            continue
    return found


@dataclass(frozen=True, slots=True)
class Snapshot:
    machine: MachineTimes
    tree_s: float


@dataclass(frozen=True, slots=True)
class CpuUse:
    """Where the machine's CPU time went over one window, in seconds."""

    capacity_s: float  # every core's time over the window
    steal_s: float
    tree_s: float  # this process and its descendants
    others_s: float  # busy outside the tree

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot) -> CpuUse:
        capacity = after.machine.total_s - before.machine.total_s
        steal = after.machine.steal_s - before.machine.steal_s
        busy = capacity - (after.machine.idle_s - before.machine.idle_s) - steal
        tree = after.tree_s - before.tree_s
        return cls(capacity, steal, tree, max(0.0, busy - tree))

    @property
    def taken_share(self) -> float:
        """The share of the machine's CPU time that steal and other processes took."""
        return (self.steal_s + self.others_s) / self.capacity_s if self.capacity_s > 0 else 0.0

    @property
    def suspect(self) -> bool:
        return self.taken_share >= SUSPECT_SHARE

    def record(self) -> dict[str, float]:
        return {"capacity_s": self.capacity_s, "steal_s": self.steal_s, "tree_s": self.tree_s,
                "others_s": self.others_s, "taken_share": self.taken_share}


class CpuWitness:
    """`start()`, the measurement, `stop()` -> its `CpuUse`."""

    def __init__(self, root: int | None = None, proc: Path = Path("/proc")) -> None:
        self._root = os.getpid() if root is None else root
        self._proc = proc
        self._start: Snapshot | None = None

    def snapshot(self) -> Snapshot:
        machine = MachineTimes.parse((self._proc / "stat").read_text())
        return Snapshot(machine, tree_cpu_s(process_table(self._proc), self._root))

    def start(self) -> None:
        self._start = self.snapshot()

    def stop(self) -> CpuUse:
        if self._start is None:
            raise RuntimeError("CpuWitness.stop() before start()")
        return CpuUse.between(self._start, self.snapshot())
