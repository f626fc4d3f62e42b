"""The decode node's reservation table: exact blocks, admission, write permits, leases, hand-off states."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest
import torch

from pdserve.decode_node.reservations import ReservationTable
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.core.handoff import HandoffState
from pdserve.node.core.kv_done import DoneStatus, KVDone
from pdserve.node.messages import Abort, Ready
from tests.unit.node_pair import BlockLedger, Pair, engine_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LEASE_S, QUARANTINE_S = 10.0, 30.0
OK = KVDone(DoneStatus.OK, token_id=42)


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


@pytest.fixture
def moves():
    return defaultdict(list)


@pytest.fixture
def table(model, moves):
    model_dir, loaded = model
    engine = EngineCore(engine_config(model_dir, num_blocks=8), ColocatedPolicy(), loaded)
    return ReservationTable(engine, LEASE_S, QUARANTINE_S, lambda req_id, state: moves[req_id].append(state))


def used(table: ReservationTable) -> int:
    return table.engine.kv.num_used_blocks


def fail_if_written() -> None:
    raise AssertionError("a push wrote blocks its request holds no permit for")


def test_reserve_takes_ceil_prompt_over_block_size_blocks_in_order(table):
    assert table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0) == [0, 1, 2]  # 9 tokens, blocks of 4
    assert table.reserve("b", [5, 6, 7, 8], PARAMS, 0, now=0.0) == [3]
    assert table.num_reserved_blocks == 4 and used(table) == 4
    # Reserved, not scheduled: the scheduler never sees a request before its KV.
    assert not table.engine.has_unfinished()


def test_every_ending_is_one_move_out_of_waiting_for_input_and_frees_each_block_once(table, moves):
    ledger = BlockLedger(table.engine.kv.pool)
    for req_id in ("ok", "aborted", "cancelled", "expired"):
        table.reserve(req_id, [1, 2, 3, 4, 5], PARAMS, 0, now=0.0 if req_id == "expired" else 1.0)
    assert {r: m for r, m in moves.items()} == dict.fromkeys(("ok", "aborted", "cancelled", "expired"),
                                                                [HandoffState.WAITING_FOR_INPUT])
    assert table.arrive("ok", OK)[0] is HandoffState.SUCCESS
    assert table.arrive("aborted", KVDone(DoneStatus.ABORTED))[0] is HandoffState.FAILED
    assert table.cancel("cancelled")
    assert table.expire(now=LEASE_S) == ["expired"]
    waiting, ok, failed = HandoffState.WAITING_FOR_INPUT, HandoffState.SUCCESS, HandoffState.FAILED
    expected = {"ok": [waiting, ok], "aborted": [waiting, failed], "cancelled": [waiting, failed],
                "expired": [waiting, failed]}
    assert dict(moves) == expected
    # Nothing more moves: a late done message, a second cancel, a cancel of the admitted request.
    assert table.arrive("cancelled", OK) == (None, None) and not table.cancel("expired") and not table.cancel("ok")
    assert dict(moves) == expected and not table.has_pending()
    assert used(table) == 2  # only the admitted request's blocks, now the scheduler's
    table.engine.abort("ok")
    assert used(table) == 0 and ledger.balanced() and ledger.taken.total() == 8


def test_short_of_blocks_is_resource_exhausted_and_leaks_nothing(table):
    table.reserve("a", list(range(1, 25)), PARAMS, 0, now=0.0)  # 6 of 8 blocks
    with pytest.raises(NodeError) as info:
        table.reserve("b", list(range(1, 13)), PARAMS, 0, now=0.0)  # needs 3
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert used(table) == 6 and table.num_reserved_blocks == 6
    assert table.reserve("b", [1, 2, 3], PARAMS, 0, now=0.0) == [6]  # the id is free again


def test_kv_that_can_never_fit_this_node_is_resource_exhausted(table):
    # 9 prompt tokens + max_tokens 24 need 9 blocks of 4; the node has 8 in all. Another
    # decode node may be bigger: the router tries it (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT).
    with pytest.raises(NodeError) as info:
        table.reserve("a", list(range(1, 10)), SamplingParams(max_tokens=24), 0, now=0.0)
    assert (info.value.code, info.value.message) == (ErrorCode.RESOURCE_EXHAUSTED,
                                                     "prompt + max_tokens need 9 KV blocks; this node has 8")
    assert used(table) == 0 and not table.has_pending()
    assert table.reserve("a", list(range(1, 10)), SamplingParams(max_tokens=23), 0, now=0.0) == [0, 1, 2]


def test_invalid_request_is_invalid_argument(table):
    with pytest.raises(NodeError) as info:
        table.reserve("a", [], PARAMS, 0, now=0.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert used(table) == 0


def test_arrival_admits_with_token_one_and_publishes_the_prompt_blocks(table):
    prompt = list(range(1, 10))
    table.reserve("a", prompt, PARAMS, 0, now=0.0)
    state, out = table.arrive("a", OK)
    assert state is HandoffState.SUCCESS and out.finish_reason is None and out.new_token_id == 42
    request = table.engine.scheduler.waiting[0]
    assert request.num_computed_tokens == len(prompt) and request.output_token_ids == [42]
    assert table.engine.kv.pool.num_cached_blocks == 2  # the two full prompt blocks
    assert table.num_reserved_blocks == 0 and not table.has_pending()


def test_token_one_can_end_the_request_at_once(table):
    table.reserve("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, stop_token_ids=[42]), 0, now=0.0)
    state, out = table.arrive("a", OK)
    assert state is HandoffState.SUCCESS and out.finish_reason.value == "stop" and out.stop_token_id == 42
    assert used(table) == 0 and not table.engine.has_unfinished()


def test_arrival_revokes_the_write_permit(table):
    block_ids = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.permits.place("a", block_ids, lambda: None)
    table.arrive("a", OK)
    # The blocks are the running request's now: a late push for its id writes nothing.
    assert not table.permits.place("a", block_ids, fail_if_written)


def test_cancel_frees_at_once_and_revokes_the_write_permit(table):
    block_ids = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.cancel("a")
    assert used(table) == 0 and table.num_reserved_blocks == 0 and not table.has_pending()
    assert not table.permits.place("a", block_ids, fail_if_written)
    assert table.arrive("a", OK) == (None, None)  # its done message changes nothing
    assert used(table) == 0 and not table.engine.has_unfinished()
    assert not table.cancel("a")  # idempotent


def test_a_cancelled_id_is_retired_until_the_quarantine_bound(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    table.cancel("a")
    with pytest.raises(NodeError) as info:
        table.reserve("a", [1, 2, 3], PARAMS, 0, now=QUARANTINE_S - 1)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert used(table) == 0
    table.expire(now=QUARANTINE_S)  # forgets the retired id
    assert table.reserve("a", [1, 2, 3], PARAMS, 0, now=QUARANTINE_S) == [3]  # freed blocks queue last


def test_a_late_push_never_reaches_the_blocks_of_the_next_reservation(table):
    old = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    table.reserve("filler", list(range(1, 21)), PARAMS, 0, now=0.0)  # the other 5 blocks
    table.cancel("a")
    new = table.reserve("b", list(range(11, 20)), PARAMS, 0, now=0.0)
    assert sorted(new) == sorted(old) == [0, 1, 2]  # the very blocks "a" held
    assert not table.permits.place("a", old, fail_if_written)
    assert table.permits.place("b", new, lambda: None)


def test_a_push_outside_its_reserved_blocks_is_dropped(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)  # [0, 1, 2]
    table.reserve("b", [1, 2, 3, 4], PARAMS, 0, now=0.0)  # [3]
    assert not table.permits.place("a", [2, 3], fail_if_written)
    assert not table.permits.place("never-reserved", [5], fail_if_written)
    assert table.permits.place("a", [2, 0], lambda: None)


def test_a_cancel_waits_for_a_write_in_progress_then_frees(table):
    block_ids = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    writing, proceed = threading.Event(), threading.Event()
    held_while_writing: list[int] = []

    def slow_write() -> None:  # a chunk's scatter on the transport's thread
        writing.set()
        proceed.wait(10)
        held_while_writing.append(used(table))

    writer = threading.Thread(target=table.permits.place, args=("a", block_ids, slow_write))
    writer.start()
    assert writing.wait(10)
    canceller = threading.Thread(target=table.cancel, args=("a",))
    canceller.start()
    canceller.join(0.1)  # it cannot free the blocks while the write holds the permit
    proceed.set()
    writer.join(10)
    canceller.join(10)
    assert held_while_writing == [3]
    assert used(table) == 0 and not table.has_pending()


def test_lease_expiry_fails_the_stream_and_frees_at_once(table):
    block_ids = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.expire(now=LEASE_S - 0.1) == []
    assert used(table) == 3
    assert table.expire(now=LEASE_S) == ["a"]
    assert used(table) == 0 and not table.has_pending()
    assert not table.permits.place("a", block_ids, fail_if_written)
    with pytest.raises(NodeError):
        table.reserve("a", [1], PARAMS, 0, now=LEASE_S)  # the id is retired
    assert table.expire(now=QUARANTINE_S) == []
    assert table.reserve("a", [1], PARAMS, 0, now=QUARANTINE_S) == [3]


def test_aborted_done_frees_a_live_reservation(table):
    block_ids = table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.arrive("a", KVDone(DoneStatus.ABORTED)) == (HandoffState.FAILED, None)
    assert used(table) == 0 and not table.engine.has_unfinished()
    assert not table.permits.place("a", block_ids, fail_if_written)


# -- through the transport: a real push after the cancel --------------------------------
def test_pushes_after_a_cancel_land_nowhere_even_in_reused_blocks(model):
    pair = Pair(*model, d_blocks=9)  # "a" takes 8 of them: "b" must reuse 7 of its blocks
    prompt_a, prompt_b = [(5 * i + 1) % 900 + 5 for i in range(32)], [(3 * i + 2) % 900 + 5 for i in range(32)]
    ready_a = pair.reserve("a", prompt_a, PARAMS)
    pair.prefill_from(ready_a, prompt_a, PARAMS)
    pair.tick()
    pair.tick()  # a's first push landed
    pair.decode.handle(Abort("a"))
    ready_b = pair.reserve("b", prompt_b, PARAMS)
    assert isinstance(ready_b, Ready) and len(set(ready_b.block_ids) & set(ready_a.block_ids)) == 7
    k_before = [k[ready_b.block_ids].clone() for k in pair.d_engine.runner.k_caches]
    placed_before = pair.d_tx.recv_stats().transfers
    for _ in range(100):  # P finishes "a": its pushes and done message reach D
        if not (pair.exporter.has_pending() or pair.p_engine.has_unfinished() or pair.p_tx.pending()):
            break
        pair.tick()
    assert "a" in pair.first_tokens()
    assert pair.d_tx.recv_stats().transfers == placed_before  # dropped, every one
    assert all(torch.equal(k[ready_b.block_ids], before)
               for k, before in zip(pair.d_engine.runner.k_caches, k_before))
    assert pair.table.reserved_request("b") is not None and not pair.d_engine.has_unfinished()
    pair.prefill_from(ready_b, prompt_b, PARAMS)
    pair.run()
    assert not pair.failures("p") and not pair.failures("d")
    assert pair.used_blocks() == (0, 0)
    # "b" comes out exactly as on a pair that never saw "a".
    fresh = Pair(*model, d_blocks=9)
    fresh.submit("b", prompt_b, PARAMS)
    fresh.run()
    assert served_tokens(pair, "b") == served_tokens(fresh, "b") and len(served_tokens(fresh, "b")) == 4


def served_tokens(pair: Pair, req_id: str) -> list[int]:
    return [pair.first_tokens()[req_id].token_id, *(t for e in pair.decoded(req_id) for t in e.token_ids)]


def test_a_request_from_tensor_parallel_ranks_is_admitted_only_with_every_rank_pairs_done_message(table, moves):
    """Each rank pair of two tensor-parallel nodes sends its own done message behind its own
    bytes: the KV is whole only once all `parts` have come; an aborted one ends it at once."""
    table.reserve("whole", [1, 2, 3, 4, 5], PARAMS, 0, now=0.0)
    table.reserve("broken", [1, 2, 3, 4, 5], PARAMS, 0, now=0.0)
    three = KVDone(DoneStatus.OK, 7, parts=3)
    assert table.arrive("whole", three) == (HandoffState.WAITING_FOR_INPUT, None)
    assert table.arrive("whole", three) == (HandoffState.WAITING_FOR_INPUT, None)
    assert table.num_reserved == 2 and not table.engine.has_unfinished()  # still no rank has all: not scheduled
    state, out = table.arrive("whole", three)
    assert state is HandoffState.SUCCESS and out.new_token_id == 7 and table.engine.has_unfinished()
    assert table.arrive("broken", three)[0] is HandoffState.WAITING_FOR_INPUT
    assert table.arrive("broken", KVDone(DoneStatus.ABORTED))[0] is HandoffState.FAILED
    assert table.arrive("broken", three) == (None, None)  # a late copy finds nothing
    assert moves["whole"] == [HandoffState.WAITING_FOR_INPUT, HandoffState.SUCCESS]


def test_each_renewal_from_the_prefill_node_restarts_the_lease(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    for now in (0.9 * LEASE_S, 1.8 * LEASE_S, 2.7 * LEASE_S):  # a deep prefill queue: renewed, never due
        assert table.renew("a", now) and table.expire(now=now + 0.5 * LEASE_S) == []
    assert table.expire(now=2.7 * LEASE_S + LEASE_S) == ["a"]  # no word for a whole lease: over
    assert not table.renew("a", 4 * LEASE_S) and used(table) == 0
    with pytest.raises(ValueError, match="renew"):
        table.arrive("a", KVDone(DoneStatus.RENEW))
