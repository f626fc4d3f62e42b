"""The HTTP fields that constrain output become the router's StructuredOutput; a bad or doubled one
is refused naming the field the client sent, with the grammar library's message."""

from __future__ import annotations

import json

import pytest

from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest
from pdserve.router.fronts.openai_api import sampling_params
from pdserve.router.fronts.structured_fields import structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     pdserve_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, pdserve_pb2.StructuredOutput(json_object=True)),
    ({"guided_json": SCHEMA}, pdserve_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, pdserve_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))),
    ({"guided_regex": "[ab]+"}, pdserve_pb2.StructuredOutput(regex="[ab]+")),
    ({"guided_choice": ["x", "y"]}, pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(options=["x", "y"]))),
    ({"guided_grammar": 'root ::= "a"'}, pdserve_pb2.StructuredOutput(grammar='root ::= "a"')),
    ({"structured_outputs": {"regex": "[0-9]"}}, pdserve_pb2.StructuredOutput(regex="[0-9]")),
    ({"structured_outputs": {"json_object": True}}, pdserve_pb2.StructuredOutput(json_object=True)),
    ({"structured_outputs": {"choice": ["p"]}}, pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(options=["p"]))),
])
def test_every_field_becomes_the_same_constraint(body, expected):
    assert structured_output(body) == expected
    assert sampling_params(body, 16).structured_output == expected


def test_no_constraint_and_text_leave_the_params_unconstrained():
    assert structured_output({}) is None
    assert structured_output({"response_format": {"type": "text"}}) is None
    assert not sampling_params({"response_format": {"type": "text"}}, 16).HasField("structured_output")


@pytest.mark.parametrize("body, field, message", [
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: Regex parsing error at position 4: Unclosed '['"),
    ({"guided_json": {"type": "objectx"}}, "guided_json", 'guided_json: Unsupported type "objectx"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", 'response_format.json_schema.schema: Unsupported type "objectx"'),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar",
     'structured_outputs.grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a list of strings"),
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "response_format.type must be text, json_object or json_schema, got 'xml'"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "at most one output constraint per request, got guided_regex, guided_choice"),
])
def test_a_bad_or_doubled_constraint_is_refused_naming_the_field(body, field, message):
    with pytest.raises(InvalidRequest) as info:
        structured_output(body)
    assert info.value.field == field
    assert str(info.value) == message


def test_the_generate_client_sends_its_constraint_flags():
    from pdserve.router.fronts.client import _parser, build_request

    def sent(*flags: str) -> pdserve_pb2.StructuredOutput:
        return build_request(_parser().parse_args(["hi", *flags])).sampling_params.structured_output

    assert sent("--regex", "[ab]+") == pdserve_pb2.StructuredOutput(regex="[ab]+")
    assert sent("--choice", "x", "--choice", "y").choice.options == ["x", "y"]
    assert sent("--json-object") == pdserve_pb2.StructuredOutput(json_object=True)
    assert sent("--json-schema", '{"type": "object"}') == pdserve_pb2.StructuredOutput(json_schema='{"type": "object"}')
    assert not build_request(_parser().parse_args(["hi"])).sampling_params.HasField("structured_output")
