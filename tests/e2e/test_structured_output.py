"""Structured output served by a real cluster (`pdserve cluster`), colocated and 1P1D.

On the random-weight tiny model only the grammar makes output valid, so:
- HTTP `response_format` json_schema (n > 1, seeded) and vLLM's `guided_json` streamed in a chat:
  every answer parses and validates against its schema;
- gRPC `sampling_params.structured_output`, float32 greedy: the tokens equal transformers
  `generate` with xgrammar's HF logits processor on the same grammar (on 1P1D token 1 is sampled
  by the prefill node under the grammar, the rest by the decode node from its replayed matcher);
- a bad regex is INVALID_ARGUMENT / 400 naming the field and the library's message; beam search
  with a constraint is refused naming structured_output.
After each test no node holds a block.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import openai
import pytest

from pdserve.engine.structured_output import StructuredOutput
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from pdserve.proto.convert import structured_to_proto
from tests.e2e.pair_clusters import cluster, model_dir, no_blocks_left  # noqa: F401  (fixtures)
from tests.integration.reference import constrained_references

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
}
PROMPTS = [[5, 17, 99, 3, 44, 8, 21, 7, 60, 13, 2], list(range(1, 20))]


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.state.http, api_key="unused", max_retries=0)


def grpc_generate(router: str, request: pdserve_pb2.GenerateRequest) -> list[pdserve_pb2.GenerateResponse]:
    async def run():
        async with grpc.aio.insecure_channel(router) as channel:
            return [r async for r in pdserve_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]
    return asyncio.run(run())


def test_http_json_schema_answers_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    whole = client.completions.create(model="tiny", prompt=["Tell me about", "x"], max_tokens=96, n=3,
                                      temperature=1.0, seed=7, extra_body={"response_format": fmt})
    assert len(whole.choices) == 6
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    again = client.completions.create(model="tiny", prompt=["Tell me about", "x"], max_tokens=96, n=3,
                                      temperature=1.0, seed=7, extra_body={"response_format": fmt})
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]


def test_http_guided_json_streamed_in_a_chat_parses_and_validates(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=96, temperature=0, stream=True,
                                            extra_body={"guided_json": SCHEMA})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("structured", [StructuredOutput.json_schema(SCHEMA),
                                        StructuredOutput.regex(r"(cat|dog)s? [0-9]{1,3}!"),
                                        StructuredOutput.grammar('root ::= "(" [a-z]+ ("," [a-z]+)? ")"')],
                         ids=["json_schema", "regex", "grammar"])
def test_grpc_greedy_tokens_equal_transformers_with_the_libraries_processor(cluster, model_dir, structured):
    expected = constrained_references(model_dir, PROMPTS, structured, 64)
    for prompt, tokens in zip(PROMPTS, expected):
        params = pdserve_pb2.SamplingParams(temperature=0.0, max_tokens=64,
                                            structured_output=structured_to_proto(structured))
        responses = grpc_generate(cluster.router, pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling_params=params))
        assert [t for r in responses for t in r.token_ids] == tokens
        assert responses[-1].finish_reason == (pdserve_pb2.FINISH_REASON_STOP if len(tokens) < 64
                                               else pdserve_pb2.FINISH_REASON_LENGTH)


def test_a_bad_regex_is_refused_by_name_on_both_apis(cluster, client):
    params = pdserve_pb2.SamplingParams(structured_output=pdserve_pb2.StructuredOutput(regex="[a-"))
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(cluster.router, pdserve_pb2.GenerateRequest(text="x", sampling_params=params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "structured_output.regex: Regex parsing error at position 4: Unclosed '['"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    assert bad.value.body["param"] == "guided_regex"
    assert bad.value.body["message"] == "guided_regex: Regex parsing error at position 4: Unclosed '['"


def test_beam_search_with_a_constraint_is_refused_by_name(cluster):
    params = pdserve_pb2.SamplingParams(max_tokens=4, structured_output=pdserve_pb2.StructuredOutput(regex="a+"))
    request = pdserve_pb2.GenerateRequest(text="x", sampling_params=params,
                                          beam_search=pdserve_pb2.BeamSearch(beam_width=2))
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(cluster.router, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "structured_output cannot be honoured by beam search: leave it unset"
