"""The router's edge: every bad field of a GenerateRequest → InvalidRequest with the exact message.

(`text` and `token_ids` are a proto oneof, so "both set" cannot reach the router: the
last one set wins on the client. "Neither" is refused as `prompt`.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.model_factory import make_model
from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest
from pdserve.router.model import load_router_model
from pdserve.router.validation import RequestValidator

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("validation-model") / "tiny", "llama", "tiny", dtype=torch.float32)
    return dataclasses.replace(load_router_model(path), max_model_len=MAX_MODEL_LEN)


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
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be > 0, got 0"),
        ({"presence_penalty": 3.0}, "presence_penalty", "presence_penalty must be <= 2, got 3"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "frequency_penalty must be >= -2, got -3"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -5}, "max_tokens", "max_tokens must be >= 1, got -5"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be <= 4, got 5"),
        ({"logprobs": 21}, "logprobs", "logprobs must be <= 20, got 21"),
        ({"logprobs": -1}, "logprobs", "logprobs must be >= 0, got -1"),
        ({"stop": [""]}, "stop", "stop must not contain empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids must be >= 0, got -1"),
    ],
)
def test_bad_sampling_values(validator, params, field, message):
    error = refused(validator, ids_request([1, 2, 3], **params))
    assert (error.field, str(error)) == (field, message)
