"""What tensor parallelism inside a node costs per step, measured on rank 0.

A node of T ranks pays two things on every step that one rank does not (pdserve/ranks/tp_group.py,
pdserve/engine/parallel.py): the hand-off of the packed batch to the workers (`TPGroup.fanout`: a copy
into the shared step buffer and a `step` message on each worker's pipe) and two gloo
all-reduces per layer. `timed_calls` times both in place, for the measured phase only, by
wrapping the function and putting the original back afterwards. An all-reduce's time on rank 0
includes waiting for the slowest rank to reach it, so it is an upper bound on the wire's cost.

For comparison, `gloo_replay_cost` replays the run's traffic over a gloo group of this process
and T-1 idle receiver processes: each step's batch as gloo broadcasts (what handing the batch
over through the process group would cost instead of the shared-memory buffer), and each
all-reduce at its size with no rank computing in between (the wire's share of the all-reduce
time measured in the run; the rest is rank 0 waiting for the other ranks).

Must never: leave a wrapped function behind, or join the node's own process group.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

GLOO_TIMEOUT = datetime.timedelta(seconds=60)
WARMUP_OPS = 3
STOP, BATCH, SUM = -1, 0, 1  # a header's op: end the receiver, a batch broadcast, an all-reduce


@dataclass
class CallTimes:
    """How often a wrapped function was called and the wall seconds spent inside it."""

    calls: int = 0
    seconds: float = 0.0

    def per_step(self, steps: int) -> dict:
        """Mean per call and per engine step (0.0 where nothing was counted)."""
        return {
            "calls": self.calls,
            "seconds": self.seconds,
            "calls_per_step": self.calls / steps if steps else 0.0,
            "mean_per_call_s": self.seconds / self.calls if self.calls else 0.0,
            "per_step_s": self.seconds / steps if steps else 0.0,
        }


@contextlib.contextmanager
def timed_calls(owner: object, name: str, on_call: Callable[..., None] | None = None) -> Iterator[CallTimes]:
    """Count and time every call of `owner.name` inside the block; the original is back after it,
    also when the block raises. `on_call(*args)` sees each call's arguments, outside the timing."""
    original = getattr(owner, name)
    times = CallTimes()

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.seconds += time.perf_counter() - start
            times.calls += 1
            if on_call is not None:
                on_call(*args)

    setattr(owner, name, timed)
    try:
        yield times
    finally:
        setattr(owner, name, original)


@dataclass
class StepCosts:
    """The TP run's hand-offs and all-reduces, each step's batch size in int64 words and each
    all-reduce's size in elements (of `reduce_dtype`)."""

    fanout: CallTimes = field(default_factory=CallTimes)
    all_reduce: CallTimes = field(default_factory=CallTimes)
    step_words: list[int] = field(default_factory=list)
    reduce_sizes: list[int] = field(default_factory=list)
    reduce_dtype: torch.dtype = torch.float32


@contextlib.contextmanager
def measured_step_costs(runner) -> Iterator[StepCosts]:
    """Time the runner's fanout (the group's, handed to the engine at start) and every
    `torch.distributed.all_reduce` while the block runs."""
    costs = StepCosts()

    def record_batch(batch, copies) -> None:
        if batch is not None:  # None: a step that only copies blocks
            costs.step_words.append(batch_words(batch))

    def record_reduce(partial: torch.Tensor, *rest) -> None:
        costs.reduce_sizes.append(partial.numel())
        costs.reduce_dtype = partial.dtype

    with timed_calls(runner, "fanout", record_batch) as costs.fanout, \
            timed_calls(torch.distributed, "all_reduce", record_reduce) as costs.all_reduce:
        yield costs


def batch_words(batch) -> int:
    """The int64 words a step's packed batch fills in the step buffer (pdserve/ranks/tp_wire.py)."""
    meta = batch.metadata
    arrays = (batch.input_ids, batch.positions, meta.slot_mapping, batch.logits_indices, meta.query_start_loc,
              meta.seq_lens, meta.block_tables)
    return sum(a.numel() for a in arrays)


@contextlib.contextmanager
def restored_affinity() -> Iterator[None]:
    """A TP engine pins this process (its rank 0) to its share of the cores and sets its torch
    threads; the phases after it must run as before."""
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)


def threads_per_rank(threads: int, size: int) -> int:
    """Each rank's torch threads: the same total as one rank with `threads`."""
    return max(1, threads // size)


def over(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None where either was not measured (None or a zero denominator)."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def tp_ratios(base: dict, tp: dict) -> dict:
    """TP=T over TP=1 of the engine results' (`SystemResult.to_dict()`) throughput and step times."""
    keys = ("tokens_per_s", "step_mean_s", "decode_step_mean_s")
    return {f"{key}_tp_over_tp1": over(tp.get(key), base.get(key)) for key in keys}


def cost_report(costs: StepCosts, steps: int, replay: dict | None) -> dict:
    """Per step: the hand-off and the all-reduces; against them, the gloo replay (None: not run)."""
    report = {
        "steps": steps,
        "fanout": costs.fanout.per_step(steps),
        "all_reduce": costs.all_reduce.per_step(steps),
        "batch_words_mean": _mean(costs.step_words),
        "all_reduce_elements_mean": _mean(costs.reduce_sizes),
        "all_reduce_dtype": str(costs.reduce_dtype).removeprefix("torch."),
        "gloo_replay": replay,
        "fanout_over_gloo_broadcast": None,
        "all_reduce_idle_over_measured": None,
    }
    if replay is not None:
        report["fanout_over_gloo_broadcast"] = over(report["fanout"]["per_step_s"], replay["broadcast"]["per_step_s"])
        report["all_reduce_idle_over_measured"] = over(replay["all_reduce_idle"]["mean_per_call_s"],
                                                       report["all_reduce"]["mean_per_call_s"])
    return report


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ gloo replay


def gloo_replay_cost(step_words: list[int], reduce_sizes: list[int], dtype: torch.dtype, size: int) -> dict:
    """The TP run's traffic again over a gloo group of this process and `size - 1` idle receiver
    processes (127.0.0.1): each step's batch as broadcasts (a header with its word count, then
    the words), and each all-reduce at its size, where no rank computes in between."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=GLOO_TIMEOUT,
                                       wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    receivers = [context.Process(target=_receive, args=(store.port, rank, size, str(dtype).removeprefix("torch.")),
                                 daemon=True) for rank in range(1, size)]
    for receiver in receivers:
        receiver.start()
    try:
        group = torch.distributed.ProcessGroupGloo(store, 0, size, GLOO_TIMEOUT)
        for words in step_words[:WARMUP_OPS]:
            _broadcast_batch(group, words)
        broadcast_s = sum(_broadcast_batch(group, words) for words in step_words)
        reduce_s = sum(_all_reduce(group, numel, dtype) for numel in reduce_sizes)
        _send_header(group, STOP, 0)
    finally:
        for receiver in receivers:
            receiver.join(timeout=10.0)
            if receiver.is_alive():
                receiver.kill()
    return {
        "broadcast": {"steps": len(step_words), "broadcasts_per_step": 2, "seconds": broadcast_s,
                      "per_step_s": broadcast_s / len(step_words) if step_words else 0.0},
        "all_reduce_idle": {"calls": len(reduce_sizes), "seconds": reduce_s,
                            "mean_per_call_s": reduce_s / len(reduce_sizes) if reduce_sizes else 0.0},
    }


def _broadcast_batch(group, words: int) -> float:
    """Seconds to hand one batch over: its header, then its words."""
    start = time.perf_counter()
    _send_header(group, BATCH, words)
    _wait(group.broadcast(torch.zeros(words, dtype=torch.int64), 0))
    return time.perf_counter() - start


def _all_reduce(group, numel: int, dtype: torch.dtype) -> float:
    """Seconds of one all-reduce of `numel` elements (its header not counted)."""
    _send_header(group, SUM, numel)
    partial = torch.zeros(numel, dtype=dtype)
    start = time.perf_counter()
    _wait(group.allreduce([partial]))
    return time.perf_counter() - start


def _send_header(group, op: int, numel: int) -> None:
    _wait(group.broadcast(torch.tensor([op, numel]), 0))


def _wait(work) -> None:
    work.wait()


def _receive(port: int, rank: int, size: int, dtype_name: str) -> None:
    """A receiver rank: answers headers until STOP."""
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=False, timeout=GLOO_TIMEOUT)
    group = torch.distributed.ProcessGroupGloo(store, rank, size, GLOO_TIMEOUT)
    header = torch.zeros(2, dtype=torch.int64)
    while True:
        _wait(group.broadcast(header, 0))
        op, numel = header.tolist()
        if op == STOP:
            return
        if op == BATCH:
            _wait(group.broadcast(torch.empty(numel, dtype=torch.int64), 0))
        else:
            _wait(group.allreduce([torch.zeros(numel, dtype=dtype)]))


# --------------------------------------------------------------------------- report


def print_tp_report(base: dict, tp: dict, size: int, report: dict, ratios: dict) -> None:
    print(f"\ntensor parallelism (same workload, same run): TP=1 vs TP={size}")
    print(f"  {'':<30} {'TP=1':>10} {f'TP={size}':>10} {'ratio':>7}")
    rows = (("output tok/s", "tokens_per_s", 1.0, ".1f"), ("mean step (ms)", "step_mean_s", 1e3, ".2f"),
            ("mean pure-decode step (ms)", "decode_step_mean_s", 1e3, ".2f"))
    for label, key, scale, fmt in rows:
        ratio = ratios[f"{key}_tp_over_tp1"]
        print(f"  {label:<30} {base[key] * scale:>10{fmt}} {tp[key] * scale:>10{fmt}} "
              f"{'n/a' if ratio is None else f'{ratio:.2f}x':>7}")
    fanout, reduce = report["fanout"], report["all_reduce"]
    print(f"  batch hand-off (fanout)        {fanout['per_step_s'] * 1e3:.3f} ms/step "
          f"({report['batch_words_mean']:.0f} int64 words per batch on average)")
    print(f"  all-reduces                    {reduce['calls_per_step']:.1f} calls/step x "
          f"{reduce['mean_per_call_s'] * 1e3:.3f} ms = {reduce['per_step_s'] * 1e3:.2f} ms/step "
          f"(rank 0's wait included)")
    replay = report["gloo_replay"]
    if replay is None:
        return
    broadcast, idle = replay["broadcast"], replay["all_reduce_idle"]
    print(f"  gloo broadcast of the same batches instead of the fanout: {broadcast['per_step_s'] * 1e3:.3f} ms/step "
          f"(fanout = {report['fanout_over_gloo_broadcast'] or 0:.2f}x of it)")
    print(f"  the same all-reduces with no rank computing: {idle['mean_per_call_s'] * 1e3:.3f} ms/call "
          f"({report['all_reduce_idle_over_measured'] or 0:.2f}x of the measured; the rest is waiting for a rank)")
