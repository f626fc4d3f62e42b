"""The engine core's ways out for a request: finished, handed off, detached; and its one capacity rule.

A real tiny engine (tests/unit/node_pair.py's config, blocks of 4 tokens) driven step by
step; every test ends with every block accounted for.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.admission import KVCapacityExceeded, RequestRejected
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput, StepFailed
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import ColocatedPolicy, SchedulingPolicy
from pdserve.engine.request import FinishReason, PendingFork, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode, rejection_error

from .node_pair import engine_config

PROMPT = [(7 * i + 3) % 900 + 5 for i in range(10)]  # 10 tokens: blocks 0, 1 full, block 2 partial


class HandOffPolicy(SchedulingPolicy):
    def hands_off_after_first_token(self) -> bool:
        return True


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def engine(model, policy: SchedulingPolicy, num_blocks: int = 16) -> EngineCore:
    model_dir, loaded = model
    return EngineCore(engine_config(model_dir, num_blocks, budget=16), policy, loaded)


def run(core: EngineCore) -> list[EngineCoreOutput]:
    outputs = []
    while core.has_unfinished():
        outputs.extend(core.step())
    return outputs


def greedy_tokens(model, max_tokens: int, prompt: list[int] = PROMPT) -> list[int]:
    core = engine(model, ColocatedPolicy())
    core.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [out.new_token_id for out in run(core)]


@pytest.mark.parametrize("max_tokens", [1, 5], ids=["token-1-is-the-last", "more-to-come"])
def test_a_hand_off_policy_ends_a_request_at_token_one_with_its_blocks_and_no_finish_reason(model, max_tokens):
    core = engine(model, HandOffPolicy())
    request = core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    (out,) = run(core)
    assert out.new_token_id == greedy_tokens(model, 1)[0]
    # Not LENGTH, not anything a client could see: the request goes on elsewhere.
    assert out.finish_reason is None and out.stop_token_id is None and out.is_last
    assert request.status is RequestStatus.HANDED_OFF and request.finish_reason is None
    assert [b.block_id for b in out.handoff_blocks] == [0, 1, 2]
    # Still held: the engine let go of them, the receiver frees them.
    assert [b.ref_count for b in out.handoff_blocks] == [1, 1, 1] and core.kv.num_used_blocks == 3
    core.kv.pool.free(reversed(out.handoff_blocks))
    assert core.kv.num_used_blocks == 0 and not core.has_unfinished()


def test_a_request_hands_off_by_its_own_flag_beside_requests_that_finish_here(model):
    """A decode node with --serve-prefill: a colocated policy, and the prompts it computes for other
    nodes marked to leave at token 1 (`hands_off`), a fork of one with them."""
    core = engine(model, ColocatedPolicy())
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    exported = core.add_request("exported", PROMPT, dataclasses.replace(params, n=2),
                                forks=[PendingFork("exported-sibling", 1)], hands_off=True)
    own = core.add_request("own", PROMPT[:6], params)
    outputs = run(core)
    handed_off = {out.req_id: out for out in outputs if out.handoff_blocks is not None}
    assert sorted(handed_off) == ["exported", "exported-sibling"] and exported.status is RequestStatus.HANDED_OFF
    assert [out.new_token_id for out in outputs if out.req_id == "own"] == greedy_tokens(model, 3, PROMPT[:6])
    assert own.finish_reason is FinishReason.LENGTH
    for out in handed_off.values():
        core.kv.pool.free(reversed(out.handoff_blocks))
    assert core.kv.num_used_blocks == 0 and not core.has_unfinished()


def test_a_stop_token_at_token_one_still_hands_off(model):
    first = greedy_tokens(model, 1)[0]
    core = engine(model, HandOffPolicy())
    core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[first]))
    (out,) = run(core)
    assert (out.new_token_id, out.finish_reason, out.stop_token_id) == (first, None, None)
    core.kv.pool.free(out.handoff_blocks)
    assert core.kv.num_used_blocks == 0


def test_the_stop_token_that_ended_a_request_is_in_its_last_output(model):
    tokens = greedy_tokens(model, 4)
    core = engine(model, ColocatedPolicy())
    core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 stop_token_ids=[tokens[2]]))
    outputs = run(core)
    stop_at = tokens.index(tokens[2])  # the first time the stop token comes up
    assert [o.new_token_id for o in outputs] == tokens[:stop_at + 1]
    assert [(o.finish_reason, o.stop_token_id) for o in outputs] == (
        [(None, None)] * stop_at + [(FinishReason.STOP, tokens[2])])
    assert outputs[-1].handoff_blocks is None and core.kv.num_used_blocks == 0


def test_a_length_finish_names_no_stop_token(model):
    core = engine(model, ColocatedPolicy())
    core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    last = run(core)[-1]
    assert (last.finish_reason, last.stop_token_id, last.handoff_blocks) == (FinishReason.LENGTH, None, None)


def test_detach_takes_a_running_request_out_with_its_blocks_still_held(model):
    core = engine(model, ColocatedPolicy())
    request = core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    core.step()
    assert request in core.scheduler.running
    blocks = core.detach("r")
    assert [b.block_id for b in blocks] == [0, 1, 2] and core.kv.num_used_blocks == 3
    assert not core.has_unfinished() and request.finish_reason is FinishReason.ABORT
    assert not core.abort("r")  # gone from the engine
    core.kv.pool.free(reversed(blocks))
    assert core.kv.num_used_blocks == 0
    with pytest.raises(KeyError):
        core.detach("r")


def test_kv_that_can_never_fit_is_a_typed_refusal_every_node_answers_resource_exhausted(model):
    core = engine(model, ColocatedPolicy(), num_blocks=4)  # 16 tokens
    params = SamplingParams(max_tokens=7)
    with pytest.raises(KVCapacityExceeded) as refused:
        core.add_request("r", PROMPT, params)  # 10 + 7 tokens: 5 blocks
    assert (refused.value.blocks_needed, refused.value.num_blocks) == (5, 4)
    assert str(refused.value) == "prompt_token_ids + max_tokens need 5 KV blocks; this engine has 4"
    error = rejection_error(refused.value)
    assert (error.code, error.message) == (ErrorCode.RESOURCE_EXHAUSTED,
                                           "prompt + max_tokens need 5 KV blocks; this node has 4")
    core.add_request("fits", PROMPT, SamplingParams(max_tokens=6))  # exactly 4 blocks
    assert not core.kv.num_used_blocks and core.has_unfinished()


def test_bad_input_stays_invalid_argument(model):
    core = engine(model, ColocatedPolicy())
    with pytest.raises(RequestRejected) as refused:
        core.add_request("r", [10**6], SamplingParams())
    assert not isinstance(refused.value, KVCapacityExceeded)
    error = rejection_error(refused.value)
    assert error.code is ErrorCode.INVALID_ARGUMENT and error.message.startswith("prompt_token_ids contains")


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(model):
    core = engine(model, ColocatedPolicy())
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    poisoned = [1, 2, 3, 901]
    execute = core.runner.execute

    def raising_on_the_poison(out):
        if any(901 in s.request.prompt_token_ids for s in out.scheduled):
            raise KeyError("a model bug on this input")
        return execute(out)

    core.runner.execute = raising_on_the_poison
    core.add_request("poisoned", poisoned, params)
    core.add_request("bystander", PROMPT, params)
    with pytest.raises(StepFailed) as failed:
        core.step()
    assert failed.value.req_ids == ["poisoned", "bystander"]  # one packed step: both were in it
    assert str(failed.value) == "KeyError: 'a model bug on this input'"
    assert core.num_failed_requests == 2
    for req_id in failed.value.req_ids:
        assert core.abort(req_id)
    assert core.kv.num_used_blocks == 0 and not core.has_unfinished()
    # Nothing else changed: the next request runs exactly as on a fresh engine.
    core.add_request("next", PROMPT, params)
    assert [out.new_token_id for out in run(core)] == greedy_tokens(model, 5)
    assert core.kv.num_used_blocks == 0
