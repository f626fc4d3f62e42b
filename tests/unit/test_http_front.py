"""The OpenAI-compatible HTTP front on a real aiohttp server, over a fake request runner (the
seam to the router's `RequestRunner`): OpenAI's shapes, SSE framing, error JSON and statuses,
the token, and that a client leaving mid-stream ends the request."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.common.metrics_endpoint import Health
from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest, NoNodeAvailable, Overloaded
from pdserve.common.auth import Credentials
from pdserve.router.fronts.http_server import HTTPFront, ServedModel


class Tokenizer:
    chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages) + ">"


class FakeRunner:
    """Answers each sample with its prompt's characters, one token per response; or raises."""

    def __init__(self, error=None) -> None:
        self.error = error
        self.requests: list[pdserve_pb2.GenerateRequest] = []
        self.cancelled = asyncio.Event()

    async def run(self, request):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        ids = list(request.token_ids.ids) if request.HasField("token_ids") else [ord(c) for c in request.text]
        n = request.sampling_params.n or 1
        out = ids[: request.sampling_params.max_tokens or 16]
        try:
            for position, token in enumerate(out):
                for index in range(n):
                    last = position == len(out) - 1
                    yield pdserve_pb2.GenerateResponse(
                        index=index, token_ids=[token], text=chr(token),
                        finish_reason=pdserve_pb2.FINISH_REASON_LENGTH if last else 0,
                        usage=pdserve_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(out)) if last else None)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


NO_ROUTE = "no route for a request yet"


def front(runner: FakeRunner, token: str | None = None, serving: bool = True) -> HTTPFront:
    verdict = Health(True, "router on 127.0.0.1:1") if serving else Health(False, NO_ROUTE)
    return HTTPFront(runner.run, ServedModel("tiny", Tokenizer(), max_model_len=64, vocab_size=256), lambda: verdict,
                     Credentials(token) if token else None)


async def client_of(http: HTTPFront) -> TestClient:
    client = TestClient(TestServer(http.app()))
    await client.start_server()
    return client


def run(coro):
    return asyncio.run(coro)


def test_completions_for_several_prompts_and_samples_number_the_choices_prompt_by_sample():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": ["ab", [120, 121, 122]],
                                                               "max_tokens": 3, "n": 2})
            return resp.status, await resp.json()

    status, body = run(go())
    assert status == 200 and body["object"] == "text_completion" and body["model"] == "tiny"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "length"), (1, "ab", "length"), (2, "xyz", "length"), (3, "xyz", "length")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 10, "total_tokens": 15}


def test_a_chat_stream_is_openais_sse_opening_with_the_role_and_ending_with_done():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            resp = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5,
                "stream_options": {"include_usage": True}})
            return resp.status, resp.headers["Content-Type"], await resp.text()

    status, content_type, text = run(go())
    assert status == 200 and content_type.startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hi>"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("error,status,code", [
    (InvalidRequest("top_p", "top_p must be in (0, 1], got 7"), 400, "INVALID_ARGUMENT"),
    (Overloaded("every decode node is full"), 429, "RESOURCE_EXHAUSTED"),
    (NoNodeAvailable("no decode node is available"), 503, "UNAVAILABLE"),
])
def test_router_errors_are_openai_error_json_with_the_mapped_status(error, status, code):
    async def go():
        async with await client_of(front(FakeRunner(error))) as client:
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
            return resp.status, resp.headers.get("Retry-After"), await resp.json()

    got, retry_after, body = run(go())
    assert got == status and body["error"]["code"] == code and body["error"]["message"] == str(error)
    assert body["error"]["param"] == ("top_p" if status == 400 else None)
    assert retry_after == ("1" if status == 429 else None)


def test_bad_bodies_and_unknown_models_are_refused_naming_what_is_wrong():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            answers = []
            for path, body in (("/v1/completions", {"prompt": 5}), ("/v1/chat/completions", {"messages": []}),
                               ("/v1/completions", {"prompt": "x", "model": "gpt-4"}),
                               ("/v1/completions", {"prompt": "x", "temperature": "hot"})):
                resp = await client.post(path, json=body)
                answers.append((resp.status, (await resp.json())["error"]["param"]))
            resp = await client.post("/v1/completions", data=b"not json")
            answers.append((resp.status, (await resp.json())["error"]["param"]))
            return answers

    assert run(go()) == [(400, "prompt"), (400, "messages"), (404, None), (400, "temperature"), (400, "body")]


def test_what_the_fuzz_found_is_a_400_naming_the_field_not_a_500():
    """Bodies tests/e2e/test_openapi_fuzz.py found answered 500, or that failed the same way."""
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            answers = []
            for path, body in (("/v1/completions", {"prompt": [[65, -4666188342272892577251328]]}),
                               ("/v1/completions", {"prompt": [256], "echo": True}),
                               ("/detokenize", {"tokens": [685995912]}),
                               ("/detokenize", {"tokens": [-1]}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "logprobs": True, "top_logprobs": "many"}),
                               ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": [1]}),
                               ("/v1/completions", {"prompt": [True, True, False], "top_p": True}),
                               ("/detokenize", {"tokens": [True]})):
                resp = await client.post(path, json=body)
                error = (await resp.json())["error"]
                answers.append((resp.status, error["param"], error["message"]))
            return answers

    assert run(go()) == [
        (400, "prompt", "prompt contains -4666188342272892577251328, outside the vocabulary [0, 256)"),
        (400, "prompt", "prompt contains 256, outside the vocabulary [0, 256)"),
        (400, "tokens", "tokens contains 685995912, outside the vocabulary [0, 256)"),
        (400, "tokens", "tokens contains -1, outside the vocabulary [0, 256)"),
        (400, "top_logprobs", "top_logprobs must be an integer"),
        (400, "stream_options", "stream_options must be an object"),
        (400, "prompt", "prompt must be a string, a list of strings, a list of token ids, or a list of such lists"),
        (400, "tokens", "tokens must be a list of token ids"),
    ]


def test_the_openapi_document_describes_every_route_and_is_served_without_the_token():
    async def go():
        http = front(FakeRunner(), token="s3cret")
        routes = {(r.method, r.resource.canonical) for r in http.app().router.routes() if r.method != "HEAD"}
        async with await client_of(http) as client:
            resp = await client.get("/openapi.json")
            return routes, resp.status, await resp.json()

    routes, status, document = run(go())
    assert status == 200 and document["openapi"] == "3.0.3"
    assert {(method.upper(), path) for path, item in document["paths"].items() for method in item} == routes
    error = document["components"]["schemas"]["Error"]["properties"]["error"]
    assert error["required"] == ["message", "type", "param", "code"]


def test_the_token_guards_every_path_but_health_and_metrics():
    async def go():
        async with await client_of(front(FakeRunner(), token="s3cret", serving=False)) as client:
            no = await client.get("/version")
            wrong = await client.get("/version", headers={"Authorization": "Bearer nope"})
            right = await client.get("/version", headers={"Authorization": "Bearer s3cret"})
            health = await client.get("/health")
            metrics = await client.get("/metrics")
            return no.status, wrong.status, right.status, health.status, metrics.status

    assert run(go()) == (401, 401, 200, 503, 200)


def test_models_and_health_say_not_ready_until_the_router_can_serve():
    async def go(serving: bool):
        async with await client_of(front(FakeRunner(), serving=serving)) as client:
            models = await client.get("/v1/models")
            health = await client.get("/health")
            return models.status, await models.json(), health.status, await health.text()

    status, body, health_status, health_text = run(go(False))
    assert (status, health_status, health_text) == (503, 503, f"not serving: {NO_ROUTE}\n")
    assert body == {"error": {"message": NO_ROUTE, "type": "service_unavailable", "param": None,
                              "code": "UNAVAILABLE"}}
    status, body, health_status, health_text = run(go(True))
    assert (status, body["data"][0]["id"], health_status, health_text) == (200, "tiny", 200,
                                                                           "serving: router on 127.0.0.1:1\n")


def test_a_client_that_leaves_mid_stream_cancels_the_request():
    runner = FakeRunner()

    async def go():
        async with await client_of(front(runner)) as client:
            resp = await client.post("/v1/completions", json={"prompt": [65] * 10_000, "max_tokens": 10_000,
                                                               "stream": True})
            await resp.content.readline()
            resp.close()  # the client goes away
            await asyncio.wait_for(runner.cancelled.wait(), timeout=10)

    run(go())


def test_echo_puts_each_prompt_before_its_completion_whole_and_streamed():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            whole = await client.post("/v1/completions", json={"prompt": ["ab", [120, 121]], "max_tokens": 2,
                                                                "echo": True})
            streamed = await client.post("/v1/completions", json={"prompt": "cd", "max_tokens": 2, "echo": True,
                                                                   "stream": True})
            bad = await client.post("/v1/completions", json={"prompt": "cd", "echo": "yes"})
            return await whole.json(), await streamed.text(), bad.status, (await bad.json())["error"]["param"]

    whole, streamed, bad_status, bad_param = run(go())
    assert [c["text"] for c in whole["choices"]] == ["abab", "xyxy"]
    chunks = [json.loads(e.removeprefix("data: ")) for e in streamed.split("\n\n") if e and e != "data: [DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == ["cd", "c", "d"]
    assert (bad_status, bad_param) == (400, "echo")


def test_models_says_the_length_and_vocabulary_a_benchmark_needs():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            return await (await client.get("/v1/models")).json()

    (entry,) = run(go())["data"]
    assert (entry["id"], entry["max_model_len"], entry["vocab_size"]) == ("tiny", 64, 256)


def test_use_beam_search_sends_the_width_and_penalty_and_refuses_a_stream():
    async def go(body):
        runner = FakeRunner()
        async with await client_of(front(runner)) as client:
            resp = await client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, **body})
            return resp.status, await resp.json(), runner.requests

    status, out, (request,) = run(go({"use_beam_search": True, "n": 2, "best_of": 4, "length_penalty": 0.5}))
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
    assert (request.beam_search.beam_width, request.beam_search.length_penalty, request.sampling_params.n) == \
        (4, 0.5, 2)
    _, _, (request,) = run(go({"use_beam_search": True}))
    assert (request.beam_search.beam_width, request.beam_search.HasField("length_penalty"),
            request.sampling_params.n) == (1, False, 1)
    _, _, (request,) = run(go({}))
    assert not request.HasField("beam_search")
    status, out, requests = run(go({"use_beam_search": True, "stream": True}))
    assert status == 400 and out["error"]["param"] == "stream" and not requests
    status, out, _ = run(go({"use_beam_search": "yes"}))
    assert status == 400 and out["error"]["param"] == "use_beam_search"


def test_a_streamed_answer_for_several_prompts_counts_every_prompts_tokens_once():
    async def go():
        async with await client_of(front(FakeRunner())) as client:
            resp = await client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "max_tokens": 2, "n": 2,
                                                               "stream": True, "stream_options": {"include_usage": True}})
            return await resp.text()

    chunks = [json.loads(e.removeprefix("data: ")) for e in run(go()).split("\n\n") if e and e != "data: [DONE]"]
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
