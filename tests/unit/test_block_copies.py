"""A step's block copies are one ordered list: the scheduler's order is the order every rank makes
them in (pdserve/engine/block_copies.py), copy-on-write and swaps alike."""

from __future__ import annotations

import types

import torch

from pdserve.engine.block_copies import BlockCopy, CopyKind, pairs_of, runs
from pdserve.engine.model_runner import RankForward
from pdserve.engine.scheduler import SchedulerOutput

OUT, IN, COW = CopyKind.SWAP_OUT, CopyKind.SWAP_IN, CopyKind.COW


def test_runs_group_consecutive_copies_of_one_kind_and_keep_the_order():
    copies = [BlockCopy(OUT, 2, 0), BlockCopy(OUT, 3, 1), BlockCopy(COW, 4, 2), BlockCopy(OUT, 5, 2)]
    assert runs(copies) == [(OUT, [(2, 0), (3, 1)]), (COW, [(4, 2)]), (OUT, [(5, 2)])]
    assert runs([]) == []
    assert pairs_of(copies, OUT) == [(2, 0), (3, 1), (5, 2)] and pairs_of(copies, IN) == []


def test_a_scheduler_output_reads_its_one_list_by_kind():
    out = SchedulerOutput(copies=[BlockCopy(OUT, 2, 0), BlockCopy(COW, 1, 3)])
    assert out.swap_out == [(2, 0)] and out.swap_in == [] and out.block_copies == [(1, 3)]


def rank_forward(num_blocks: int, num_swap_blocks: int) -> RankForward:
    loaded = types.SimpleNamespace(num_local_kv_heads=1, num_layers=2, head_dim=2, device=torch.device("cpu"))
    forward = RankForward(loaded, num_blocks, 1, torch.float32, "reference", num_swap_blocks)
    for layer, (k, v) in enumerate(zip(forward.k_caches, forward.v_caches)):
        for block in range(num_blocks):  # block b of layer l holds 10 * l + b (V: its negation)
            k[block].fill_(10 * layer + block)
            v[block].fill_(-(10 * layer + block))
    return forward


def block(caches: list[torch.Tensor], block_id: int) -> list[float]:
    return [c[block_id].flatten()[0].item() for c in caches]


def test_a_rank_makes_the_copies_in_the_lists_order():
    # Swap device block 2 out, then copy block 3 onto it: the host gets 2's old KV, the device 3's.
    forward = rank_forward(num_blocks=4, num_swap_blocks=2)
    forward.copy_blocks([BlockCopy(OUT, 2, 0), BlockCopy(COW, 3, 2)])
    assert block(forward.k_swap, 0) == [2, 12] and block(forward.v_swap, 0) == [-2, -12]
    assert block(forward.k_caches, 2) == [3, 13] and block(forward.v_caches, 2) == [-3, -13]
    # The other way round the host would hold block 3's KV: the order is the list's, not by kind.
    forward = rank_forward(num_blocks=4, num_swap_blocks=2)
    forward.copy_blocks([BlockCopy(COW, 3, 2), BlockCopy(OUT, 2, 0)])
    assert block(forward.k_swap, 0) == [3, 13]


def test_a_swap_in_fills_device_blocks_from_the_host():
    forward = rank_forward(num_blocks=4, num_swap_blocks=2)
    forward.copy_blocks([BlockCopy(OUT, 1, 1)])
    forward.copy_blocks([BlockCopy(IN, 1, 3)])
    assert block(forward.k_caches, 3) == [1, 11] and block(forward.v_caches, 3) == [-1, -11]
