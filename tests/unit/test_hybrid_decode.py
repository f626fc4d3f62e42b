"""A decode node's core with --local-prefill (a hybrid): beside the requests whose KV a prefill node
sends (the KV import stage), it computes whole requests of its own in the same engine. Without the
flag it refuses a prompt of its own with FAILED_PRECONDITION. Exact tokens, zero blocks after."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode
from pdserve.node.messages import RequestFailed, StreamSubmit

from ..integration.reference import assert_matches, greedy_references
from .node_pair import Pair

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
IMPORTED = [(7 * i + 3) % 900 + 5 for i in range(21)]
LOCAL = [(11 * i + 5) % 900 + 3 for i in range(13)]


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def streamed(pair: Pair, req_id: str) -> list[int]:
    return [t for m in pair.decoded(req_id) for t in m.token_ids]


def test_a_hybrid_decode_node_runs_imported_and_local_requests_side_by_side(model):
    pair = Pair(*model, d_local_prefill=True)
    pair.submit("imported", IMPORTED, GREEDY)
    pair.decode.handle(StreamSubmit("local", LOCAL, GREEDY, 0))  # a Generate call: no KV to wait for
    pair.run()
    refs = greedy_references(model[0], [IMPORTED, LOCAL], [GREEDY.max_tokens] * 2)
    first = pair.first_tokens()["imported"].token_id  # token 1 of an imported request is the prefill node's
    assert_matches([[first, *streamed(pair, "imported")], streamed(pair, "local")], refs)
    assert pair.decoded("local")[-1].finish_reason == "length"
    assert pair.all_blocks_returned()


def test_a_plain_decode_node_refuses_a_prompt_of_its_own(model):
    pair = Pair(*model)
    pair.decode.handle(StreamSubmit("local", LOCAL, GREEDY, 0))
    (reply,) = pair.d_out
    assert isinstance(reply, RequestFailed) and reply.code is ErrorCode.FAILED_PRECONDITION
    assert reply.message == ("this node computes no prompts of its own (a decode node takes them with "
                             "--local-prefill)")
    assert not pair.d_engine.has_unfinished() and pair.all_blocks_returned()
