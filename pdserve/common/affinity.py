"""Cores as devices: a node process pinned to a set of CPUs, its torch threads sized to them.

Owns the Linux cpu-list syntax ("0", "0-3", "0,2-3"; what `taskset -c` and
/proc/<pid>/status `Cpus_allowed_list` speak), the check that the cores exist for this
process, and pinning the calling process to them. On CPU, a pool's size is its cores —
the analogue of GPUs per pool — so a node's front and its engine-core process both pin
themselves at startup (pdserve/node/front/server.py, pdserve/node/core/spawn.py) and the engine runs one torch
thread per pinned core unless `--threads` says otherwise.

Must never: import torch (the front imports this module), or widen a process's
affinity beyond what its caller asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Collection, Iterable, Iterator, Sequence


def parse_cpu_list(text: str, flag: str = "--cpus") -> tuple[int, ...]:
    """The cores of a cpu list, ascending. Raises ValueError naming `flag` for bad syntax,
    an empty list, a reversed range or a core named twice."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            raise ValueError(f"{flag}: empty item in cpu list {text!r} (expected e.g. 0,2-3)")
        first, dash, last = part.partition("-")
        try:
            start, end = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a core number or a range A-B in {text!r}") from None
        if start < 0 or end < start:
            raise ValueError(f"{flag}: {part!r} is not a range of core numbers (A-B with 0 <= A <= B)")
        cpus.extend(range(start, end + 1))
    repeated = sorted({c for c in cpus if cpus.count(c) > 1})
    if repeated:
        raise ValueError(f"{flag}: core {format_cpu_list(repeated)} named more than once in {text!r}")
    return tuple(sorted(cpus))


def cpu_list_arg(flag: str):
    """An argparse `type=` for a cpu-list flag; argparse names the flag in its error."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return parse_cpu_list(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    return parse


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The compact cpu list of `cpus`: (0, 1, 2, 5) -> "0-2,5"."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def available_cpus() -> frozenset[int]:
    """The cores this process may run on (a container's or a parent's pinning included)."""
    return frozenset(os.sched_getaffinity(0))


def check_available(cpus: Collection[int], flag: str, available: Collection[int]) -> None:
    """Raise ValueError naming `flag` when a core is not one this machine lets us use."""
    missing = sorted(set(cpus) - set(available))
    if missing:
        raise ValueError(f"{flag}: core {format_cpu_list(missing)} is not on this machine "
                         f"(usable cores: {format_cpu_list(available)})")


def pin_to_cpus(cpus: Collection[int] | None, flag: str = "--cpus") -> None:
    """Pin the calling process (and what it starts from now on) to `cpus`; None: leave it.

    Threads and children started afterwards inherit the mask, which is why this runs
    first thing in a process, before torch starts its thread pool.
    """
    if cpus is None:
        return
    check_available(cpus, flag, available_cpus())
    os.sched_setaffinity(0, set(cpus))


@contextlib.contextmanager
def threads_pinned_to(cpus: Collection[int] | None) -> Iterator[None]:
    """Every thread of this process (those running already: gRPC's and torch's included, and those
    started inside) pinned to `cpus` until the block ends, then back to the process's mask; None:
    leave them. `os.sched_setaffinity(0, ...)` alone would move only the calling thread."""
    if cpus is None:
        yield
        return
    check_available(cpus, "cpus", available_cpus())
    before = available_cpus()
    _set_every_thread(set(cpus))
    try:
        yield
    finally:
        _set_every_thread(set(before))


def _set_every_thread(cpus: set[int]) -> None:
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


def split_cpus(cpus: Sequence[int], num_nodes: int, flag: str) -> list[tuple[int, ...]]:
    """`cpus` cut into `num_nodes` contiguous runs whose sizes differ by at most one (larger
    runs first): a pool's cores shared out among its nodes. Raises ValueError naming `flag`
    when there are fewer cores than nodes."""
    if len(cpus) < num_nodes:
        raise ValueError(f"{flag}: {len(cpus)} cores ({format_cpu_list(cpus)}) for {num_nodes} nodes; "
                         "every node needs at least one core")
    size, extra = divmod(len(cpus), num_nodes)
    runs: list[tuple[int, ...]] = []
    start = 0
    for index in range(num_nodes):
        end = start + size + (1 if index < extra else 0)
        runs.append(tuple(cpus[start:end]))
        start = end
    return runs
