"""KV transfer state machines, planning and counters, on the in-process transport."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.kv_transfer import (FingerprintMismatch, HeadOverlap, InProcessFabric,
                                 InProcessTransport, KVCacheSpec, KVDescriptor,
                                 KVTransferConfig, KVTransferError, TransferState,
                                 plan_head_overlap)
from pdserve.kv_transfer.wire import ControlMsg, MsgKind, WireError

LAYERS, HEADS, BLOCK, HEAD_DIM = 3, 4, 4, 8


def make_spec(dtype: str = "float32", heads: tuple[int, int] | None = None,
              **overrides: object) -> KVCacheSpec:
    fields = dict(model="tiny", dtype=dtype, num_layers=LAYERS, num_kv_heads=HEADS,
                  head_dim=HEAD_DIM, block_size=BLOCK, head_range=heads)
    fields.update(overrides)
    return KVCacheSpec(**fields)


def make_caches(spec: KVCacheSpec, num_blocks: int, seed: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    h0, h1 = spec.local_heads
    shape = (num_blocks, h1 - h0, spec.block_size, spec.head_dim)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(spec.torch_dtype)

    return [one() for _ in range(spec.num_layers)], [one() for _ in range(spec.num_layers)]


class Pair:
    """A prefill-side sender and a decode-side receiver on one fabric."""

    def __init__(self, src_spec: KVCacheSpec, dst_spec: KVCacheSpec,
                 src_blocks: int = 8, dst_blocks: int = 12) -> None:
        self.fabric = InProcessFabric()
        self.src = InProcessTransport("prefill-0", self.fabric)
        self.dst = InProcessTransport("decode-0", self.fabric)
        self.src_k, self.src_v = make_caches(src_spec, src_blocks, seed=1)
        self.dst_k, self.dst_v = make_caches(dst_spec, dst_blocks, seed=2)
        self.dst_k0 = [c.clone() for c in self.dst_k]
        self.dst_v0 = [c.clone() for c in self.dst_v]
        self.src.register(self.src_k, self.src_v, src_spec)
        self.dst_desc = self.dst.register(self.dst_k, self.dst_v, dst_spec)

    def connect(self) -> str:
        return self.src.connect(self.dst_desc)


def block_nbytes(dtype: torch.dtype, heads: int = HEADS) -> int:
    return heads * BLOCK * HEAD_DIM * dtype.itemsize


# -- plan_head_overlap ---------------------------------------------------------------
@pytest.mark.parametrize(("src", "dst", "expected"), [
    ((0, 4), (0, 4), HeadOverlap((0, 4), (0, 4), (0, 4))),   # same TP
    ((0, 2), (0, 4), HeadOverlap((0, 2), (0, 2), (0, 2))),   # TP2 rank 0 -> TP1
    ((2, 4), (0, 4), HeadOverlap((2, 4), (0, 2), (2, 4))),   # TP2 rank 1 -> TP1
    ((0, 4), (2, 4), HeadOverlap((2, 4), (2, 4), (0, 2))),   # TP1 -> TP2 rank 1
    ((1, 3), (2, 5), HeadOverlap((2, 3), (1, 2), (0, 1))),   # partial overlap
    ((0, 2), (2, 4), None),                                  # adjacent: nothing
    ((0, 1), (3, 4), None),                                  # disjoint
])
def test_plan_head_overlap(src: tuple[int, int], dst: tuple[int, int],
                           expected: HeadOverlap | None) -> None:
    assert plan_head_overlap(src, dst) == expected


# -- fingerprint ---------------------------------------------------------------------
def test_fingerprint_ignores_head_range() -> None:
    assert make_spec(heads=(0, 2)).fingerprint() == make_spec(heads=(2, 4)).fingerprint()
    assert "head_range" not in make_spec().fingerprint()


def test_fingerprint_mismatch_names_every_differing_field() -> None:
    local = make_spec()
    remote = make_spec(dtype="bfloat16", block_size=16)
    with pytest.raises(FingerprintMismatch) as info:
        local.check_compatible(remote.fingerprint())
    message = str(info.value)
    assert "dtype: local='float32' remote='bfloat16'" in message
    assert "block_size: local=4 remote=16" in message
    assert set(info.value.diffs) == {"dtype", "block_size"}


def test_connect_refused_on_both_sides() -> None:
    pair = Pair(make_spec(), make_spec(head_dim=16))
    with pytest.raises(FingerprintMismatch, match="head_dim"):
        pair.connect()
    refusals = pair.dst.handshake_refusals()
    assert len(refusals) == 1 and "head_dim" in str(refusals[0])
    with pytest.raises(KVTransferError):
        pair.src.push("r", [0], [0])  # not connected: nothing can be pushed


# -- the state machine ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_push_moves_exact_blocks_through_states(dtype: str) -> None:
    pair = Pair(make_spec(dtype), make_spec(dtype))
    pair.connect()
    src_ids, dst_ids = [5, 0, 3], [11, 2, 7]
    handle = pair.src.push("req-1", src_ids, dst_ids)
    assert handle.poll() is TransferState.PENDING
    pair.src.progress()
    assert handle.poll() is TransferState.TRANSFERRING
    assert all(torch.equal(a, b) for a, b in zip(pair.dst_k, pair.dst_k0))
    pair.src.progress()
    assert handle.poll() is TransferState.SUCCESS and handle.error is None
    untouched = [b for b in range(12) if b not in dst_ids]
    for layer in range(LAYERS):
        assert torch.equal(pair.dst_k[layer][dst_ids], pair.src_k[layer][src_ids])
        assert torch.equal(pair.dst_v[layer][dst_ids], pair.src_v[layer][src_ids])
        assert torch.equal(pair.dst_k[layer][untouched], pair.dst_k0[layer][untouched])
        assert torch.equal(pair.dst_v[layer][untouched], pair.dst_v0[layer][untouched])
    assert pair.src.pending() == 0


def test_done_arrives_after_the_data() -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    seen: list[bool] = []
    pair.dst.set_done_callback(
        lambda req_id, payload: seen.append(torch.equal(pair.dst_k[0][4], pair.src_k[0][1])))
    push = pair.src.push("req-1", [1], [4])
    done = pair.src.send_done("req-1", b"\x01token-and-logprobs")
    pair.src.progress()
    assert pair.dst.poll_done() == [] and seen == []
    pair.src.progress()
    assert push.poll() is TransferState.SUCCESS and done.poll() is TransferState.SUCCESS
    assert pair.dst.poll_done() == [("req-1", b"\x01token-and-logprobs")]
    assert seen == [True]
    assert pair.dst.poll_done() == []


def test_dead_peer_fails_and_counts() -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    handle = pair.src.push("req-1", [0, 1], [0, 1])
    pair.src.progress()
    pair.fabric.kill("decode-0")
    pair.src.progress()
    assert handle.poll() is TransferState.FAILED
    assert "unavailable" in (handle.error or "")
    stats = pair.src.stats()
    assert (stats.failures, stats.transfers, stats.bytes) == (1, 0, 0)


def test_close_fails_inflight_handles() -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    handle = pair.src.push("req-1", [0], [0])
    pair.src.close()
    assert handle.poll() is TransferState.FAILED
    assert pair.src.stats().failures == 1


@pytest.mark.parametrize(("src_ids", "dst_ids", "match"), [
    ([0, 1], [0], "equally many"),
    ([0], [12], "out of range"),
    ([8], [0], "out of range"),
    ([0, 1], [3, 3], "repeat"),
])
def test_bad_block_ids_raise_at_push(src_ids: list[int], dst_ids: list[int],
                                     match: str) -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    with pytest.raises(ValueError, match=match):
        pair.src.push("req-1", src_ids, dst_ids)


def test_layer_subset_writes_only_those_layers() -> None:
    pair = Pair(make_spec(), make_spec(), src_blocks=8, dst_blocks=12)
    pair.connect()
    handle = pair.src.push("req-1", [2], [9], layers=[1])
    pair.src.progress()
    pair.src.progress()
    assert handle.poll() is TransferState.SUCCESS
    assert torch.equal(pair.dst_k[1][9], pair.src_k[1][2])
    assert torch.equal(pair.dst_k[0], pair.dst_k0[0]) and torch.equal(pair.dst_k[2], pair.dst_k0[2])
    assert handle.nbytes == 2 * 1 * 1 * block_nbytes(torch.float32)


# -- heterogeneous head ranges -------------------------------------------------------
def test_two_tp_ranks_fill_one_decode_rank() -> None:
    fabric = InProcessFabric()
    dst = InProcessTransport("decode", fabric, auto_progress=True)
    dst_k, dst_v = make_caches(make_spec(), 6, seed=3)
    dst_k0 = [c.clone() for c in dst_k]
    desc = dst.register(dst_k, dst_v, make_spec())
    full_k, full_v = make_caches(make_spec(), 6, seed=4)
    for rank, heads in enumerate([(0, 2), (2, 4)]):
        src = InProcessTransport(f"prefill-{rank}", fabric, auto_progress=True)
        src.register([c[:, heads[0]:heads[1]].contiguous() for c in full_k],
                     [c[:, heads[0]:heads[1]].contiguous() for c in full_v],
                     make_spec(heads=heads))
        src.connect(desc)
        handle = src.push("req-1", [1, 4], [0, 5])
        assert handle.poll() is TransferState.SUCCESS
        assert handle.nbytes == 2 * LAYERS * 2 * block_nbytes(torch.float32, heads=2)
        if rank == 0:  # rank 1's heads are untouched until it pushes
            assert torch.equal(dst_k[0][[0, 5], 2:4], dst_k0[0][[0, 5], 2:4])
    for layer in range(LAYERS):
        assert torch.equal(dst_k[layer][[0, 5]], full_k[layer][[1, 4]])
        assert torch.equal(dst_v[layer][[0, 5]], full_v[layer][[1, 4]])


def test_one_rank_feeds_a_decode_rank_holding_half_the_heads() -> None:
    pair = Pair(make_spec(), make_spec(heads=(2, 4)))
    pair.connect()
    handle = pair.src.push("req-1", [3], [1])
    pair.src.progress()
    pair.src.progress()
    assert handle.poll() is TransferState.SUCCESS
    assert torch.equal(pair.dst_k[0][1], pair.src_k[0][3, 2:4])


def test_head_range_argument_narrows_the_overlap() -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    handle = pair.src.push("req-1", [3], [1], head_range=(1, 2))
    pair.src.progress()
    pair.src.progress()
    assert handle.poll() is TransferState.SUCCESS
    assert torch.equal(pair.dst_k[0][1, 1], pair.src_k[0][3, 1])
    assert torch.equal(pair.dst_k[0][1, [0, 2, 3]], pair.dst_k0[0][1, [0, 2, 3]])
    with pytest.raises(ValueError, match="no KV heads"):
        pair.src.push("req-2", [3], [1], head_range=(4, 4))


# -- counters ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stats_count_exact_bytes_blocks_and_transfers(dtype: str) -> None:
    spec = make_spec(dtype)
    pair = Pair(spec, spec)
    pair.connect()
    handles = [pair.src.push("a", [0, 1, 2], [3, 4, 5]), pair.src.push("b", [7], [0])]
    pair.src.send_done("a", b"x")
    pair.src.progress()
    pair.src.progress()
    assert all(h.poll() is TransferState.SUCCESS for h in handles)
    expected = 2 * LAYERS * 4 * block_nbytes(spec.torch_dtype)
    sent, received = pair.src.stats(), pair.dst.recv_stats()
    assert (sent.bytes, sent.blocks, sent.transfers, sent.failures) == (expected, 4, 2, 0)
    assert (received.bytes, received.blocks, received.transfers) == (expected, 4, 2)
    assert sent.latency_s >= 0 and sent.mean_latency_s == sent.latency_s / 2


def test_push_needs_a_named_peer_when_several_are_connected() -> None:
    pair = Pair(make_spec(), make_spec())
    pair.connect()
    other = InProcessTransport("decode-1", pair.fabric)
    other_k, other_v = make_caches(make_spec(), 4, seed=5)
    pair.src.connect(other.register(other_k, other_v, make_spec()))
    with pytest.raises(KVTransferError, match="name the peer"):
        pair.src.push("r", [0], [0])
    handle = pair.src.push("r", [0], [0], peer="decode-1")
    pair.src.progress()
    pair.src.progress()
    assert handle.poll() is TransferState.SUCCESS
    assert torch.equal(other_k[0][0], pair.src_k[0][0])


# -- wire / descriptor / config ------------------------------------------------------
def test_control_message_round_trip_from_a_larger_buffer() -> None:
    msg = ControlMsg(MsgKind.DATA, seq=7, req_id="req-é", data_tag=2**63 + 5,
                     data_nbytes=123456, head_range=(2, 4), block_ids=(9, 0, 3),
                     layers=(0, 2), extra=b"\x00payload")
    raw = msg.encode()
    buf = bytearray(len(raw) + 100)
    buf[:len(raw)] = raw
    assert ControlMsg.decode(buf) == msg
    with pytest.raises(WireError):
        ControlMsg.decode(raw[:-3])
    with pytest.raises(WireError):
        ControlMsg.decode(b"XXXX" + raw[4:])


def test_descriptor_is_json_and_round_trips() -> None:
    desc = KVDescriptor(transport="ucx", address="127.0.0.1", port=5555, num_blocks=10,
                        spec=make_spec("bfloat16", heads=(2, 4)))
    raw = desc.to_bytes()
    assert json.loads(raw)["spec"]["head_range"] == [2, 4]
    assert KVDescriptor.from_bytes(raw) == desc


@pytest.mark.parametrize("bad", [dict(transfer_timeout_s=0), dict(port=70000),
                                 dict(progress_mode="spin"), dict(host="")])
def test_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        KVTransferConfig(**bad)


def test_spec_rejects_bad_head_range() -> None:
    with pytest.raises(ValueError, match="head_range"):
        make_spec(heads=(3, 3))


def test_a_done_callback_runs_once_when_the_handle_ends_or_at_once_if_it_has():
    from pdserve.kv_transfer import TransferHandle, TransferState

    seen = []
    handle = TransferHandle("r")
    handle.add_done_callback(lambda h: seen.append(("first", h.poll())))
    assert seen == []
    assert handle._finish(TransferState.SUCCESS)
    assert not handle._finish(TransferState.FAILED, "late")  # the first terminal state wins, once
    handle.add_done_callback(lambda h: seen.append(("after", h.poll())))
    assert seen == [("first", TransferState.SUCCESS), ("after", TransferState.SUCCESS)]
