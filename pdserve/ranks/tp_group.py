"""A tensor-parallel node's ranks, seen from rank 0: it starts them, feeds them, and goes down with them.

A node with `--tensor-parallel-size T` is T processes: rank 0 is the engine core (it schedules,
samples and talks to the front) and starts T−1 worker processes (pdserve/ranks/tp_worker.py) that it
owns. All T join one gloo process group (127.0.0.1, a port rank 0 picks) for the all-reduces of
the forward (pdserve/engine/parallel.py). Each rank is pinned to its own share of the node's cores
(`--cpus`, else the cores this process may use), split contiguously, and runs one torch thread
per core unless `--num-threads` says otherwise (per rank).

    TPGroup.start()      spawn the workers, join the group       (before rank 0 loads its slice)
    group.start_ranks()  caches sized, step buffer mapped, each worker's KV descriptor back
                         (start_engine: the three steps above, around rank 0's EngineCore)
    group.fanout(batch, copies)   every step: the batch into shared memory, a `Step` message to each
                         worker with the step's block copies (copy-on-write and swaps, one ordered list)
    group.links()        each worker rank's KV transport, as a `RankLink` for pdserve/ranks/kv_ranks.py
                         (pdserve/ranks/worker_link.py: the pipe to one worker, its events, `WorkerDied`)
    group.check_alive()  every loop iteration: a worker that died takes the node down at once
    group.close()        stop, then terminate, the workers

A worker that dies makes rank 0's next collective fail (gloo sees the closed socket) and
`check_alive` raise, so the engine core exits and its node with it: the router resumes the
node's requests elsewhere and the launcher restarts the node. A rank 0 that dies closes the
workers' pipes, and they exit; each also stops when its parent is no longer rank 0.

Must never: send a step to some workers and not others, or leave a worker running without rank 0.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_copies import BlockCopy
from pdserve.engine.config import EngineConfig
from pdserve.engine.policy import SchedulingPolicy
from pdserve.engine.model_runner import PackedBatch
from pdserve.engine.parallel import TPShard
from pdserve.kv_transfer import KVTransferConfig
from pdserve.common.affinity import available_cpus, pin_to_cpus, split_cpus
from pdserve.ranks.tp_wire import Start, Step, StepBuffer, StepLimits
from pdserve.ranks.worker_link import COLLECTIVE_TIMEOUT_S, WorkerLink

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 300.0  # a worker loads its slice of the model meanwhile
STOP_GRACE_S = 5.0  # all workers together, after `stop`, before they are killed


def start_engine(engine: EngineConfig, policy: SchedulingPolicy | None = None, transfer: KVTransferConfig | None = None,
                 cpus: tuple[int, ...] | None = None, log_prefix: str = "engine") -> tuple[EngineCore, TPGroup | None]:
    """An engine core on `engine.tensor_parallel_size` ranks: with more than one, this process is
    rank 0 and the workers are started (and ready) before it returns; the caller closes the group.
    `transfer`: the node moves KV, so every worker starts a KV transport of its own."""
    from pdserve.engine.engine_core import EngineCore
    from pdserve.engine.model_loader import check_tensor_parallel, load_model

    engine = engine.resolved()
    if engine.tensor_parallel_size == 1:
        return EngineCore(engine, policy), None
    check_tensor_parallel(engine.model, engine.model_impl, engine.tensor_parallel_size)  # before any rank starts
    group, engine = TPGroup.start(engine, transfer, cpus, log_prefix)
    try:
        loaded = load_model(engine.model, engine.torch_dtype, engine.model_impl, group.shard)
        core = EngineCore(engine, policy, loaded, group.fanout)
        group.start_ranks(core.num_blocks, StepLimits.of(engine.max_num_batched_tokens, engine.max_num_seqs,
                                                          core.max_model_len, engine.block_size),
                          core.swap.num_blocks)
        core.finish_start()  # its profiling steps run on every rank
    except BaseException:
        group.close()
        raise
    return core, group


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is started with (multiprocessing hands it over at spawn)."""

    engine: EngineConfig  # resolved: every rank computes in rank 0's dtype
    transfer: KVTransferConfig | None  # None: the node moves no KV
    rank: int
    size: int
    group_port: int
    cpus: tuple[int, ...] | None
    parent_pid: int
    commands: Connection
    events: Connection
    log_prefix: str


def rank_cpus(cpus: tuple[int, ...] | None, size: int) -> list[tuple[int, ...] | None]:
    """Each rank's cores: the node's (or, unpinned, this process's) split contiguously; None for
    every rank when there are fewer cores than ranks (then nobody is pinned)."""
    pool = sorted(cpus) if cpus else sorted(available_cpus())
    if len(pool) < size:
        return [None] * size
    return list(split_cpus(pool, size, "--cpus"))


def _threads_per_rank(shares: list[tuple[int, ...] | None], size: int) -> int | None:
    """Unpinned ranks (fewer cores than ranks) share the cores: their threads split them too."""
    if shares[0] is not None:
        return None
    return max(1, len(available_cpus()) // size)


def rank_engine_config(engine: EngineConfig, cpus: tuple[int, ...] | None, threads: int | None = None) -> EngineConfig:
    """A rank's engine config: one torch thread per core of its share (or `threads`) unless set."""
    if engine.num_threads is not None:
        return engine
    if cpus is None:
        return engine if threads is None else replace(engine, num_threads=threads)
    return replace(engine, num_threads=len(cpus))


class TPGroup:
    def __init__(self, size: int, workers: list[multiprocessing.Process], links: list[WorkerLink]) -> None:
        self.size = size
        self._workers = workers
        self._links = links
        self._buffer: StepBuffer | None = None
        # Rank 0 is the caller's own process (an `LLM` user's script): what it had, for close().
        self._caller_cpus = os.sched_getaffinity(0)
        self._caller_threads = torch.get_num_threads()

    @classmethod
    def start(cls, engine: EngineConfig, transfer: KVTransferConfig | None, cpus: tuple[int, ...] | None,
              log_prefix: str) -> tuple[TPGroup, EngineConfig]:
        """Spawn ranks 1..T−1, pin this process (rank 0) to its share, join the group; rank 0's
        engine config back (its thread count). `engine` must be resolved."""
        size = engine.tensor_parallel_size
        shares = rank_cpus(cpus, size)
        threads = _threads_per_rank(shares, size)
        # The rendezvous store listens before any worker starts: its port is this process's
        # from the first moment, so no other process can take it in between.
        store = torch.distributed.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        context = multiprocessing.get_context("spawn")
        # A node's engine core is a daemonic child of its front (it must not outlive it), and
        # multiprocessing refuses children to daemonic processes. Rank 0 owns its workers and
        # stops them itself (close(), and they exit when it dies), so it may have them.
        multiprocessing.current_process().daemon = False
        from pdserve.ranks.tp_worker import worker_main  # the spawned side's entry point

        group = cls(size, [], [])
        try:
            for rank in range(1, size):
                commands_r, commands_w = context.Pipe(duplex=False)
                events_r, events_w = context.Pipe(duplex=False)
                spec = WorkerSpec(rank_engine_config(engine, shares[rank], threads), transfer, rank, size,
                                  store.port, shares[rank], os.getpid(), commands_r, events_w, log_prefix)
                process = context.Process(target=worker_main, args=(spec,), name=f"pdserve-rank-{rank}",
                                          daemon=True)
                process.start()
                commands_r.close()
                events_w.close()
                group._workers.append(process)
                link = WorkerLink(rank, process, commands_w, events_r)
                if transfer is not None:  # a connect waits out the worker's own transport budget first
                    link.connect_timeout_s += transfer.connect_budget_s()
                group._links.append(link)
            pin_to_cpus(shares[0])
            group._join(store)
        except BaseException:
            group.close()
            raise
        return group, rank_engine_config(engine, shares[0], threads)

    def _join(self, store: torch.distributed.TCPStore) -> None:
        """Join the process group as rank 0; a worker that dies meanwhile fails this at once
        (rendezvous alone would wait out its whole timeout)."""
        joined: Future[None] = Future()

        def rendezvous() -> None:
            try:
                torch.distributed.init_process_group(
                    "gloo", store=store, rank=0, world_size=self.size,
                    timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
                joined.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                joined.set_exception(exc)

        threading.Thread(target=rendezvous, name="pdserve-tp-rendezvous", daemon=True).start()
        while True:
            try:
                return joined.result(timeout=0.1)
            except TimeoutError:
                self.check_alive()

    @property
    def shard(self) -> TPShard:
        return TPShard(0, self.size)

    def start_ranks(self, num_blocks: int, limits: StepLimits, num_swap_blocks: int = 0) -> None:
        """Every worker sizes its caches to `num_blocks` and its swap space to `num_swap_blocks`, maps
        the step buffer and (with a KV transport) registers its caches; returns once all are ready.
        Raises WorkerDied (pdserve/ranks/worker_link.py)."""
        self._buffer = StepBuffer.create(limits)
        try:
            for link in self._links:
                link.send(Start(num_blocks, num_swap_blocks, self._buffer.path, limits.nbytes))
            for link in self._links:
                link.wait_ready(WORKER_START_TIMEOUT_S)
        finally:
            self._buffer.unlink()  # mapped by every rank now (or the start failed): no file left behind

    def fanout(self, batch: PackedBatch | None, copies: list[BlockCopy]) -> None:
        """The step to every worker, one message each: its block copies, which the worker makes
        first, and its batch (None: a step that only copies); rank 0 then runs its own share."""
        assert self._buffer is not None, "start_ranks() first"
        msg = Step(None if batch is None else self._buffer.write(batch), copies)
        for link in self._links:
            link.send(msg)

    def links(self) -> list[WorkerLink]:
        return list(self._links)

    def check_alive(self) -> None:
        for link in self._links:
            link.check_alive()

    def close(self) -> None:
        """Ask every worker to stop, give them one shared grace period, then kill what is left;
        this process gets back the cores and torch threads it had before `start`."""
        for link in self._links:
            link.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self._workers:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._workers:
            if process.is_alive():
                process.kill()
                process.join(timeout=STOP_GRACE_S)
        if self._buffer is not None:
            self._buffer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.sched_setaffinity(0, self._caller_cpus)
        torch.set_num_threads(self._caller_threads)
