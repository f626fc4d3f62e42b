"""The prefill node's KV exporter: push planning, chunk-by-chunk pushes, every ending.

A real tiny prefill engine and decode engine in one process, joined by the in-process
transport (tests/unit/node_pair.py); the test plays the router and the core loops. Each
ending is checked as the exact hand-off states both sides went through, and as every
block reference freed exactly once with none left.
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode
from pdserve.node.core.handoff import DECODE_MOVES, PREFILL_MOVES, HandoffState, IllegalMove
from pdserve.node.messages import Abort, PrefillSubmit, Ready
from pdserve.prefill_node.exporter import plan_push
from tests.unit.node_pair import BLOCK_SIZE, ManualExecutor, Pair, block_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BOOT, WAIT, SENDING, OK, FAILED = (HandoffState.BOOTSTRAPPING, HandoffState.WAITING_FOR_INPUT,
                                   HandoffState.TRANSFERRING, HandoffState.SUCCESS, HandoffState.FAILED)


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 900 + 5 for i in range(n)]


def blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


# -- planning ------------------------------------------------------------------------
def test_plan_push_pairs_positions():
    assert plan_push(0, 2, [10, 11, 12], [3, 4, 5]) == ([10, 11], [3, 4])
    assert plan_push(2, 3, [10, 11, 12], [3, 4, 5]) == ([12], [5])
    assert plan_push(3, 3, [10, 11, 12], [3, 4, 5]) == ([], [])


@pytest.mark.parametrize("args", [(2, 1, [1, 2], [1, 2]), (0, 3, [1, 2], [1, 2, 3]), (-1, 1, [1], [1])])
def test_plan_push_refuses_impossible_ranges(args):
    with pytest.raises(ValueError):
        plan_push(*args)


# -- the state tables ----------------------------------------------------------------
def test_each_side_allows_exactly_its_moves():
    legal = {(side.side, old, new) for side in (PREFILL_MOVES, DECODE_MOVES) for old in HandoffState
             for new in HandoffState if _allowed(side, old, new)}
    assert legal == {("prefill", BOOT, WAIT), ("prefill", BOOT, FAILED), ("prefill", WAIT, SENDING),
                     ("prefill", WAIT, FAILED), ("prefill", SENDING, OK), ("prefill", SENDING, FAILED),
                     ("decode", WAIT, OK), ("decode", WAIT, FAILED)}
    assert (PREFILL_MOVES.first, DECODE_MOVES.first) == (BOOT, WAIT)
    with pytest.raises(IllegalMove, match="prefill request 'r': success -> failed"):
        PREFILL_MOVES.check("r", OK, FAILED)


def _allowed(side, old, new) -> bool:
    try:
        side.check("r", old, new)
    except IllegalMove:
        return False
    return True


# -- the happy path ------------------------------------------------------------------
def test_blocks_are_pushed_as_chunks_finish(model):
    pair = Pair(*model)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()  # step 1: 8 of 30 tokens computed -> blocks 0, 1 full and queued
    pair.tick()  # the transport moves them; step 2 computes 8 more
    assert not pair.first_tokens()
    assert pair.d_tx.recv_stats().blocks >= 2
    pair.run()
    assert pair.p_tx.stats().transfers >= 4  # 30 tokens in chunks of 8: one push per chunk
    assert pair.d_tx.recv_stats().blocks == blocks(30)
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, OK]
    assert pair.all_blocks_returned()


def colocated_tokens(model_dir, loaded, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    engine = EngineCore(EngineConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
                                     max_num_batched_tokens=8, max_num_seqs=8), loaded=loaded)
    for req_id, (tokens, params) in requests.items():
        engine.add_request(req_id, tokens, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for step_out in engine.step():
            out.setdefault(step_out.req_id, []).append(step_out.new_token_id)
    return out


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=6, ignore_eos=True, seed=7)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_tokens_match_colocated(model, params):
    model_dir, loaded = model
    lengths = [1, 3, 4, 5, 13, 30]
    requests = {f"r{i}": (prompt(n, i), params) for i, n in enumerate(lengths)}
    pair = Pair(model_dir, loaded)
    for req_id, (tokens, p) in requests.items():
        pair.submit(req_id, tokens, p)
    pair.run()
    expected = colocated_tokens(model_dir, loaded, requests)
    firsts = pair.first_tokens()
    for req_id, n in zip(requests, lengths):
        events = pair.decoded(req_id)
        got = [firsts[req_id].token_id] + [t for e in events for t in e.token_ids]
        assert got == expected[req_id], req_id
        assert events[-1].finish_reason == "length"
        assert firsts[req_id].kv_transfer_bytes == blocks(n) * block_bytes(loaded)
    assert pair.all_blocks_returned()
    assert all(pair.p_moves[r] == [BOOT, WAIT, SENDING, OK] and pair.d_moves[r] == [WAIT, OK] for r in requests)
    assert pair.d_tx.recv_stats().bytes == sum(blocks(n) for n in lengths) * block_bytes(loaded)
    assert pair.p_tx.stats().bytes == pair.d_tx.recv_stats().bytes


def test_token_one_ends_a_max_tokens_1_request_on_the_decode_node(model):
    pair = Pair(*model)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    pair.submit("one", prompt(9), params)
    pair.run()
    (event,) = pair.decoded("one")
    assert event.token_ids == [] and event.finish_reason == "length"
    assert pair.used_blocks() == (0, 0)


# -- failures ------------------------------------------------------------------------
def test_fingerprint_mismatch_fails_with_failed_precondition_naming_the_field(model):
    pair = Pair(*model, d_model_name="another-model")
    pair.submit("r", prompt(10), GREEDY)
    pair.tick()
    failed = pair.failures("p")["r"]
    assert failed.code is ErrorCode.FAILED_PRECONDITION
    assert "model" in failed.message and "another-model" in failed.message
    pair.tick()
    assert pair.p_engine.kv.num_used_blocks == 0 and not pair.exporter.has_pending()
    # A cancelled reservation is freed at once: its write permit is revoked first.
    pair.decode.handle(Abort("r"))
    assert pair.table.num_reserved_blocks == 0 and pair.d_engine.kv.num_used_blocks == 0
    assert pair.p_moves["r"] == [BOOT, FAILED] and pair.d_moves["r"] == [WAIT, FAILED]
    assert pair.all_blocks_returned()


def test_a_failed_transfer_fails_the_rpc_unavailable_and_frees_the_blocks(model):
    pair = Pair(*model)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()  # first push queued
    pair.fabric.kill("d")
    for _ in range(20):
        pair.tick()
    assert pair.failures("p")["r"].code is ErrorCode.UNAVAILABLE
    assert not pair.first_tokens()
    assert pair.p_engine.kv.num_used_blocks == 0 and not pair.exporter.has_pending()
    assert pair.p_moves["r"] == [BOOT, WAIT, FAILED] and pair.p_ledger.balanced()


def test_abort_mid_prefill_frees_after_pushes_and_tells_the_decode_node(model):
    pair = Pair(*model)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()
    pair.prefill.handle(Abort("r"))
    assert not pair.p_out  # the caller went away: no answer
    pair.run()
    assert pair.p_engine.kv.num_used_blocks == 0
    # The decode node's stream was still open: the aborted done message ends it at once.
    assert pair.failures("d")["r"].code is ErrorCode.UNAVAILABLE
    assert pair.d_engine.kv.num_used_blocks == 0 and not pair.table.has_pending()
    assert pair.p_moves["r"] == [BOOT, WAIT, FAILED] and pair.d_moves["r"] == [WAIT, FAILED]
    assert pair.all_blocks_returned()


def test_a_cancelled_reservation_is_freed_at_once_and_its_late_pushes_are_dropped(model):
    pair = Pair(*model)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()
    pair.tick()  # the first push has landed
    assert pair.d_tx.recv_stats().transfers == 1
    pair.decode.handle(Abort("r"))  # the router cancels the decode stream first
    assert pair.table.num_reserved_blocks == 0 and pair.d_engine.kv.num_used_blocks == 0
    pair.run()  # P finishes: D drops its pushes (they still succeed) and ignores its done message
    assert "r" in pair.first_tokens() and not pair.failures("p")
    assert pair.d_tx.recv_stats().transfers == 1  # only the push placed before the cancel
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, FAILED]
    assert pair.all_blocks_returned()


def test_lease_fails_an_unacknowledged_prefill(model):
    pair = Pair(*model, lease_s=5.0)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()
    pair.prefill.poll(1e12)  # far past the lease
    failed = pair.failures("p")["r"]
    assert failed.code is ErrorCode.UNAVAILABLE and "lease" in failed.message
    pair.run()
    assert pair.p_engine.kv.num_used_blocks == 0
    assert pair.p_moves["r"] == [BOOT, WAIT, FAILED] and pair.d_moves["r"] == [WAIT, FAILED]
    assert pair.all_blocks_returned()


def short_prompt_in_flight(pair: Pair) -> None:
    """A 3-token prompt: one step computes it and samples token 1, so P is TRANSFERRING at once,
    and token 1 has left for the front while the pushes are still in flight."""
    pair.submit("r", prompt(3), GREEDY)
    pair.tick()
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING] and pair.p_tx.pending() > 0
    assert list(pair.first_tokens()) == ["r"] and pair.first_tokens()["r"].kv_transfer_bytes > 0


def test_token_one_leaves_when_sampled_not_when_the_transfer_is_acknowledged(model):
    pair = Pair(*model)
    short_prompt_in_flight(pair)
    first = pair.first_tokens()["r"]
    assert first.kv_transfer_s == 0.0  # connected before the hand-off: token 1 waited on nothing
    pair.run()
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, OK]
    # The bytes token 1 announced are the bytes that crossed.
    assert first.kv_transfer_bytes == pair.d_tx.recv_stats().bytes
    assert len(pair.first_tokens()) == 1 and not pair.failures("p")  # answered once
    assert pair.all_blocks_returned()


def test_a_failed_transfer_after_token_one_frees_once_and_answers_nothing_more(model):
    pair = Pair(*model)
    short_prompt_in_flight(pair)
    pair.fabric.kill("d")
    for _ in range(5):
        pair.tick()
    # The caller has token 1 already: the decode node's stream is what fails (the router resumes).
    assert not pair.failures("p") and len(pair.first_tokens()) == 1
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, FAILED]
    assert pair.p_engine.kv.num_used_blocks == 0 and pair.p_ledger.balanced() and not pair.exporter.has_pending()


def test_the_lease_fails_a_transfer_after_token_one(model):
    pair = Pair(*model, lease_s=5.0)
    short_prompt_in_flight(pair)
    pair.prefill.poll(1e12)  # far past the lease, the pushes still in flight
    assert not pair.failures("p")  # token 1 was answered already
    pair.run()
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, FAILED]
    # The done message was already queued behind the pushes, the aborted one behind it: the
    # decode node admits the request (the router, told the prefill failed, cancels that stream).
    assert pair.d_moves["r"] == [WAIT, OK]
    assert pair.all_blocks_returned()


def test_an_abort_after_token_one_lets_the_transfer_complete(model):
    pair = Pair(*model)
    short_prompt_in_flight(pair)
    pair.prefill.handle(Abort("r"))
    pair.run()
    assert len(pair.first_tokens()) == 1 and not pair.failures("p")  # nothing more after token 1
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, OK]
    assert pair.all_blocks_returned()


# -- while the connection to the decode node is being made ---------------------------
def test_token_one_before_the_connection_waits_for_it_then_transfers(model):
    connector = ManualExecutor()
    pair = Pair(*model, connector=connector)
    pair.submit("r", prompt(3), GREEDY)
    pair.tick()  # the prompt is computed and handed off; nothing can be pushed yet
    assert pair.p_moves["r"] == [BOOT] and pair.exporter.num_held_blocks() == 1
    connector.run_pending()
    pair.run()
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, OK]
    assert "r" in pair.first_tokens() and pair.all_blocks_returned()


def test_an_abort_while_connecting_tells_the_decode_node_once_connected(model):
    connector = ManualExecutor()
    pair = Pair(*model, connector=connector)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()
    pair.prefill.handle(Abort("r"))
    assert pair.p_moves["r"] == [BOOT, FAILED] and pair.exporter.has_pending()  # the decode node is owed a word
    pair.tick()
    assert pair.d_moves["r"] == [WAIT]
    connector.run_pending()
    pair.run()
    assert pair.d_moves["r"] == [WAIT, FAILED] and pair.failures("d")["r"].code is ErrorCode.UNAVAILABLE
    assert not pair.p_out and pair.all_blocks_returned()


def test_bad_destination_blocks_are_invalid_argument(model):
    pair = Pair(*model)
    ready = pair.reserve("r", prompt(10), GREEDY)
    assert isinstance(ready, Ready)
    short = Ready("r", ready.kv_layout_id, ready.block_ids[:-1])
    pair.prefill_from(short, prompt(10), GREEDY)
    assert pair.failures("p")["r"].code is ErrorCode.INVALID_ARGUMENT
    assert pair.p_engine.kv.num_used_blocks == 0


def test_the_decode_layout_comes_once_and_later_requests_name_it_by_id(model):
    pair = Pair(*model)
    first, second = pair.reserve("a", prompt(10), GREEDY), pair.reserve("b", prompt(12, 1), GREEDY)
    assert isinstance(first, Ready) and isinstance(second, Ready)
    assert first.kv_layout_id == second.kv_layout_id == pair.d_node.descriptor().layout_id
    pair.prefill.handle(PrefillSubmit("a", prompt(10), GREEDY, 0, first.kv_layout_id, first.block_ids,
                                      kv_layout=pair.d_layout))
    pair.prefill.handle(PrefillSubmit("b", prompt(12, 1), GREEDY, 0, second.kv_layout_id, second.block_ids))
    pair.run()
    assert not pair.failures("p") and not pair.failures("d")
    assert set(pair.first_tokens()) == {"a", "b"} and pair.all_blocks_returned()


def test_a_layout_the_prefill_node_was_never_given_is_invalid_argument_and_touches_nothing(model):
    pair = Pair(*model)
    ready = pair.reserve("r", prompt(10), GREEDY)
    assert isinstance(ready, Ready)
    pair.prefill.handle(PrefillSubmit("r", prompt(10), GREEDY, 0, ready.kv_layout_id, ready.block_ids))
    failed = pair.failures("p")["r"]
    assert failed.code is ErrorCode.INVALID_ARGUMENT and failed.message.startswith("decode_kv_layout_id ")
    assert pair.p_engine.kv.num_used_blocks == 0 and not pair.exporter.has_pending()


def test_prefill_capacity_is_checked_for_the_prompt_only(model):
    pair = Pair(*model, p_blocks=8, d_blocks=64)  # P holds 32 tokens; the decode needs far more
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    pair.submit("long", prompt(10), params)
    pair.run()
    assert not pair.failures("p") and "long" in pair.first_tokens()
    assert sum(len(e.token_ids) for e in pair.decoded("long")) == 99
    assert pair.used_blocks() == (0, 0)


def test_a_prompt_that_can_never_fit_this_prefill_node_is_resource_exhausted(model):
    pair = Pair(*model, p_blocks=2, d_blocks=64)  # P holds 8 tokens; prompt + token 1 need 11
    pair.submit("long", prompt(10), GREEDY)
    failed = pair.failures("p")["long"]
    assert (failed.code, failed.message) == (ErrorCode.RESOURCE_EXHAUSTED,
                                             "prompt + max_tokens need 3 KV blocks; this node has 2")
    assert pair.p_engine.kv.num_used_blocks == 0 and not pair.exporter.has_pending()


def test_a_request_id_is_taken_until_its_export_ends(model):
    pair = Pair(*model)
    pair.submit("r", prompt(30), GREEDY)
    pair.tick()
    pair.prefill.handle(Abort("r"))  # aborted, but pushes may still read its blocks
    ready = pair.reserve("r2", prompt(30), GREEDY)
    pair.prefill_from(Ready("r", ready.kv_layout_id, ready.block_ids), prompt(30), GREEDY)
    assert pair.failures("p")["r"].code is ErrorCode.INVALID_ARGUMENT


def test_a_queued_prefill_outlives_both_leases_by_renewing_the_reservation(model):
    pair = Pair(*model, lease_s=5.0)
    pair.submit("r", prompt(30), GREEDY)
    start = time.monotonic()
    for k in range(1, 10):  # three leases in a prefill queue: the engine never steps
        now = start + 2.0 * k
        pair.prefill.poll(now)  # nothing pushed, nothing to bound; the reservation is renewed
        pair.p_tx.progress()
        pair.decode.poll(now)
    assert not pair.failures("p") and not pair.failures("d")
    assert pair.p_moves["r"] == [BOOT, WAIT] and pair.d_moves["r"] == [WAIT]
    pair.run()
    assert pair.p_moves["r"] == [BOOT, WAIT, SENDING, OK] and pair.d_moves["r"] == [WAIT, OK]
    assert pair.all_blocks_returned()
