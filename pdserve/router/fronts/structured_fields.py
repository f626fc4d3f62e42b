"""The HTTP fields that constrain a completion's output, as the router's `StructuredOutput`.

OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}`, `{"type": "text"}`), vLLM's `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` and its newer `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`, `json_object`). At most one constraint per request. Each is checked here with
the grammar library, so a bad one is a 400 naming the field the client sent and the library's
message (the router checks it again for gRPC callers under `structured_output.<kind>`).

Pure functions: no network, no event loop.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.structured_output import StructuredOutput, grammar_of
from pdserve.proto import pdserve_pb2
from pdserve.proto.convert import structured_to_proto
from pdserve.router.errors import InvalidRequest

_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}


def constrains(body: dict[str, Any]) -> bool:
    """Does the body name an output constraint (so the grammar library is needed to check it)?"""
    return any(body.get(name) is not None for name in ("response_format", *_GUIDED, "structured_outputs"))


def structured_output(body: dict[str, Any]) -> pdserve_pb2.StructuredOutput | None:
    """The request's constraint, or None; InvalidRequest naming the field when malformed or doubled."""
    found = [*_response_format(body), *_guided(body), *_structured_outputs(body)]
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise InvalidRequest(names[1], f"at most one output constraint per request, got {', '.join(names)}")
    name, structured = found[0]
    try:
        grammar_of(structured)
    except ValueError as exc:
        message = str(exc).split(": ", 1)[-1]
        raise InvalidRequest(name, f"{name}: {message}") from None
    return structured_to_proto(structured)


def _response_format(body: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    value = body.get("response_format")
    if value is None:
        return []
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", StructuredOutput.json_object())]
    if kind != "json_schema":
        raise InvalidRequest("response_format.type", "response_format.type must be text, json_object or "
                                                     f"json_schema, got {kind!r}")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest("response_format.json_schema.schema",
                             "response_format.json_schema.schema must be a JSON schema object")
    return [("response_format.json_schema.schema", StructuredOutput.json_schema(json.dumps(schema)))]


def _guided(body: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    return [(name, _constraint(name, kind, body[name])) for name, kind in _GUIDED.items()
            if body.get(name) is not None]


def _structured_outputs(body: dict[str, Any]) -> list[tuple[str, StructuredOutput]]:
    value = body.get("structured_outputs")
    if value is None:
        return []
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs", "structured_outputs must be an object")
    found = []
    for key, kind in _STRUCTURED_OUTPUTS.items():
        item = value.get(key)
        if item is None or (kind == "json_object" and item is False):
            continue
        found.append((f"structured_outputs.{key}", _constraint(f"structured_outputs.{key}", kind, item)))
    return found


def _constraint(name: str, kind: str, value: Any) -> StructuredOutput:
    """One field's value as a constraint of `kind`; InvalidRequest naming it when mistyped."""
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(name, f"{name} must be true or false")
        return StructuredOutput.json_object()
    if kind == "json_schema":
        if isinstance(value, str):
            return StructuredOutput.json_schema(value)
        if isinstance(value, (dict, bool)):
            return StructuredOutput.json_schema(json.dumps(value))
        raise InvalidRequest(name, f"{name} must be a JSON schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise InvalidRequest(name, f"{name} must be a list of strings")
        return StructuredOutput.choice(value)
    if not isinstance(value, str):
        raise InvalidRequest(name, f"{name} must be a string")
    return StructuredOutput(kind, value)
