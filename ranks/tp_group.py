"""A tensor-parallel node's ranks, seen from rank 0: it starts them, feeds them, and goes down with them.

A node with `--tensor-parallel-size T` is T processes: rank 0 is the engine core (it schedules,
samples and talks to the front) and starts T−1 worker processes (ranks/tp_worker.py) that it
owns. All T join one gloo process group (127.0.0.1, a port rank 0 picks) for the all-reduces of
the forward (engine/parallel.py). Each rank is pinned to its own share of the node's cores
(`--cpus`, else the cores this process may use), split contiguously, and runs one torch thread
per core unless `--num-threads` says otherwise (per rank).

    TPGroup.start()      spawn the workers, join the group       (before rank 0 loads its slice)
    group.start_ranks()  caches sized, step buffer mapped, each worker's KV descriptor back
                         (start_engine: the three steps above, around rank 0's EngineCore)
    group.fanout(batch, copies)   every step: the batch into shared memory, a `Step` message to each
                         worker with the step's block copies (copy-on-write and swaps, one ordered list)
    group.links()        each worker rank's KV transport, as a `RankLink` for ranks/kv_ranks.py
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
import itertools
import logging
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable
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
from pdserve.kv_transfer import (FingerprintMismatch, KVDescriptor, KVTransferConfig, KVTransferError,
                                 TransferHandle, TransferState, TransferStats, WritePermits)
from pdserve.kv_transfer.base import DoneCallback
from pdserve.common.affinity import available_cpus, pin_to_cpus, split_cpus
from pdserve.ranks.tp_wire import (Command, Connect, Connected, Done, Event, Failed, Grant, Granted, Guard, Handle,
                                   Push, Ready, Revoke, SendDone, Start, Step, StepBuffer, StepLimits, Stop, from_text,
                                   receive_event, send_command, to_text)

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

# A collective waits this long for a silent rank (a frozen worker) before it fails the node.
COLLECTIVE_TIMEOUT_S = 60.0
WORKER_START_TIMEOUT_S = 300.0  # a worker loads its slice of the model meanwhile
REPLY_TIMEOUT_S = 30.0  # a worker's answer to a grant (a connect adds the transport's own budget)
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


class WorkerDied(RuntimeError):
    """A worker rank exited or failed: the node cannot compute any more."""


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
                if transfer is not None:  # a connect waits out the worker's own UCX budget first
                    link.connect_timeout_s += (transfer.connect_timeout_s + transfer.handshake_timeout_s
                                               + transfer.close_timeout_s)
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
        Raises WorkerDied."""
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


class WorkerLink:
    """One worker rank from rank 0: its command pipe (one lock: several threads send) and a
    thread that reads its events. As a `RankLink` (ranks/kv_ranks.py) it forwards the KV
    transport's calls; the handles it returns are finished by the worker's `handle` events."""

    def __init__(self, rank: int, process: multiprocessing.Process, commands: Connection,
                 events: Connection) -> None:
        self.rank = rank
        self._process = process
        self._commands = commands
        self._events = events
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._ready: Future[KVDescriptor | None] = Future()
        self._replies: dict[int, Future[Event]] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._dones: list[tuple[str, bytes]] = []
        self._callback: DoneCallback | None = None
        self._sent = TransferStats()
        self._received = TransferStats()
        self._failure: str | None = None
        self._descriptor: KVDescriptor | None = None
        self.connect_timeout_s = REPLY_TIMEOUT_S  # TPGroup.start sets the transport's own budget
        self._reader = threading.Thread(target=self._read, name=f"pdserve-rank-{rank}-events", daemon=True)
        self._reader.start()

    # -- the pipe -------------------------------------------------------------------
    def send(self, msg: Command) -> None:
        """One command, in order. A worker that reads nothing for a collective's timeout (frozen)
        fails the node as a silent collective would, instead of blocking rank 0 on a full pipe."""
        with self._send_lock:
            try:
                if self._commands.closed:
                    raise OSError("its pipe is closed")
                _, writable, _ = select.select([], [self._commands.fileno()], [], COLLECTIVE_TIMEOUT_S)
                if not writable:
                    raise WorkerDied(f"rank {self.rank} read nothing for {COLLECTIVE_TIMEOUT_S:g}s")
                send_command(self._commands, msg)
            except (OSError, ValueError) as exc:  # the worker is gone
                raise WorkerDied(f"rank {self.rank} is gone: {exc}") from exc

    def _ask(self, ask: Callable[[int], Connect | Grant], timeout_s: float = REPLY_TIMEOUT_S) -> Event:
        """Send `ask(reply_id)`; the worker's answer carrying that reply id."""
        reply_id = next(self._ids)
        future: Future[Event] = Future()
        with self._lock:
            if self._failure is not None:
                raise WorkerDied(self._failure)
            self._replies[reply_id] = future
        try:
            self.send(ask(reply_id))
            return future.result(timeout=timeout_s)
        finally:
            with self._lock:
                self._replies.pop(reply_id, None)

    def _read(self) -> None:
        reason = None
        try:
            while True:
                self._on_event(receive_event(self._events))
        except (EOFError, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 - a broken event fails this rank, never silently
            reason = f"rank {self.rank}: unreadable event: {exc!r}"
        self._fail_everything(reason or self._failure or f"rank {self.rank} exited")

    def _on_event(self, event: Event) -> None:
        if event.sent is not None:
            self._sent = event.sent
        if event.received is not None:
            self._received = event.received
        match event:
            case Ready():
                raw = event.descriptor
                self._ready.set_result(KVDescriptor.from_bytes(raw.encode()) if raw else None)
            case Connected() | Granted():
                with self._lock:
                    future = self._replies.pop(event.reply_id, None)
                if future is not None:
                    future.set_result(event)
            case Handle():
                with self._lock:
                    handle = self._handles.pop(event.handle_id, None)
                if handle is not None:
                    handle._start()
                    handle._finish(event.state, event.error)
            case Done():
                self._on_done((event.req_id, from_text(event.payload)))
            case Failed():
                self._failure = f"rank {self.rank} failed: {event.error}"

    def _on_done(self, done: tuple[str, bytes]) -> None:
        with self._lock:
            self._dones.append(done)
            callback = self._callback
        if callback is not None:
            callback(*done)

    def _fail_everything(self, reason: str) -> None:
        self._failure = reason
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
            replies, self._replies = list(self._replies.values()), {}
        for handle in handles:
            handle._finish(TransferState.FAILED, reason)
        for future in replies:
            future.set_exception(WorkerDied(reason))
        if not self._ready.done():
            self._ready.set_exception(WorkerDied(reason))

    # -- lifetime -------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        self._descriptor = self._ready.result(timeout=timeout)

    def check_alive(self) -> None:
        if self._failure is not None or not self._process.is_alive():
            raise WorkerDied(self._failure or f"rank {self.rank} exited with {self._process.exitcode}")

    def stop(self) -> None:
        try:
            self.send(Stop())
        except WorkerDied:
            pass
        with self._send_lock:
            self._commands.close()

    # -- RankLink -------------------------------------------------------------------
    def descriptor(self) -> KVDescriptor:
        if self._descriptor is None:
            raise KVTransferError(f"rank {self.rank} runs no KV transport")
        return self._descriptor

    def connect(self, remote: KVDescriptor) -> str:
        reply = self._ask(lambda reply_id: Connect(reply_id, remote.to_bytes().decode()), self.connect_timeout_s)
        assert isinstance(reply, Connected)
        if reply.diffs is not None:
            raise FingerprintMismatch({k: tuple(v) for k, v in reply.diffs.items()}, f"rank {self.rank}")
        if reply.error is not None or reply.peer is None:
            raise KVTransferError(f"rank {self.rank}: {reply.error}")
        return reply.peer

    def push(self, req_id: str, src: list[int], dst: list[int], heads: tuple[int, int], peer: str,
             nbytes: int) -> TransferHandle:
        return self._start_handle(TransferHandle(req_id, nbytes, len(dst)),
                                  lambda handle_id: Push(handle_id, req_id, list(src), list(dst), heads, peer))

    def send_done(self, req_id: str, payload: bytes, peer: str) -> TransferHandle:
        return self._start_handle(TransferHandle(req_id),
                                  lambda handle_id: SendDone(handle_id, req_id, to_text(payload), peer))

    def _start_handle(self, handle: TransferHandle, command: Callable[[int], Push | SendDone]) -> TransferHandle:
        handle_id = next(self._ids)
        with self._lock:
            if self._failure is not None:
                handle._finish(TransferState.FAILED, self._failure)
                return handle
            self._handles[handle_id] = handle
        self.send(command(handle_id))
        return handle

    def poll_done(self) -> list[tuple[str, bytes]]:
        with self._lock:
            dones, self._dones = self._dones, []
        return dones

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        with self._lock:
            self._callback = callback

    def follow_permits(self, permits: WritePermits) -> None:
        self.send(Guard())
        permits.follow(self)

    def grant(self, req_id: str, block_ids) -> None:
        """Answered before it returns: the reservation's READY may send a prefill node pushing at once."""
        self._ask(lambda reply_id: Grant(reply_id, req_id, list(block_ids)))

    def revoke(self, req_id: str) -> None:
        """In order with every later step and grant on the worker's pipe, so nothing reuses the
        blocks there before the worker has revoked."""
        self.send(Revoke(req_id))

    def stats(self) -> TransferStats:
        return self._sent.snapshot()

    def recv_stats(self) -> TransferStats:
        return self._received.snapshot()



