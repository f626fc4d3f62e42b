"""The decode node's reservation table: exact blocks, admission, quarantine, leases."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_node.reservations import Arrival, ReservationTable
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_factory import make_model
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import SchedulingPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.node.kv_done import DoneStatus, KVDone
from tests.unit.node_pair import engine_config

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LEASE_S, QUARANTINE_S = 10.0, 30.0
OK = KVDone(DoneStatus.OK, token_id=42)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = make_model(tmp_path_factory.mktemp("tiny"), "llama", "tiny", dtype=torch.float32)
    return str(model_dir), load_model(model_dir, torch.float32)


@pytest.fixture
def table(model):
    model_dir, loaded = model
    engine = EngineCore(engine_config(model_dir, num_blocks=8), SchedulingPolicy(), loaded)
    return ReservationTable(engine, LEASE_S, QUARANTINE_S)


def used(table: ReservationTable) -> int:
    return table.engine.kv.num_used_blocks


def test_reserve_takes_ceil_prompt_over_block_size_blocks_in_order(table):
    assert table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0) == [0, 1, 2]  # 9 tokens, blocks of 4
    assert table.reserve("b", [5, 6, 7, 8], PARAMS, 0, now=0.0) == [3]
    assert table.num_blocks == 4 and used(table) == 4
    # Reserved, not scheduled: the scheduler never sees a request before its KV.
    assert not table.engine.has_unfinished()


def test_short_of_blocks_is_resource_exhausted_and_leaks_nothing(table):
    table.reserve("a", list(range(1, 25)), PARAMS, 0, now=0.0)  # 6 of 8 blocks
    with pytest.raises(NodeError) as info:
        table.reserve("b", list(range(1, 13)), PARAMS, 0, now=0.0)  # needs 3
    assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert used(table) == 6 and table.num_blocks == 6
    assert table.reserve("b", [1, 2, 3], PARAMS, 0, now=0.0) == [6]  # the id is free again


def test_invalid_request_is_invalid_argument(table):
    with pytest.raises(NodeError) as info:
        table.reserve("a", [], PARAMS, 0, now=0.0)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert used(table) == 0


def test_arrival_admits_with_token_one_and_publishes_the_prompt_blocks(table):
    prompt = list(range(1, 10))
    table.reserve("a", prompt, PARAMS, 0, now=0.0)
    arrival, out = table.arrive("a", OK)
    assert arrival is Arrival.ADMITTED and out.finish_reason is None and out.new_token_id == 42
    request = table.engine.scheduler.waiting[0]
    assert request.num_computed_tokens == len(prompt) and request.output_token_ids == [42]
    assert table.engine.kv.pool.num_cached_blocks == 2  # the two full prompt blocks
    assert table.num_blocks == 0 and not table.has_pending()


def test_token_one_can_end_the_request_at_once(table):
    table.reserve("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, stop_token_ids=[42]), 0, now=0.0)
    arrival, out = table.arrive("a", OK)
    assert arrival is Arrival.ADMITTED and out.finish_reason.value == "stop"
    assert used(table) == 0 and not table.engine.has_unfinished()


def test_cancel_quarantines_until_the_done_message(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.cancel("a")
    assert used(table) == 3 and table.num_blocks == 3  # the prefill may still be writing
    assert table.expire(now=QUARANTINE_S - 1) == []
    assert used(table) == 3
    assert table.arrive("a", OK) == (Arrival.RELEASED, None)
    assert used(table) == 0 and not table.has_pending()
    assert table.arrive("a", OK) == (Arrival.UNKNOWN, None)


def test_lease_expiry_fails_the_stream_and_quarantine_has_a_bound(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.expire(now=LEASE_S - 0.1) == []
    assert table.expire(now=LEASE_S) == ["a"]
    assert used(table) == 3  # quarantined, not freed
    with pytest.raises(NodeError):
        table.reserve("a", [1], PARAMS, 0, now=LEASE_S)  # the id is still taken
    assert table.expire(now=QUARANTINE_S) == []
    assert used(table) == 0 and not table.has_pending()


def test_aborted_done_frees_a_live_reservation(table):
    table.reserve("a", list(range(1, 10)), PARAMS, 0, now=0.0)
    assert table.arrive("a", KVDone(DoneStatus.ABORTED)) == (Arrival.ABORTED, None)
    assert used(table) == 0 and not table.engine.has_unfinished()
