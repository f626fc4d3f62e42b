"""The OpenAPI 3.0 document of the router's HTTP API, served at `/openapi.json` (as vLLM's server
publishes one), written by hand from the handlers in http_server.py and the request reading in
openai_api.py: every path, the request bodies they read, every status they answer, and the
error shape (OpenAI's `{"error": {message, type, param, code}}`) of every refusal.

tests/e2e/test_openapi_fuzz.py fuzzes a running router from this document (schemathesis): a
response whose status or shape the document does not list fails it.

Must never: describe a field or a status the handlers do not read or answer.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.fronts.openai_api import HTTP_STATUS, SAMPLING_FIELDS

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


# Every error status the API answers, from the one gRPC → HTTP table (openai_api.HTTP_STATUS).
ERROR_STATUSES = sorted({status for status, _ in HTTP_STATUS.values()})


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): _json(_ref("Error"), "refused: OpenAI's error JSON") for s in statuses}


_NUMBER = {"type": "number"}
_INTEGER = {"type": "integer"}
_TOKEN_IDS = {"type": "array", "items": _INTEGER}
# Types of the sampling fields that map one to one onto the router's (openai_api.SAMPLING_FIELDS).
_SAMPLING_TYPES = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INTEGER, "min_p": _NUMBER, "seed": _INTEGER,
    "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER, "repetition_penalty": _NUMBER,
    "min_tokens": _INTEGER, "ignore_eos": {"type": "boolean"}, "stop_token_ids": _TOKEN_IDS, "n": _INTEGER,
    "prompt_logprobs": _INTEGER,
}
_COMMON_REQUEST = {
    "model": {"type": "string", "description": "must be the served model's name when given"},
    **{name: {**_SAMPLING_TYPES[name], "nullable": True} for name in SAMPLING_FIELDS},
    "max_tokens": {"type": "integer", "nullable": True},
    "max_completion_tokens": {"type": "integer", "nullable": True},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}], "nullable": True},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "nullable": True,
                       "properties": {"include_usage": {"type": "boolean"}}},
    "use_beam_search": {"type": "boolean", "description": "vLLM's: the n best of best_of beams, never streamed"},
    "best_of": {"type": "integer", "nullable": True},
    "length_penalty": {"type": "number", "nullable": True},
    # Structured output (pdserve/router/fronts/structured_fields.py): at most one constraint per request.
    "response_format": {"type": "object", "nullable": True, "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"}}}}},
    "guided_json": {"type": "object", "nullable": True, "description": "vLLM's: a JSON schema the output follows"},
    "guided_regex": {"type": "string", "nullable": True},
    "guided_choice": {"type": "array", "items": {"type": "string"}, "nullable": True},
    "guided_grammar": {"type": "string", "nullable": True, "description": "an EBNF grammar (xgrammar's dialect)"},
    "structured_outputs": {"type": "object", "nullable": True, "description": "vLLM's newer form: one of "
                           "json, regex, choice, grammar, json_object"},
}
_CHOICES = {"type": "array", "items": {"type": "object", "required": ["index"],
                                       "properties": {"index": _INTEGER}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: _INTEGER for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}

SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True,
                                 "description": "the request field at fault, when one is"},
                       "code": {"type": "string", "description": "the gRPC status code's name"}}}}},
    "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                             {**_TOKEN_IDS, "minItems": 1},
                             {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]},
        "echo": {"type": "boolean"},
        "logprobs": {"type": "integer", "nullable": True, "description": "top logprobs per token"},
        **_COMMON_REQUEST}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "nullable": True},
        **_COMMON_REQUEST}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                  "created": _INTEGER, "model": {"type": "string"}, "choices": _CHOICES,
                                  "usage": _USAGE}},
    # One server-sent event of a stream: `data:` is a chunk's JSON (a Completion with the choices'
    # new text), an error's (a refusal after the first token), or `[DONE]` at the end.
    "Event": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}},
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object", "required": ["id", "object", "max_model_len"],
                                            "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                           "max_model_len": _INTEGER, "vocab_size": _INTEGER}}}}},
}


def _generation(summary: str, request: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the completion; with `stream: true`, server-sent events "
                                             "(`data: {chunk}` ... `data: [DONE]`)",
                              "content": {JSON: {"schema": _ref("Completion")},
                                          "text/event-stream": {"schema": _ref("Event")}}},
                      **_errors(*ERROR_STATUSES)}}}


def openapi_document(version: str) -> dict[str, Any]:
    """The document, with the installed pdserve's version."""
    return {
        "openapi": "3.0.3",
        "info": {"title": "pdserve router: OpenAI-compatible HTTP API", "version": version,
                 "description": "With an auth token, every path but /health, /metrics and /openapi.json needs "
                                "`Authorization: Bearer <token>` (else 401)."},
        "paths": {
            "/v1/completions": _generation("prompts to completions", "CompletionRequest"),
            "/v1/chat/completions": _generation("messages, through the chat template, to an assistant message",
                                                "ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "the served model (503 until the router can serve a request)",
                                   "responses": {"200": _json(_ref("ModelList"), "the served model"),
                                                 **_errors(401, 503)}}},
            "/health": {"get": {"summary": "whether the router can serve a request",
                                "responses": {"200": _text("serving: <what>"), "503": _text("not serving: <why>")}}},
            "/metrics": {"get": {"summary": "Prometheus exposition of the router's series (docs/metrics.md)",
                                 "responses": {"200": _text("the series")}}},
            "/tokenize": {"post": {
                "summary": "a text's token ids",
                "requestBody": {"required": True, "content": {JSON: {"schema": {
                    "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}}},
                "responses": {"200": _json({"type": "object", "required": ["tokens", "count"],
                                            "properties": {"tokens": _TOKEN_IDS, "count": _INTEGER}}, "the ids"),
                              **_errors(400, 401)}}},
            "/detokenize": {"post": {
                "summary": "token ids' text",
                "requestBody": {"required": True, "content": {JSON: {"schema": {
                    "type": "object", "required": ["tokens"], "properties": {"tokens": _TOKEN_IDS}}}}},
                "responses": {"200": _json({"type": "object", "required": ["prompt"],
                                            "properties": {"prompt": {"type": "string"}}}, "the text"),
                              **_errors(400, 401)}}},
            "/version": {"get": {"summary": "the pdserve version",
                                 "responses": {"200": _json({"type": "object", "required": ["version"],
                                                             "properties": {"version": {"type": "string"}}},
                                                            "the version"), **_errors(401)}}},
            "/openapi.json": {"get": {"summary": "this document",
                                      "responses": {"200": _json({"type": "object"}, "the document")}}},
        },
        "components": {"schemas": SCHEMAS},
    }
