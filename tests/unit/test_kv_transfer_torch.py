"""The torch.distributed KV transport, both ends in this process over gloo on 127.0.0.1.

Each transport makes its own two-rank groups (no default group), so a sender and a receiver
live side by side here; what a decode node relies on is checked: exact bytes in exactly the
named blocks, the done message after them, the counters, the write permits, refusals of a
mismatched or unauthenticated peer naming what differs, and a closed peer failing the push.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kv_transfer import (FingerprintMismatch, KVCacheSpec, KVTransferConfig, KVTransferError,
                                 TorchTransport, TransferState, WritePermits, make_transport)
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
