"""The torch.distributed KV transport, both ends in this process over gloo on 127.0.0.1.

Each transport makes its own two-rank groups (no default group), so a sender and a receiver
live side by side here; what a decode node relies on is checked: exact bytes in exactly the
named blocks, the done message after them, the counters, the write permits, refusals of a
mismatched or unauthenticated peer naming what differs, a closed peer failing the push, a
corrupted push refused by its checksum, and a peer that never comes failing the connect within
rendezvous_timeout_s instead of hanging it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from pdserve.kv_transfer import (FingerprintMismatch, KVCacheSpec, KVTransferConfig, KVTransferError,
                                 TorchTransport, TransferState, WritePermits, make_transport)
from pdserve.kv_transfer.integrity import INTEGRITY_REFUSAL
from pdserve.kv_transfer.ucx import UcxTransport

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 4
WAIT_S = 30.0


def spec(**overrides) -> KVCacheSpec:
    return KVCacheSpec(**{**dict(model="tiny", dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS,
                                 head_dim=HEAD_DIM, block_size=BLOCK), **overrides})


def caches(num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, HEADS, BLOCK, HEAD_DIM)
    return ([torch.randn(shape, generator=gen) for _ in range(LAYERS)],
            [torch.randn(shape, generator=gen) for _ in range(LAYERS)])


def transport(kv, cache_spec: KVCacheSpec | None = None, **config) -> TorchTransport:
    t = TorchTransport(KVTransferConfig(transport="torch", transfer_timeout_s=10.0, **config))
    t.register(*kv, cache_spec or spec())
    return t


@pytest.fixture
def pair():
    src, dst = caches(8, seed=1), caches(8, seed=2)
    sender, receiver = transport(src), transport(dst)
    yield sender, receiver, src, dst
    sender.close()
    receiver.close()


def test_make_transport_picks_the_configured_one():
    assert isinstance(make_transport(KVTransferConfig(transport="torch")), TorchTransport)
    assert isinstance(make_transport(KVTransferConfig()), UcxTransport)


def test_the_descriptor_names_the_transport(pair):
    sender, receiver, _, _ = pair
    assert receiver.descriptor().transport == "torch"


def test_a_push_lands_exactly_in_the_named_blocks_then_its_done_message(pair):
    sender, receiver, src, dst = pair
    before = [t.clone() for t in (*dst[0], *dst[1])]
    peer = sender.connect(receiver.descriptor())
    handle = sender.push("r1", [0, 3, 5], [6, 1, 2], peer=peer)
    done = sender.send_done("r1", b"payload", peer=peer)
    assert handle.wait(WAIT_S) is TransferState.SUCCESS
    assert done.wait(WAIT_S) is TransferState.SUCCESS
    assert receiver.poll_done() == [("r1", b"payload")]
    for layer in range(LAYERS):
        for side, (s, d) in enumerate(((src[0], dst[0]), (src[1], dst[1]))):
            assert torch.equal(d[layer][[6, 1, 2]], s[layer][[0, 3, 5]])
            untouched = [b for b in range(8) if b not in (6, 1, 2)]
            assert torch.equal(d[layer][untouched], before[side * LAYERS + layer][untouched])
    nbytes = 2 * LAYERS * 3 * HEADS * BLOCK * HEAD_DIM * 4
    assert (sender.stats().bytes, sender.stats().transfers) == (nbytes, 1)
    assert (receiver.recv_stats().bytes, receiver.recv_stats().blocks) == (nbytes, 3)


def test_a_push_without_a_permit_is_acknowledged_but_placed_nowhere(pair):
    sender, receiver, src, dst = pair
    permits = WritePermits()
    receiver.guard_writes(permits)
    before = dst[0][0].clone()
    peer = sender.connect(receiver.descriptor())
    assert sender.push("gone", [0], [4], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
    assert torch.equal(dst[0][0], before)
    assert receiver.recv_stats().transfers == 0
    permits.grant("kept", [4])
    assert sender.push("kept", [0], [4], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
    assert torch.equal(dst[0][0][4], src[0][0][0])


def test_a_mismatched_peer_is_refused_on_both_sides_naming_the_field():
    sender, receiver = transport(caches(8, 1), spec(model="other")), transport(caches(8, 2))
    try:
        with pytest.raises(FingerprintMismatch, match="model: local='other' remote='tiny'"):
            sender.connect(receiver.descriptor())
        assert [list(e.diffs) for e in receiver.handshake_refusals()] == [["model"]]
    finally:
        sender.close()
        receiver.close()


def test_a_decode_layout_on_the_other_transport_is_refused_naming_it(pair):
    sender, receiver, _, _ = pair
    ucx_layout = dataclasses.replace(receiver.descriptor(), transport="ucx")
    with pytest.raises(FingerprintMismatch, match=r"transport: local='torch' remote='ucx'.*--kv-transport"):
        sender.connect(ucx_layout)


def test_a_wrong_auth_token_is_refused():
    sender = transport(caches(8, 1), auth_token="wrong")
    receiver = transport(caches(8, 2), auth_token="right")
    try:
        with pytest.raises(KVTransferError, match="refused the connection: authentication failed"):
            sender.connect(receiver.descriptor())
    finally:
        sender.close()
        receiver.close()


def test_a_closed_receiver_fails_the_push_and_later_ones_at_once(pair):
    sender, receiver, _, _ = pair
    peer = sender.connect(receiver.descriptor())
    assert sender.push("a", [0], [1], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
    receiver.close()
    failed = sender.push("b", [0], [2], peer=peer)
    assert failed.wait(WAIT_S) is TransferState.FAILED
    assert sender.push("c", [0], [3], peer=peer).wait(WAIT_S) is TransferState.FAILED
    assert sender.stats().failures == 2


def test_a_push_corrupted_after_sealing_is_refused_counted_and_its_request_never_admitted():
    src, dst = caches(8, seed=1), caches(8, seed=2)
    source_before = [t.clone() for t in src[0]]
    target_before = [t.clone() for t in dst[0]]
    sender, receiver = transport(src, debug_corrupt_push=1), transport(dst)
    try:
        peer = sender.connect(receiver.descriptor())
        refused = sender.push("bad", [0, 1], [2, 3], peer=peer)
        assert refused.wait(WAIT_S) is TransferState.FAILED
        assert "KV checksum mismatch in data message 0 of 1 of 'bad'" in refused.error
        assert sender.send_done("bad", b"payload", peer=peer).wait(WAIT_S) is TransferState.SUCCESS
        assert receiver.poll_done() == [("bad", INTEGRITY_REFUSAL)]
        assert all(torch.equal(d, b) for d, b in zip(dst[0], target_before))  # nothing was placed
        assert all(torch.equal(s, b) for s, b in zip(src[0], source_before))  # only the staging copy flipped
        assert sender.push("good", [0, 1], [2, 3], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
        assert torch.equal(dst[0][0][[2, 3]], src[0][0][[0, 1]])
        stats = receiver.recv_stats()
        assert (stats.checksum_failures, stats.failures, stats.transfers) == (1, 1, 1)
        assert (sender.stats().failures, sender.stats().transfers) == (1, 1)
    finally:
        sender.close()
        receiver.close()


def test_a_receiver_without_checksums_takes_unsealed_pushes():
    src, dst = caches(8, seed=1), caches(8, seed=2)
    sender, receiver = transport(src, debug_corrupt_push=1), transport(dst, checksums=False)
    try:
        peer = sender.connect(receiver.descriptor())
        assert sender.push("r", [4], [5], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
        assert torch.equal(dst[1][1][5], src[1][1][4])  # not sealed, so the drill had nothing to flip
        assert receiver.recv_stats().checksum_failures == 0
    finally:
        sender.close()
        receiver.close()


def test_a_peer_that_never_joins_its_pair_fails_the_connect_naming_the_bound(monkeypatch):
    sender = transport(caches(8, 1), rendezvous_timeout_s=1.0)
    receiver = transport(caches(8, 2))
    monkeypatch.setattr(receiver, "_serve_pair", lambda *args: None)  # it answers the HELLO, then is gone
    try:
        with pytest.raises(KVTransferError, match=r"did not join pair 1 within 1s \(rendezvous_timeout_s\)"):
            sender.connect(receiver.descriptor())
        assert sender.peers() == []
    finally:
        sender.close()
        receiver.close()


def test_a_store_nobody_answers_fails_the_handshake_within_the_bound():
    silent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sender = transport(caches(8, 1), rendezvous_timeout_s=1.0)
    try:
        layout = dataclasses.replace(sender.descriptor(), port=silent.port)
        with pytest.raises(KVTransferError, match=r"did not answer the handshake within 1s"):
            sender.connect(layout)
    finally:
        sender.close()


def test_a_connector_gone_after_its_hello_holds_up_no_later_one(monkeypatch):
    src, dst = caches(8, seed=1), caches(8, seed=2)
    gone, sender = transport(caches(8, 3)), transport(src)
    receiver = transport(dst, rendezvous_timeout_s=1.0)

    def die(*args):
        raise KVTransferError("gone")

    monkeypatch.setattr(gone, "_join", die)  # its HELLO was answered, then it never joins
    try:
        with pytest.raises(KVTransferError, match="gone"):
            gone.connect(receiver.descriptor())
        peer = sender.connect(receiver.descriptor())
        assert sender.push("r", [0], [1], peer=peer).wait(WAIT_S) is TransferState.SUCCESS
        assert torch.equal(dst[0][0][1], src[0][0][0])
    finally:
        gone.close()
        sender.close()
        receiver.close()


def test_a_kv_port_in_use_is_refused_naming_the_flags(pair):
    _, receiver, _, _ = pair
    taken = receiver.descriptor().port
    with pytest.raises(KVTransferError, match=rf"cannot listen on 127.0.0.1:{taken} \(--kv-host, --kv-port\)"):
        transport(caches(8, 3), port=taken)
