"""The HTTP API of a real cluster (`pdserve cluster`) holds to its own OpenAPI document under a
property-based fuzz (schemathesis' Python API, from the document the router serves at
/openapi.json):

- every operation, with bodies that fit the document and bodies that do not;
- every response has a status the document lists for it, its content type and its schema —
  a refusal is OpenAI's error JSON — and no response is a 500;
- the server still serves a normal request afterwards, with the same tokens as before the
  fuzz, and no node holds a block.

Generation lengths are bounded (`bounded`) so the run fits the suite; the limits themselves
are tested elsewhere (tests/e2e/test_openai_http.py, tests/unit/test_http_front.py).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from tests.e2e.cluster import NodeSettings, assert_every_block_free, running_cluster

EXAMPLES = 100  # per operation and mode: seeded (derandomized), so every run sends the same cases
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
TEXT_PATHS = {"/health", "/metrics"}  # plain-text answers; every other refusal is OpenAI's error JSON
# Fields bounded so that one case generates a few tokens, not thousands (value caps).
CAPS = {"max_tokens": 6, "max_completion_tokens": 6, "min_tokens": 6, "n": 2, "best_of": 2}
MAX_PROMPTS = 3


@pytest.fixture(scope="module")
def cluster(tiny_model):
    with running_cluster(str(tiny_model), 1, 1, NodeSettings()) as running:
        yield running


def bounded(body: object) -> object:
    if not isinstance(body, dict):
        return body
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    return body


def fuzz(operation, mode: GenerationMode, base_url: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case) -> None:
        case.body = bounded(case.body)
        response = case.call(base_url=base_url, timeout=60)
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400 and operation.path not in TEXT_PATHS:
            error = response.json()["error"]
            assert error["code"] and error["message"], error

    one()


def complete(http: str) -> dict:
    body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{http}/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_the_api_holds_to_its_openapi_document_under_fuzzing(cluster):
    http = cluster.state.http
    before = complete(http)
    base_url = http.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                               "POST /tokenize", "POST /detokenize"}, [op.label for op in operations]
    for operation in operations:
        fuzz(operation, GenerationMode.POSITIVE, base_url)
        if operation.body:  # only a request body can be made not to fit
            fuzz(operation, GenerationMode.NEGATIVE, base_url)

    after = complete(http)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["usage"]["completion_tokens"] == 8
    assert_every_block_free(cluster)
