"""What a network transport (ucx.py, torch_dist.py) keeps for the node that owns it: the
counters of what it sent and of what it received and placed, the completion messages not yet
polled (and the callback that also gets each), and the incoming connections it refused.

The transport's I/O threads write it, the node's thread reads it: one lock, a leaf (taken
last, held for no call out). `LedgerReads` answers `KVTransport`'s methods of the same names
from a transport's `ledger`.
"""

from __future__ import annotations

import threading

from .base import DoneCallback, FingerprintMismatch
from .counters import TransferStats


class DoneQueue:
    """Completion messages not yet polled, each also handed to the callback when one is set
    (called outside the lock). Its own lock, a leaf."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: list[tuple[str, bytes]] = []
        self._callback: DoneCallback | None = None

    def deliver(self, req_id: str, payload: bytes) -> None:
        with self._lock:
            self._done.append((req_id, payload))
            callback = self._callback
        if callback is not None:
            callback(req_id, payload)

    def poll(self) -> list[tuple[str, bytes]]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def set_callback(self, callback: DoneCallback | None) -> None:
        with self._lock:
            self._callback = callback


class TransferLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = TransferStats()
        self._received = TransferStats()
        self.dones = DoneQueue()
        self._refusals: list[FingerprintMismatch] = []

    def count_sent(self, ok: bool, nbytes: int, num_blocks: int, latency_s: float) -> None:
        """A push ended: its bytes, blocks and push-to-ack time when it succeeded."""
        with self._lock:
            _count(self._sent, ok, nbytes, num_blocks, latency_s)

    def count_received(self, ok: bool, nbytes: int, num_blocks: int, latency_s: float) -> None:
        with self._lock:
            _count(self._received, ok, nbytes, num_blocks, latency_s)

    def count_checksum_failure(self) -> None:
        with self._lock:
            self._received.record_checksum_failure()

    def refused(self, mismatch: FingerprintMismatch) -> None:
        with self._lock:
            self._refusals.append(mismatch)

    def sent(self) -> TransferStats:
        with self._lock:
            return self._sent.snapshot()

    def received(self) -> TransferStats:
        with self._lock:
            return self._received.snapshot()

    def refusals(self) -> list[FingerprintMismatch]:
        with self._lock:
            return list(self._refusals)


def _count(stats: TransferStats, ok: bool, nbytes: int, num_blocks: int, latency_s: float) -> None:
    if ok:
        stats.record_success(nbytes, num_blocks, latency_s)
    else:
        stats.record_failure()


class LedgerReads:
    """`KVTransport`'s bookkeeping methods, answered from the transport's `ledger` (list this
    class before `KVTransport` among the bases)."""

    ledger: TransferLedger

    def poll_done(self) -> list[tuple[str, bytes]]:
        return self.ledger.dones.poll()

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        self.ledger.dones.set_callback(callback)

    def stats(self) -> TransferStats:
        return self.ledger.sent()

    def recv_stats(self) -> TransferStats:
        return self.ledger.received()

    def handshake_refusals(self) -> list[FingerprintMismatch]:
        return self.ledger.refusals()
