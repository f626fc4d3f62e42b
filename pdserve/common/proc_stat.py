"""A process's CPU time, read from /proc/PID/stat: the one parse the benches (a process's CPU
per token) and the planner's witness (pdserve/planner/cpu_witness.py, a process tree's CPU) share."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcessTimes:
    parent: int  # the parent's pid
    own_s: float  # utime + stime
    children_s: float  # cutime + cstime: the children it has reaped


def parse_process_stat(stat_text: str) -> ProcessTimes:
    fields = stat_text.rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    utime, stime, cutime, cstime = (int(x) / CLOCK_TICKS for x in fields[11:15])
    return ProcessTimes(int(fields[1]), utime + stime, cutime + cstime)


def process_times(pid: int, proc: Path = Path("/proc")) -> ProcessTimes:
    return parse_process_stat((proc / str(pid) / "stat").read_text())


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    return process_times(pid).own_s
