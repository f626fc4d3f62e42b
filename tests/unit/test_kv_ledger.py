"""A network transport's bookkeeping (pdserve/kv_transfer/ledger.py): counters, completion messages
polled once each and handed to the callback too, refusals; and the `KVTransport` methods a
transport answers from it."""

from __future__ import annotations

from pdserve.kv_transfer.base import FingerprintMismatch
from pdserve.kv_transfer.counters import TransferStats
from pdserve.kv_transfer.ledger import LedgerReads, TransferLedger


class Reads(LedgerReads):
    def __init__(self) -> None:
        self.ledger = TransferLedger()


def test_pushes_sent_and_received_are_counted_apart():
    transport = Reads()
    transport.ledger.count_sent(True, 4096, 2, 0.5)
    transport.ledger.count_sent(False, 4096, 2, 9.0)
    transport.ledger.count_received(True, 1024, 1, 0.25)
    transport.ledger.count_checksum_failure()
    assert transport.stats() == TransferStats(bytes=4096, blocks=2, transfers=1, failures=1, latency_s=0.5)
    assert transport.recv_stats() == TransferStats(bytes=1024, blocks=1, transfers=1, latency_s=0.25,
                                                   checksum_failures=1)


def test_each_done_message_is_polled_once_and_handed_to_the_callback_set_then():
    transport, called = Reads(), []
    transport.ledger.dones.deliver("a", b"1")
    transport.set_done_callback(lambda req_id, payload: called.append((req_id, payload)))
    transport.ledger.dones.deliver("b", b"2")
    assert transport.poll_done() == [("a", b"1"), ("b", b"2")]
    assert transport.poll_done() == []
    assert called == [("b", b"2")]


def test_refusals_are_kept_in_order():
    transport = Reads()
    first, second = FingerprintMismatch({"model": ("m", "n")}, "p0"), FingerprintMismatch({"dtype": ("a", "b")}, "p1")
    transport.ledger.refused(first)
    transport.ledger.refused(second)
    assert transport.handshake_refusals() == [first, second]
