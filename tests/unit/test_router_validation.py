"""The router's edge: every bad field of a GenerateRequest → InvalidRequest with the exact message.

(`text` and `token_ids` are a proto oneof, so "both set" cannot reach the router: the
last one set wins on the client. "Neither" is refused as `prompt`.) Every message starts
with the field it names.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest
from pdserve.router.config import RequestLimits
from pdserve.router.requests.validation import KVCapacity, RequestValidator, ValidatedRequest, kv_blocks

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model(router_model):
    return dataclasses.replace(router_model[1], max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def validator(model):
    return RequestValidator(model, max_n=64, draw_seed=lambda: 42, new_request_id=lambda: "generated-id")


def ids_request(ids, **params) -> pdserve_pb2.GenerateRequest:
    return pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=ids), sampling_params=pdserve_pb2.SamplingParams(**params)
    )


def refused(validator, request) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        validator.validate(request)
    assert str(err.value).startswith(err.value.field)  # the message names the field first
    return err.value


def test_a_good_request_resolves_id_seed_and_defaults(validator, model):
    out = validator.validate(pdserve_pb2.GenerateRequest(text="hello world"))
    assert out.prompt_token_ids == tuple(model.tokenizer.encode("hello world"))
    assert out.request_id == "generated-id"
    assert out.params.seed == 42 and out.params.max_tokens == 16 and out.params.n == 1
    given = validator.validate(ids_request([1, 2, 3], seed=7, temperature=0.5, top_k=5, stop=["x"]))
    assert given.params.seed == 7 and given.params.top_k == 5 and given.params.stop == ("x",)
    assert given.prompt_token_ids == (1, 2, 3)
    named = pdserve_pb2.GenerateRequest(request_id="mine", text="hi")
    assert validator.validate(named).request_id == "mine"


def test_the_default_max_tokens_shrinks_to_fit_the_model(validator):
    out = validator.validate(ids_request([5] * (MAX_MODEL_LEN - 4)))
    assert out.params.max_tokens == 4


@pytest.mark.parametrize(
    "request_, field, message",
    [
        (pdserve_pb2.GenerateRequest(), "prompt", "prompt must be set: exactly one of text and token_ids"),
        (pdserve_pb2.GenerateRequest(text=""), "text", "text must not be empty (the prompt has no tokens)"),
        (ids_request([]), "token_ids", "token_ids must not be empty (the prompt has no tokens)"),
        (ids_request([1, 960]), "token_ids", "token_ids contains 960, outside the vocabulary [0, 960)"),
        (ids_request([-1]), "token_ids", "token_ids contains -1, outside the vocabulary [0, 960)"),
        (ids_request([1] * MAX_MODEL_LEN), "token_ids", "token_ids has 64 tokens; the model holds 64 in all"),
        (
            ids_request([1] * 60, max_tokens=5),
            "max_tokens",
            "max_tokens must be <= 4 (the model holds 64 tokens and the prompt has 60), got 5",
        ),
    ],
)
def test_bad_prompts(validator, request_, field, message):
    error = refused(validator, request_)
    assert (error.field, str(error)) == (field, message)


def test_an_overlong_text_prompt_names_text(validator, model):
    text = " ".join(["hello"] * 200)
    assert len(model.tokenizer.encode(text)) >= MAX_MODEL_LEN
    error = refused(validator, pdserve_pb2.GenerateRequest(text=text))
    assert error.field == "text" and "the model holds 64 in all" in str(error)


@pytest.mark.parametrize(
    "params, field, message",
    [
        ({"n": 0}, "n", "n must be >= 1, got 0"),
        ({"n": 65}, "n", "n must be <= 64, got 65"),
        ({"temperature": -1.0}, "temperature", "temperature must be >= 0, got -1"),
        ({"temperature": float("nan")}, "temperature", "temperature must be finite, got nan"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"top_k": 0}, "top_k", "top_k must be >= 1, got 0"),
        ({"min_p": 1.5}, "min_p", "min_p must be <= 1, got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be >= 0.01, got 0"),
        ({"repetition_penalty": 1e-38}, "repetition_penalty", "repetition_penalty must be >= 0.01, got 1e-38"),
        ({"repetition_penalty": 101.0}, "repetition_penalty", "repetition_penalty must be <= 100, got 101"),
        ({"temperature": 1e30}, "temperature", "temperature must be <= 100, got 1e+30"),
        ({"presence_penalty": 3.0}, "presence_penalty", "presence_penalty must be <= 2, got 3"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "frequency_penalty must be >= -2, got -3"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -5}, "max_tokens", "max_tokens must be >= 1, got -5"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be <= 4, got 5"),
        ({"logprobs": 21}, "logprobs", "logprobs must be <= 20, got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be >= 0, got -1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be <= 20, got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs must be >= 0, got -1"),
        ({"stop": [""]}, "stop", "stop must not contain empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids must be >= 0, got -1"),
    ],
)
def test_bad_sampling_values(validator, params, field, message):
    error = refused(validator, ids_request([1, 2, 3], **params))
    assert (error.field, str(error)) == (field, message)


def limited(model, **limits) -> RequestValidator:
    return RequestValidator(model, max_n=64, draw_seed=lambda: 42, limits=RequestLimits(**limits))


@pytest.mark.parametrize(
    "limits, request_, field, message",
    [
        ({"max_prompt_tokens": 8}, ids_request([1] * 9), "token_ids",
         "token_ids has 9 tokens; this router accepts at most 8"),
        ({"max_prompt_chars": 10}, pdserve_pb2.GenerateRequest(text="x" * 11), "text",
         "text must be at most 10 characters, got 11"),
        ({"max_stop_strings": 2}, ids_request([1], stop=["a", "b", "c"]), "stop",
         "stop must hold at most 2 strings, got 3"),
        ({"max_stop_string_chars": 4}, ids_request([1], stop=["ok", "toolong"]), "stop",
         "stop strings must be at most 4 characters, got one of 7"),
        ({"max_stop_token_ids": 2}, ids_request([1], stop_token_ids=[1, 2, 3]), "stop_token_ids",
         "stop_token_ids must hold at most 2 ids, got 3"),
        ({"max_request_id_chars": 5}, pdserve_pb2.GenerateRequest(request_id="abcdef", text="hi"), "request_id",
         "request_id must be at most 5 characters, got 6"),
    ],
)
def test_router_limits(model, limits, request_, field, message):
    error = refused(limited(model, **limits), request_)
    assert (error.field, str(error)) == (field, message)


def test_limits_are_inclusive(model):
    validator = limited(model, max_prompt_tokens=8, max_prompt_chars=5, max_stop_strings=2, max_stop_string_chars=4)
    assert len(validator.validate(ids_request([1] * 8, stop=["abcd", "x"])).prompt_token_ids) == 8
    assert validator.validate(pdserve_pb2.GenerateRequest(text="hello")).prompt_token_ids


def test_the_text_limit_is_checked_before_tokenizing(model):
    class NoTokenizer:
        def encode(self, text):
            raise AssertionError("tokenized a text over the limit")

    validator = RequestValidator(dataclasses.replace(model, tokenizer=NoTokenizer()), max_n=4,
                                 limits=RequestLimits(max_prompt_chars=3))
    assert refused(validator, pdserve_pb2.GenerateRequest(text="abcd")).field == "text"
    with pytest.raises(InvalidRequest, match="^text must be at most 3 characters, got 4$"):
        validator.tokenize("abcd")


def test_a_prompt_limit_above_the_model_is_the_model(model):
    validator = limited(model, max_prompt_tokens=10_000)
    error = refused(validator, ids_request([1] * MAX_MODEL_LEN))
    assert str(error) == "token_ids has 64 tokens; the model holds 64 in all"
    assert validator.validate(ids_request([1] * (MAX_MODEL_LEN - 1))).params.max_tokens == 1


@pytest.mark.parametrize(
    "request_, field, message",
    [
        (ids_request([1], stop_token_ids=[960]), "stop_token_ids",
         "stop_token_ids contains 960, outside the vocabulary [0, 960)"),
        (pdserve_pb2.GenerateRequest(request_id="a\nb", text="hi"), "request_id",
         "request_id must hold only printable characters"),
        (ids_request([1], temperature=float("inf")), "temperature", "temperature must be finite, got inf"),
        (ids_request([1], top_p=float("nan")), "top_p", "top_p must be finite, got nan"),
        (ids_request([1], min_p=-0.5), "min_p", "min_p must be >= 0, got -0.5"),
        (ids_request([1], repetition_penalty=float("-inf")), "repetition_penalty",
         "repetition_penalty must be finite, got -inf"),
        (ids_request([1], top_k=-1), "top_k", "top_k must be >= 1, got -1"),
        (ids_request([1], min_tokens=-1), "min_tokens", "min_tokens must be >= 0, got -1"),
        (ids_request([1], max_tokens=2**31 - 1), "max_tokens",
         "max_tokens must be <= 63 (the model holds 64 tokens and the prompt has 1), got 2147483647"),
    ],
)
def test_more_bad_values(validator, request_, field, message):
    error = refused(validator, request_)
    assert (error.field, str(error)) == (field, message)


def pooled(model, decode_blocks, prefill_blocks, block_size=8) -> RequestValidator:
    capacity = KVCapacity(block_size, decode_blocks, prefill_blocks)
    return RequestValidator(model, max_n=4, draw_seed=lambda: 1, capacity=lambda: capacity)


@pytest.mark.parametrize(
    "decode_blocks, prefill_blocks, request_, field, message",
    [
        # 24 prompt tokens + token 1 need 4 blocks of 8.
        (3, 10, ids_request([1] * 24, max_tokens=1), "token_ids",
         "token_ids has 24 tokens and needs 4 KV blocks of 8 tokens; the largest decode node holds 3"),
        (10, 3, ids_request([1] * 24, max_tokens=1), "token_ids",
         "token_ids has 24 tokens and needs 4 KV blocks of 8 tokens; the largest prefill node holds 3"),
        (4, 4, ids_request([1] * 24, max_tokens=9), "max_tokens",
         "max_tokens must be <= 8: the prompt (24 tokens) and max_tokens (9) need 5 KV blocks of 8 tokens; "
         "the largest decode node holds 4"),
    ],
)
def test_requests_no_live_pool_can_hold(model, decode_blocks, prefill_blocks, request_, field, message):
    error = refused(pooled(model, decode_blocks, prefill_blocks), request_)
    assert (error.field, str(error)) == (field, message)


def test_what_the_pools_hold_passes_and_the_default_shrinks_to_fit(model):
    validator = pooled(model, 4, 4)
    assert validator.validate(ids_request([1] * 24, max_tokens=8)).params.max_tokens == 8
    assert validator.validate(ids_request([1] * 24)).params.max_tokens == 8  # default 16, shrunk
    unknown = RequestValidator(model, max_n=4, capacity=lambda: KVCapacity(8))  # no live node known yet
    assert unknown.validate(ids_request([1] * 60, max_tokens=4)).params.max_tokens == 4


def test_live_capacity_reads_the_largest_live_pools():
    from pdserve.proto import node_pb2
    from pdserve.router.cluster.registry import NodeKind, NodeRegistry
    from pdserve.router.requests.validation import live_capacity

    now = [0.0]
    registry = NodeRegistry(heartbeat_timeout_s=5.0, channel_close_grace_s=1.0, clock=lambda: now[0])
    capacity = live_capacity(registry, block_size=16)
    assert capacity() == KVCapacity(16, None, None)  # nothing known: no pool check
    registry.register(NodeKind.DECODE, "127.0.0.1:1", "d0")
    registry.register(NodeKind.DECODE, "127.0.0.1:2", "d1")
    registry.register(NodeKind.PREFILL, "127.0.0.1:3", "p0")
    assert capacity() == KVCapacity(16, None, None)  # registered, no stats yet
    registry.heartbeat("d0", node_pb2.NodeStats(num_blocks=100))
    registry.heartbeat("p0", node_pb2.NodeStats(num_blocks=30))
    now[0] = 3.0
    registry.heartbeat("d1", node_pb2.NodeStats(num_blocks=40))
    assert capacity() == KVCapacity(16, 100, 30)
    now[0] = 6.0  # d0 and p0 went silent: only d1 is live
    assert capacity() == KVCapacity(16, 40, None)
    registry.register(NodeKind.COLOCATED, "127.0.0.1:4", "c0")
    registry.heartbeat("c0", node_pb2.NodeStats(num_blocks=20))
    assert capacity() == KVCapacity(16, 20, None, "colocated")  # every request then runs on colocated nodes


def test_a_colocated_pool_is_named_as_such(model):
    capacity = KVCapacity(8, 3, None, "colocated")
    validator = RequestValidator(model, max_n=4, capacity=lambda: capacity)
    error = refused(validator, ids_request([1] * 24, max_tokens=1))
    assert str(error) == "token_ids has 24 tokens and needs 4 KV blocks of 8 tokens; the largest colocated node holds 3"


def test_the_blocks_a_request_may_need_round_up_and_stop_at_the_model():
    assert [kv_blocks(n, 8) for n in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 3]
    assert KVCapacity(block_size=8).blocks_for(17) == 3
    request = ValidatedRequest("r", tuple(range(10)), SamplingParams(max_tokens=7))
    assert request.max_kv_blocks(block_size=8, max_model_len=100) == 3  # 17 tokens
    assert request.max_kv_blocks(block_size=8, max_model_len=16) == 2  # the model holds 16
