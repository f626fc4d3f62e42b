"""KV between nodes of different tensor-parallel sizes: the per-rank-pair plan, the pairing check,
and whole transfers over in-process rank transports, byte for byte.

Every rank of each node is a real `InProcessTransport` over its own slice of the KV heads (what
a node's ranks hold, pdserve/engine/parallel.py); `RankedTransport` plans, pushes and sends the done
messages as a node's core does. The receiver's caches must end up equal to the sender's whole
KV, each rank pair must move exactly its planned heads, and nothing else may be written.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.parallel import kv_head_ranges, split_reason
from pdserve.kv_transfer import FingerprintMismatch, KVCacheSpec, TransferState
from pdserve.kv_transfer.inprocess import InProcessFabric, InProcessTransport
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.ranks.kv_ranks import LocalRank, NodeKVDescriptor, RankedTransport, Route, check_pairing, plan_routes

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 2, 4, 4, 8, 16


def test_routes_between_equal_layouts_pair_rank_with_rank():
    assert plan_routes([(0, 2), (2, 4)], [(0, 2), (2, 4)]) == [Route(0, 0, (0, 2)), Route(1, 1, (2, 4))]


def test_routes_from_two_ranks_into_one_take_each_half_from_its_holder():
    assert plan_routes([(0, 2), (2, 4)], [(0, 4)]) == [Route(0, 0, (0, 2)), Route(1, 0, (2, 4))]


def test_routes_from_one_rank_into_two_split_its_heads():
    assert plan_routes([(0, 4)], [(0, 2), (2, 4)]) == [Route(0, 0, (0, 2)), Route(0, 1, (2, 4))]


def test_a_replicated_head_is_sent_once_by_its_lowest_holder_to_every_rank_that_holds_it():
    # 4 ranks over 2 KV heads: ranks 0,1 hold head 0, ranks 2,3 head 1.
    replicated = kv_head_ranges(2, 4)
    assert replicated == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert plan_routes(replicated, [(0, 2)]) == [Route(0, 0, (0, 1)), Route(2, 0, (1, 2))]
    assert plan_routes([(0, 2)], replicated) == [Route(0, d, (d // 2, d // 2 + 1)) for d in range(4)]


def test_kv_head_ranges_split_evenly_or_replicate():
    assert kv_head_ranges(4, 1) == [(0, 4)]
    assert kv_head_ranges(4, 2) == [(0, 2), (2, 4)]
    assert kv_head_ranges(1, 2) == [(0, 1), (0, 1)]


def test_split_reason_names_what_does_not_divide():
    assert split_reason(2, 4, 2, 128, replicates_kv=False) is None
    assert split_reason(2, 4, 1, 128, replicates_kv=True) is None
    assert "3 ranks" in split_reason(3, 4, 2, 128, replicates_kv=True)
    assert "MLP width 127" in split_reason(2, 4, 2, 127, replicates_kv=True)
    assert "cannot replicate" in split_reason(2, 4, 1, 128, replicates_kv=False)
    assert "multiple" in split_reason(4, 12, 3, 128, replicates_kv=True)


class Node:
    """A node of `tp` in-process ranks, each caching its slice of the heads."""

    def __init__(self, name: str, tp: int, fabric: InProcessFabric, fill: bool) -> None:
        self.ranks, self.k, self.v = [], [], []
        for rank, heads in enumerate(kv_head_ranges(HEADS, tp)):
            shape = (BLOCKS, heads[1] - heads[0], BLOCK, DIM)
            make = (lambda: torch.randn(shape)) if fill else (lambda: torch.zeros(shape))
            k, v = [make() for _ in range(LAYERS)], [make() for _ in range(LAYERS)]
            transport = InProcessTransport(f"{name}-{rank}", fabric)
            transport.register(k, v, KVCacheSpec("m", "float32", LAYERS, HEADS, DIM, BLOCK, head_range=heads))
            self.ranks.append(transport)
            self.k.append(k)
            self.v.append(v)
        self.node = RankedTransport([LocalRank(t) for t in self.ranks])

    def whole(self, layer: int, blocks: list[int], which: str = "k") -> torch.Tensor:
        """[blocks, all heads, block, dim] as the node holds them: each head from its first holder."""
        caches = self.k if which == "k" else self.v
        parts, seen = [], 0
        for rank, (a, b) in enumerate(kv_head_ranges(HEADS, len(self.ranks))):
            if b > seen:
                parts.append(caches[rank][layer][blocks][:, seen - a:b - a])
                seen = b
        return torch.cat(parts, dim=1)

    def progress(self) -> None:
        """Run every queued push and done message to its end (each takes two progress calls)."""
        while any(rank.pending() for rank in self.ranks):
            for rank in self.ranks:
                rank.progress()


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (2, 4), (4, 2)])
def test_a_transfer_between_any_two_layouts_moves_exactly_the_plan(src_tp, dst_tp):
    fabric = InProcessFabric()
    src, dst = Node("p", src_tp, fabric, fill=True), Node("d", dst_tp, fabric, fill=False)
    peer = src.node.connect(dst.node.descriptor())
    src_blocks, dst_blocks = [3, 7, 1], [10, 2, 5]
    push = src.node.push("r", src_blocks, dst_blocks, peer=peer)
    routes = plan_routes(src.node.descriptor().layout, dst.node.descriptor().layout)
    done = src.node.send_done("r", KVDone(DoneStatus.OK, 42, parts=src.node.done_parts(peer)).to_bytes(), peer=peer)
    src.progress()
    assert push.poll() is TransferState.SUCCESS and done.poll() is TransferState.SUCCESS
    for layer in range(LAYERS):
        for which in "kv":
            assert torch.equal(dst.whole(layer, dst_blocks, which), src.whole(layer, src_blocks, which))
    untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
    assert all(not cache[untouched].any() for caches in dst.k + dst.v for cache in caches)
    # Every rank pair moved its planned heads, and nothing else moved.
    head_bytes = BLOCK * DIM * 4
    expected_sent = [sum(2 * LAYERS * 3 * (r.heads[1] - r.heads[0]) * head_bytes for r in routes if r.src == s)
                     for s in range(src_tp)]
    expected_received = [sum(2 * LAYERS * 3 * (r.heads[1] - r.heads[0]) * head_bytes for r in routes if r.dst == d)
                         for d in range(dst_tp)]
    assert [s.bytes for s in src.node.rank_stats()] == expected_sent
    assert [s.bytes for s in dst.node.rank_recv_stats()] == expected_received
    assert push.nbytes == sum(expected_sent) == 2 * LAYERS * 3 * HEADS * head_bytes
    # One done message per route; each says how many to collect.
    dones = dst.node.poll_done()
    assert len(dones) == len(routes) == src.node.done_parts(peer)
    assert {KVDone.from_bytes(payload).parts for _, payload in dones} == {len(routes)}


def test_layouts_that_do_not_cover_the_same_heads_are_refused_naming_both():
    fabric = InProcessFabric()
    src = Node("p", 2, fabric, fill=True).node.descriptor()
    dst = Node("d", 1, fabric, fill=False).node.descriptor()
    half = NodeKVDescriptor(dst.ranks[:1] + ())
    broken = NodeKVDescriptor((src.ranks[0],))  # rank 1's heads missing
    check_pairing(src, half)
    with pytest.raises(FingerprintMismatch, match=r"kv_layout: local='tp=1 KV heads \[0,2\)' remote='tp=1 KV heads \[0,4\)'"):
        check_pairing(broken, dst)


def test_node_descriptor_round_trips():
    fabric = InProcessFabric()
    desc = Node("p", 2, fabric, fill=True).node.descriptor()
    again = NodeKVDescriptor.from_bytes(desc.to_bytes())
    assert again == desc and again.layout == [(0, 2), (2, 4)] and again.key == "p-0:0"


def test_done_parts_round_trip_and_default_to_one():
    assert KVDone.from_bytes(KVDone(DoneStatus.OK, 5, parts=3).to_bytes()).parts == 3
    assert KVDone.from_bytes(b'{"status":"ok","token_id":5,"logprobs":null}').parts == 1
    with pytest.raises(ValueError, match="parts"):
        KVDone.from_bytes(b'{"status":"ok","token_id":5,"logprobs":null,"parts":0}')
