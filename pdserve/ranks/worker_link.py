"""One worker rank as rank 0 sees it: the ordered command pipe to it, the events back, and its KV
transport as a `RankLink` (pdserve/ranks/kv_ranks.py).

A `WorkerLink` sends typed commands (pdserve/ranks/tp_wire.py) under one lock, since the step loop and the
KV stages' threads all send, and a thread of its own reads the worker's events: a `Handle`
finishes the `TransferHandle` rank 0 handed out, a `Connected` or `Granted` answers the call that
waits for it, a `Done` reaches the done callback, and `Failed` or a closed pipe fails everything
still waiting with `WorkerDied`.

Must never: let a frozen worker block rank 0 for longer than a collective would, or reorder two
commands.
"""

from __future__ import annotations

import itertools
import multiprocessing
import select
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection

from pdserve.kv_transfer import (FingerprintMismatch, KVDescriptor, KVTransferError, TransferHandle, TransferState,
                                 TransferStats, WritePermits)
from pdserve.kv_transfer.base import DoneCallback
from pdserve.kv_transfer.ledger import DoneQueue
from pdserve.ranks.tp_wire import (Command, Connect, Connected, Done, Event, Failed, Grant, Granted, Guard, Handle,
                                   Push, Ready, Revoke, SendDone, Stop, from_text, receive_event, send_command, to_text)

# A collective waits this long for a silent rank (a frozen worker) before it fails the node.
COLLECTIVE_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 30.0  # a worker's answer to a grant (a connect adds the transport's own budget)


class WorkerDied(RuntimeError):
    """A worker rank exited or failed: the node cannot compute any more."""


class WorkerLink:
    """One worker rank from rank 0: its command pipe (one lock: several threads send) and a
    thread that reads its events. As a `RankLink` (pdserve/ranks/kv_ranks.py) it forwards the KV
    transport's calls; the handles it returns are finished by the worker's `Handle` events."""

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
        self._dones = DoneQueue()
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
                self._dones.deliver(event.req_id, from_text(event.payload))
            case Failed():
                self._failure = f"rank {self.rank} failed: {event.error}"

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
        return self._dones.poll()

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        self._dones.set_callback(callback)

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
