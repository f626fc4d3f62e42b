"""One outbound torch.distributed pair: this rank pushing KV into one peer's reserved blocks.

A job's life on the connection (its own sender thread):

    enqueue ─▶ sender thread: gather the plan's blocks into the staging buffer (on the caches'
               device), digest it when the receiver asked for checksums ─▶ DATA header (the
               store) ─▶ the staging bytes (the data group) ─▶ SEAL (the store, when sealing)
               ─▶ ACK(seq) (the store) within transfer_timeout_s ─▶ SUCCESS | FAILED

Jobs go out strictly in order, one at a time, so a DONE queued after a request's pushes
reaches the receiver after their bytes. Any error, or a job overdue past transfer_timeout_s
(`check_deadlines`, the transport's watchdog), breaks the connection: every queued job and the
one in flight fail, the pair is aborted, and later jobs fail at once.

Must never: reuse the staging buffer before its send returned, or leave a handle non-terminal
after the connection broke.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Sequence

import torch

from .base import KVCacheSpec, KVDescriptor
from .config import KVTransferConfig
from .integrity import Sealer, encode_digests
from .layout import gather, staging_shape, typed_view
from .torch_pair import PairGroup
from .ucx_conn import Finisher, Job, data_header
from .wire import STATUS_OK, ControlMsg, MsgKind

logger = logging.getLogger(__name__)


class TorchConnection:
    def __init__(self, peer_id: str, remote: KVDescriptor, pair: PairGroup, config: KVTransferConfig,
                 local: KVCacheSpec, caches: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
                 finish: Finisher, sealer: Sealer | None) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self._pair = pair
        self._config = config
        self._spec = local
        self._k, self._v = caches
        self._finish = finish
        self._sealer = sealer  # None: the receiver asked for no checksums
        self._seq = itertools.count(1)
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._in_flight: Job | None = None
        self._staging = torch.empty(0, dtype=torch.uint8, device=pair.device)
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer_id}", daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def enqueue(self, job: Job) -> None:
        with self._cond:
            if self.error is None:
                self._queue.append(job)
                self._cond.notify()
                return
            error = self.error
        self._finish(job, error)

    # -- sending (sender thread) -------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and self.error is None:
                    self._cond.wait()
                if self.error is not None:
                    return
                job = self._in_flight = self._queue.popleft()
            if job.handle.done:
                continue
            try:
                error = self._send_job(job)
            except Exception as exc:  # the pair broke (peer gone, aborted, timed out)
                self.break_(f"sending to {self.peer_id} failed: {exc!r}")
                return
            with self._cond:
                self._in_flight = None
            self._finish(job, error)

    def _send_job(self, job: Job) -> str | None:
        """Send one job and wait for its ack; the ack's error text, or None."""
        job.seq = next(self._seq)
        job.handle._start()
        if job.plan is None:
            self._pair.send_ctrl(job.seq, ControlMsg(MsgKind.DONE, seq=job.seq, req_id=job.handle.req_id,
                                                     extra=job.payload))
        else:
            self._send_push(job)
        ack = self._pair.recv_ctrl(job.seq, self._config.transfer_timeout_s, ack=True)
        if ack is None or ack.kind is not MsgKind.ACK or ack.seq != job.seq:
            raise RuntimeError(f"expected ACK({job.seq}), got {ack}")
        if ack.status == STATUS_OK:
            return None
        return f"peer {self.peer_id} rejected {job.handle.req_id!r}: {ack.extra.decode(errors='replace')}"

    def _send_push(self, job: Job) -> None:
        nbytes = job.handle.nbytes
        raw = self._staging_for(nbytes)
        gather(job.plan, self._k, self._v, typed_view(raw, staging_shape(job.plan, self._spec), self._spec.torch_dtype))
        wire = raw[:nbytes]
        seal = None
        if self._sealer is not None:  # digested before it leaves: the drill flips it after
            seal = encode_digests([self._sealer.seal_push(wire)])
        # One data message per push: chunk_layers covers every layer.
        self._pair.send_ctrl(job.seq, data_header(job, 0, len(job.plan.layers)))
        self._pair.send_data(wire, self._config.transfer_timeout_s)
        if seal is not None:
            self._pair.send_seal(job.seq, seal)

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """The reusable flat staging buffer, grown (never shrunk) to `nbytes`."""
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self._pair.device)
        return self._staging

    # -- failure -----------------------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        timeout = self._config.transfer_timeout_s
        with self._cond:
            jobs = [*([self._in_flight] if self._in_flight is not None else []), *self._queue]
        for job in jobs:
            if now - job.handle.created_at > timeout:
                self.break_(f"transfer of {job.handle.req_id!r} to {self.peer_id} timed out after {timeout:.1f}s")
                return

    def break_(self, reason: str, expected: bool = False) -> None:
        """Fail everything on this connection and abort the pair (idempotent)."""
        with self._cond:
            if self.error is not None:
                return
            self.error = reason
            jobs = [*([self._in_flight] if self._in_flight is not None else []), *self._queue]
            self._in_flight = None
            self._queue.clear()
            self._cond.notify_all()
        logger.log(logging.INFO if expected else logging.WARNING, "KV connection to %s ended: %s",
                   self.peer_id, reason)
        for job in jobs:
            self._finish(job, reason)
        self._pair.abort()

    def close(self, reason: str) -> None:
        self.break_(reason, expected=True)
