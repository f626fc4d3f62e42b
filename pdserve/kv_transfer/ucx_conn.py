"""One outbound UCX connection: this rank pushing KV into one peer's reserved blocks.

A job's life on the connection (all on the UCX loop thread):

    enqueue ─▶ send loop: DATA header (control endpoint) ─▶ per layer chunk: gather
               its blocks into the staging buffer, digest it (when the receiver asked for
               checksums), send it (data endpoint, tagged) ─▶ SEAL (the digests, control
               endpoint) ─▶ pending[seq] ─▶ ack loop: ACK(seq) ─▶ SUCCESS | FAILED

Jobs go out strictly in order, so a DONE queued after a request's pushes reaches the
receiver after their bytes. Any connection-level error, or a job overdue past
transfer_timeout_s, breaks the connection: every pending and queued job fails, both
endpoints are aborted, and later jobs fail at once.

Must never: block the loop on the network, reuse the staging buffer before its send
completed, or leave a handle non-terminal after the connection broke.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .base import KVCacheSpec, KVDescriptor, TransferHandle
from .config import KVTransferConfig
from .integrity import Sealer, encode_digests
from .layout import TransferPlan, gather, layer_chunks, staging_shape, typed_view
from .ucx_runtime import abort_endpoint, as_bytes_array, recv_ctrl, send_ctrl
from .wire import HEADER, STATUS_OK, ControlMsg, MsgKind

logger = logging.getLogger(__name__)

TAG_MASK = (1 << 64) - 1


@dataclass(slots=True, eq=False)
class Job:
    handle: TransferHandle
    plan: TransferPlan | None = None  # None: a done message
    payload: bytes = b""
    seq: int = 0


# (job, error or None) -> None; the transport records stats and finishes the handle.
Finisher = Callable[[Job, str | None], None]


class Connection:
    def __init__(self, peer_id: str, remote: KVDescriptor, ctrl_ep: Any, data_ep: Any,
                 config: KVTransferConfig, local: KVCacheSpec,
                 caches: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                 finish: Finisher, sealer: Sealer | None) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self._ctrl_ep = ctrl_ep
        self._data_ep = data_ep  # None: data rides the control endpoint
        self._config = config
        self._spec = local
        self._k, self._v = caches
        self._finish = finish
        self._sealer = sealer  # None: the receiver asked for no checksums
        self._tag_base = int.from_bytes(os.urandom(8), "little")
        self._seq = itertools.count(1)
        self._queue: deque[Job] = deque()
        self._wakeup = asyncio.Event()
        self._pending: dict[int, Job] = {}
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._tasks: list[asyncio.Task] = []
        self.error: str | None = None

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._send_loop()),
                       asyncio.ensure_future(self._ack_loop())]

    def enqueue(self, job: Job) -> None:
        """Loop thread only (the transport hands jobs over with call_soon_threadsafe)."""
        if self.error is not None:
            self._finish(job, self.error)
            return
        self._queue.append(job)
        self._wakeup.set()

    # -- sending ---------------------------------------------------------------------
    async def _send_loop(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._queue.popleft()
            if job.handle.done:  # failed by the watchdog while queued
                continue
            try:
                await self._send_job(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.break_(f"sending to {self.peer_id} failed: {exc!r}")

    async def _send_job(self, job: Job) -> None:
        job.seq = next(self._seq)
        job.handle._start()
        self._pending[job.seq] = job
        if job.plan is None:
            await send_ctrl(self._ctrl_ep, ControlMsg(MsgKind.DONE, seq=job.seq,
                                                      req_id=job.handle.req_id,
                                                      extra=job.payload))
            return
        plan, nbytes = job.plan, job.handle.nbytes
        raw = self._staging_for(nbytes)
        staging = typed_view(raw, staging_shape(plan, self._spec), self._spec.torch_dtype)
        per_layer = nbytes // len(plan.layers)
        chunk_layers = max(1, self._config.chunk_bytes // per_layer)
        tag = (self._tag_base + (job.seq << 16)) & TAG_MASK
        # Post header, chunks and seal back to back; UCX keeps their order on each endpoint.
        sends = [asyncio.ensure_future(
            send_ctrl(self._ctrl_ep, data_header(job, tag, chunk_layers)))]
        sealer, digests = self._sealer, []
        if sealer is not None:
            sealer.start_push()
        for j, (lo, hi) in enumerate(layer_chunks(len(plan.layers), chunk_layers)):
            # Gather chunk j while the chunks before it are on the wire.
            gather(plan, self._k, self._v, staging, lo, hi)
            chunk = as_bytes_array(raw[lo * per_layer:hi * per_layer])
            if sealer is not None:
                digests.append(sealer.seal(chunk))
            sends.append(asyncio.ensure_future(self._send_data(chunk, (tag + j) & TAG_MASK)))
            await asyncio.sleep(0)  # let the task post its send before the next gather
        if sealer is not None:
            seal = ControlMsg(MsgKind.SEAL, seq=job.seq, req_id=plan.req_id, extra=encode_digests(digests))
            sends.append(asyncio.ensure_future(send_ctrl(self._ctrl_ep, seal)))
        await asyncio.gather(*sends)

    async def _send_data(self, data: np.ndarray, tag: int) -> None:
        if self._data_ep is None:
            await self._ctrl_ep.send(data)
        else:
            await self._data_ep.send(data, tag=tag, force_tag=True)

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """The reusable flat staging buffer, grown (never shrunk) to `nbytes`."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging

    # -- acks ------------------------------------------------------------------------
    async def _ack_loop(self) -> None:
        buf = np.empty(self._config.max_control_bytes, dtype=np.uint8)
        try:
            while True:
                msg = await recv_ctrl(self._ctrl_ep, buf)
                job = self._pending.pop(msg.seq, None)
                if msg.kind is not MsgKind.ACK or job is None:
                    continue  # a late ack of a job the watchdog already failed
                error = None if msg.status == STATUS_OK else (
                    f"peer {self.peer_id} rejected {job.handle.req_id!r}: "
                    f"{msg.extra.decode(errors='replace')}")
                self._finish(job, error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.break_(f"connection to {self.peer_id} lost: {exc!r}")

    # -- failure ---------------------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        timeout = self._config.transfer_timeout_s
        for job in [*self._pending.values(), *self._queue]:
            if now - job.handle.created_at > timeout:
                self.break_(f"transfer of {job.handle.req_id!r} to {self.peer_id} "
                            f"timed out after {timeout:.1f}s")
                return

    async def _say_bye(self) -> None:
        try:
            await asyncio.wait_for(send_ctrl(self._ctrl_ep, ControlMsg(MsgKind.BYE)),
                                   self._config.close_timeout_s)
        except Exception as exc:  # peer already gone: nothing to tell
            logger.debug("BYE to %s not sent: %r", self.peer_id, exc)

    def break_(self, reason: str, expected: bool = False) -> None:
        """Fail everything on this connection and abort its endpoints (idempotent)."""
        if self.error is not None:
            return
        self.error = reason
        logger.log(logging.INFO if expected else logging.WARNING,
                   "KV connection to %s ended: %s", self.peer_id, reason)
        jobs = [*self._pending.values(), *self._queue]
        self._pending.clear()
        self._queue.clear()
        for job in jobs:
            self._finish(job, reason)
        abort_endpoint(self._data_ep, self._config.close_timeout_s)
        abort_endpoint(self._ctrl_ep, self._config.close_timeout_s)

    async def close(self, reason: str) -> None:
        if self.error is None:  # the peer learns of a close only from this side
            await self._say_bye()
        self.break_(reason, expected=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def data_header(job: Job, tag: int, chunk_layers: int) -> ControlMsg:
    plan = job.plan
    assert plan is not None
    return ControlMsg(MsgKind.DATA, seq=job.seq, req_id=plan.req_id, data_tag=tag,
                      data_nbytes=job.handle.nbytes, head_range=plan.overlap.heads,
                      block_ids=plan.dst_block_ids, layers=plan.layers,
                      chunk_layers=chunk_layers)


def header_nbytes(req_id: str, num_blocks: int, num_layers: int, extra: int = 0) -> int:
    """Size of a control message, to refuse one larger than max_control_bytes up front."""
    return HEADER.size + len(req_id.encode()) + 4 * (num_blocks + num_layers) + extra
