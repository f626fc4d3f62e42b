"""The front's side of the front ↔ core pair: spawn the core, talk to it over ZMQ IPC.

Owns the core process (start, watch, stop), the two IPC sockets (a temp dir holds
their paths), and the routing of core messages: each request's messages go to the
inbox its RPC opened with `open_stream` (inbox.py: `Tokens` that wait there leave as one);
stats replies resolve the future of their query. `send` never waits (the core drains its inbox every loop iteration), so an
RPC's `finally` can send an `Abort` even while it is being cancelled.

Every snapshot the core sends (pushed unasked, or a reply) becomes `latest_stats()`:
the heartbeat sends it without asking the core, and `stats()` answers it when a core
busy in a long step does not reply in time.

If the core dies, every open stream gets a `RequestFailed(INTERNAL)` and `dead` is set;
the server then shuts the node down. A core that refuses its configuration at start (a model
folder the engine cannot serve) makes `start` raise `Refused` with the core's one line.

Must never: run model code, or leave the core process or the socket folder behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import time
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio

from pdserve.common.refusal import Refused
from pdserve.node.config import NodeConfig
from pdserve.node.core.spawn import CoreAddresses, start_core
from pdserve.node.core.core_part import CorePart
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.front.inbox import StreamInbox
from pdserve.node.messages import (Abort, BeamsDone, CoreFailed, CoreStarted, FirstToken, Message, Ready, RequestFailed,
                                   Shutdown, StatsData, StatsPush, StatsQuery, StatsReply, Tokens, decode, encode)

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # how often the front checks that its core process is alive


class CoreClient:
    def __init__(self, config: NodeConfig, part: CorePart) -> None:
        self.config = config
        self.part = part
        self.dead = asyncio.Event()
        self._dir = tempfile.mkdtemp(prefix=f"pdserve-{config.kind}-")
        self._addresses = CoreAddresses.in_dir(self._dir)
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._out = self._sync_ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._in = self._async_ctx.socket(zmq.PULL)
        self._process: BaseProcess | None = None
        self._streams: dict[str, StreamInbox] = {}
        self._stats: dict[int, asyncio.Future[StatsData]] = {}
        self._latest_stats: StatsData | None = None
        self._query_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.fingerprint: dict[str, object] = {}  # the core's KV fingerprint, once started
        # (id, JSON) of the core's KV layout, once started: what a decode node's GetKVLayout answers.
        self.kv_layout: tuple[str, str] = ("", "")

    async def start(self) -> None:
        """Spawn the core and wait for it to load the model and register its KV cache."""
        self._out.bind(self._addresses.to_core)
        self._in.bind(self._addresses.from_core)
        self._process = start_core(self.config, self._addresses, self.part)
        first = await self._first_message()
        if isinstance(first, CoreFailed) and first.refused:
            raise Refused(first.message)
        if isinstance(first, CoreFailed):
            raise NodeError(ErrorCode.INTERNAL, f"engine core failed to start: {first.message}")
        if not isinstance(first, CoreStarted):
            raise NodeError(ErrorCode.INTERNAL, f"engine core said {type(first).__name__} before CoreStarted")
        self.fingerprint = first.fingerprint
        self.kv_layout = (first.kv_layout_id, first.kv_layout)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def _first_message(self) -> Message:
        deadline = time.monotonic() + self.config.core_start_timeout_s
        while time.monotonic() < deadline:
            if await self._in.poll(timeout=200):
                return decode(await self._in.recv())
            if self._process is not None and not self._process.is_alive():
                raise NodeError(ErrorCode.INTERNAL, f"engine core exited with {self._process.exitcode}")
        raise NodeError(ErrorCode.INTERNAL, f"engine core did not start in {self.config.core_start_timeout_s}s")

    # -- requests ----------------------------------------------------------------------
    def open_stream(self, req_id: str, stream_interval: int = 1) -> StreamInbox:
        if self.dead.is_set():
            raise NodeError(ErrorCode.UNAVAILABLE, "the engine core of this node is down")
        if req_id in self._streams:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, f"request_id {req_id!r} is already in flight here")
        inbox = self._streams[req_id] = StreamInbox(stream_interval)
        return inbox

    def close_stream(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def send(self, msg: Message) -> None:
        if self.dead.is_set():
            raise NodeError(ErrorCode.UNAVAILABLE, "the engine core of this node is down")
        self._out.send(encode(msg), zmq.NOBLOCK)

    def abort(self, req_id: str) -> None:
        """The RPC went away before its request ended: tell the core (never raises)."""
        if not self.dead.is_set():
            self._out.send(encode(Abort(req_id)), zmq.NOBLOCK)

    def core_alive(self) -> bool:
        """Whether the core process runs now; safe from any thread. It looks without reaping
        (WNOWAIT), so it never races the watcher for the exit status, and it sees a death
        before the watcher's next look."""
        if self.dead.is_set() or self._process is None or self._process.pid is None:
            return False
        try:
            return os.waitid(os.P_PID, self._process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # already reaped: it has exited
            return False

    def latest_stats(self) -> StatsData | None:
        """The core's most recent snapshot, without asking it (None before the first one)."""
        return self._latest_stats

    @property
    def open_requests(self) -> int:
        """Requests whose RPC is open on this front (a prefill node's ends at token 1)."""
        return len(self._streams)

    async def stats(self) -> StatsData:
        """A fresh snapshot, or the latest one when the core does not answer within stats_timeout_s."""
        fresh = await self.fresh_stats()
        if fresh is not None:
            return fresh
        if self._latest_stats is not None:
            return self._latest_stats  # the core is mid-step; it pushed this one moments before
        raise NodeError(ErrorCode.UNAVAILABLE, "the engine core did not answer a stats query")

    async def fresh_stats(self) -> StatsData | None:
        """The core's answer to a query sent now (so it counts every request sent before it), or
        None when it does not answer within stats_timeout_s."""
        query_id = next(self._query_ids)
        future: asyncio.Future[StatsData] = asyncio.get_running_loop().create_future()
        self._stats[query_id] = future
        try:
            self.send(StatsQuery(query_id))
            return await asyncio.wait_for(future, self.config.stats_timeout_s)
        except TimeoutError:
            return None
        finally:
            self._stats.pop(query_id, None)

    # -- routing -----------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            msg = decode(await self._in.recv())
            if isinstance(msg, StatsPush):
                self._latest_stats = msg.stats
            elif isinstance(msg, StatsReply):
                self._latest_stats = msg.stats
                future = self._stats.get(msg.query_id)
                if future is not None and not future.done():
                    future.set_result(msg.stats)
            elif isinstance(msg, CoreFailed):
                self._die(f"engine core failed: {msg.message}")
                return
            elif isinstance(msg, (Ready, FirstToken, Tokens, BeamsDone, RequestFailed)):
                inbox = self._streams.get(msg.req_id)
                if inbox is not None:  # None: the RPC has already gone away
                    inbox.put(msg)
            else:
                logger.warning("unexpected %s from the engine core", type(msg).__name__)

    async def _watch(self) -> None:
        while self._process is not None and self._process.is_alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        self._die(f"engine core exited with {self._process.exitcode if self._process else None}")

    def _die(self, reason: str) -> None:
        if self.dead.is_set():
            return
        logger.error("%s", reason)
        self.dead.set()
        for req_id, inbox in self._streams.items():
            inbox.put(RequestFailed(req_id, ErrorCode.INTERNAL, reason))
        for future in self._stats.values():
            if not future.done():
                future.set_exception(NodeError(ErrorCode.UNAVAILABLE, reason))

    # -- teardown ----------------------------------------------------------------------
    async def close(self) -> None:
        """Ask the core to stop, then make sure it has: terminate, then kill."""
        for task in self._tasks:
            task.cancel()
        proc = self._process
        if proc is not None and proc.is_alive():
            try:
                self._out.send(encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            await _join(proc, self.config.core_stop_timeout_s)
            if proc.is_alive():
                proc.terminate()
                await _join(proc, self.config.core_stop_timeout_s)
            if proc.is_alive():
                proc.kill()
                await _join(proc, self.config.core_stop_timeout_s)
        self._out.close(linger=0)
        self._in.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


async def _join(proc: BaseProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not proc.is_alive():
        proc.join(0)
