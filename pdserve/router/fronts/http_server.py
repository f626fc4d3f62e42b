"""The router's OpenAI-compatible HTTP front: same process, same event loop as its gRPC server.

    POST /v1/completions        prompt(s) → choices; `stream: true` → server-sent events
    POST /v1/chat/completions   messages → the chat template → one assistant message per choice
                                (both: vLLM's `use_beam_search` with `best_of`/`n`, `length_penalty`:
                                the n best beams as the choices, best first; never streamed)
    GET  /v1/models             the served model (`--served-model-name`, default the folder's name);
                                503 (OpenAI's error JSON) while the router cannot serve yet
    GET  /health                200 while the router can serve (a colocated node, or both kinds),
                                else 503 with the reason: the router's one verdict (`health`)
    GET  /metrics               Prometheus: the router's registry, the same series as --metrics-port
                                (vLLM serves /metrics on its API port too)
    POST /tokenize, /detokenize, GET /version
    GET  /openapi.json          the OpenAPI document of these paths (pdserve/router/fronts/openapi.py)

Every request becomes the router's own `GenerateRequest`s (pdserve/router/fronts/openai_api.py) and runs
through `RequestRunner` — the same validation, admission, deadlines, failover and cancellation
as gRPC: a client that disconnects cancels its handler, which cancels the request on every node.
Errors are OpenAI's JSON with the HTTP status of the gRPC code (400 naming `param`, 401, 404,
429 with Retry-After, 503, 504). With an auth token, every path but /health, /metrics (what
probes and Prometheus ask, as on the metrics port) and /openapi.json needs `Authorization:
Bearer <token>`, the token being the node join credential or one of the router's client API
keys (pdserve/common/auth.py `Credentials`).

aiohttp because it runs on an event loop that is already running (the router's uvloop),
without a server of its own to start.

Must never: validate, admit or place a request itself (RequestRunner does), or block the loop.
"""

from __future__ import annotations

import asyncio
import ssl
import json
import uuid
from dataclasses import dataclass
from importlib.metadata import version
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdserve.common.auth import Credentials
from pdserve.common.metrics_endpoint import HealthCheck
from pdserve.engine.structured_output import library_loaded, load_library
from pdserve.proto import pdserve_pb2
from pdserve.router.fronts import openai_api as oa
from pdserve.router.fronts.openapi import openapi_document
from pdserve.router.fronts.structured_fields import constrains
from pdserve.router.errors import InvalidRequest, NotReady, RouterError
from pdserve.router.requests.merge import merged

RETRY_AFTER_S = "1"
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")  # answered without the token
HTTP_SERVICE = "the HTTP API"  # every path is public: an API key opens each one
# Compact JSON, one encoder for every chunk (json.dumps with options builds one per call).
_encode = json.JSONEncoder(separators=(",", ":")).encode
Runner = Callable[[pdserve_pb2.GenerateRequest], AsyncIterator[pdserve_pb2.GenerateResponse]]


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP front says of the model and renders prompts with."""

    name: str  # `--served-model-name`: the only `model` a request may name
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    chat_template: str | None = None  # `--chat-template`: instead of the tokenizer's own


class HTTPFront:
    def __init__(self, run: Runner, model: ServedModel, health: HealthCheck, credentials: Credentials | None = None,
                 metrics: CollectorRegistry | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        """`health`: whether the router serves (a client waiting on /v1/models or /health waits for it);
        `metrics`: the registry /metrics serves (None: an empty one); `ssl_context`: serve HTTPS
        with it (pdserve/common/tls.py; None: plain HTTP)."""
        self._ssl_context = ssl_context
        self._run = run
        self._model = model
        self._tokenizer = model.tokenizer
        self._served_name = model.name
        self._health = health
        self._metrics = metrics if metrics is not None else CollectorRegistry()
        self._credentials = credentials  # None: no check
        self._template = model.chat_template
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth])
        app.add_routes([web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics), web.get("/openapi.json", self.openapi),
                        web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                        web.get("/version", self.version)])
        return app

    async def start(self, host: str, port: int) -> int:
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, reuse_port=False, ssl_context=self._ssl_context).start()
        return self._runner.addresses[0][1]  # the bound port (the OS's pick for 0)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- middlewares -------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RouterError as exc:
            return _error_response(exc)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._credentials is not None and request.path not in OPEN_PATHS:
            refusal = self._credentials.refusal(HTTP_SERVICE, request.headers.get("Authorization"))
            if refusal is not None:  # the public API takes an API key or the node credential alike
                return web.json_response({"error": {"message": "missing or wrong auth token: send "
                                                    "'Authorization: Bearer <token>'", "type": "authentication_error",
                                                    "param": None, "code": "UNAUTHENTICATED"}}, status=401)
        return await handler(request)

    # -- the simple routes -------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        # What OpenAI clients poll to wait for a server: only a server that can run a request lists.
        verdict = self._health()
        if not verdict.serving:
            raise NotReady(verdict.reason)
        # max_model_len as vLLM gives it; vocab_size too, so a benchmark can draw prompt token ids.
        return web.json_response({"object": "list", "data": [
            {"id": self._served_name, "object": "model", "created": 0, "owned_by": "pdserve",
             "max_model_len": self._model.max_model_len, "vocab_size": self._model.vocab_size}]})

    async def health(self, request: web.Request) -> web.Response:
        verdict = self._health()
        return web.Response(status=200 if verdict.serving else 503,
                            text=f"{'serving' if verdict.serving else 'not serving'}: {verdict.reason}\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._metrics), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(version("pdserve")))

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version("pdserve")})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt", "prompt must be a string")
        ids = self._tokenizer.encode(prompt)
        return web.json_response({"tokens": ids, "count": len(ids)})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _json(request)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(oa.token_id(t) for t in tokens):
            raise InvalidRequest("tokens", "tokens must be a list of token ids")
        oa.check_token_ids("tokens", tokens, self._model.vocab_size)
        return web.json_response({"prompt": self._tokenizer.decode(tokens)})

    # -- generation ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        oa.check_model(body, self._served_name)
        await _grammar_library_ready(body)
        params = oa.sampling_params(body, oa.DEFAULT_COMPLETION_MAX_TOKENS)
        beam = oa.beam_search(body, params)
        prompts = oa.completion_prompts(body)
        for prompt in prompts:
            if not isinstance(prompt, str):
                oa.check_token_ids("prompt", prompt, self._model.vocab_size)
        echoes = oa.echoes(body, prompts, self._tokenizer)
        requests = [oa.generate_request(p, params, beam) for p in prompts]
        n = max(1, params.n or 1)
        shows_scores = params.HasField("prompt_logprobs")
        tokenizer = self._tokenizer

        def prompt_part(echo: oa.Echo, scored) -> dict[str, Any]:
            """The prompt's share of a choice: `echo`'s text (and scored tokens), `prompt_logprobs`."""
            part: dict[str, Any] = {"text": echo.text, "logprobs": None}
            if echo.first_token_id is not None:
                part["logprobs"] = oa.echoed_logprobs(echo.first_token_id, scored, tokenizer)
            if shows_scores:
                part["prompt_logprobs"] = oa.prompt_logprobs(scored, tokenizer) if scored else None
            return part

        def make_choice(choice: oa.Choice, delta: pdserve_pb2.GenerateResponse | None) -> dict[str, Any]:
            if delta is not None:  # a stream's chunk: this token's text
                return {"index": choice.index, "text": delta.text,
                        "logprobs": oa.completion_logprobs(delta.logprobs, tokenizer),
                        "finish_reason": oa.FINISH_REASONS.get(delta.finish_reason)}
            prompt = prompt_part(echoes[choice.index // n], choice.prompt_logprobs or [])
            return {"index": choice.index, **prompt, "text": prompt["text"] + choice.text,
                    "logprobs": oa.joined_logprobs(prompt["logprobs"],
                                                   oa.completion_logprobs(choice.logprobs or [], tokenizer)),
                    "finish_reason": choice.finish_reason}

        def opening(index: int, delta: pdserve_pb2.GenerateResponse) -> dict[str, Any] | None:
            """A stream's first chunk of a choice: the echoed prompt, and the prompt's scores (which
            come with the prompt's first sample)."""
            echo = echoes[index // n]
            if not echo.text and not delta.prompt_logprobs:
                return None
            return {"index": index, **prompt_part(echo, list(delta.prompt_logprobs)), "finish_reason": None}
        return await self._answer(request, body, requests, "text_completion", make_choice, opening)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        oa.check_model(body, self._served_name)
        await _grammar_library_ready(body)
        params = oa.sampling_params(body, None)
        beam = oa.beam_search(body, params)
        prompt = oa.chat_prompt(body, self._tokenizer, self._template)
        requests = [oa.generate_request(prompt, params, beam)]

        def opening(index: int, delta) -> dict[str, Any]:  # a chat choice's stream opens with its role
            return {"index": index, "delta": {"role": "assistant"}, "finish_reason": None}
        return await self._answer(request, body, requests, "chat.completion", self._chat_choice, opening)

    def _chat_choice(self, choice: oa.Choice, delta: pdserve_pb2.GenerateResponse | None) -> dict[str, Any]:
        if delta is None:
            return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                    "logprobs": oa.chat_logprobs(choice.logprobs or [], self._tokenizer),
                    "finish_reason": choice.finish_reason}
        return {"index": choice.index, "delta": {"content": delta.text},
                "logprobs": oa.chat_logprobs(delta.logprobs, self._tokenizer),
                "finish_reason": oa.FINISH_REASONS.get(delta.finish_reason)}

    async def _answer(self, request, body, requests, kind, make_choice, opening) -> web.StreamResponse:
        """`make_choice(choice, delta)`: a whole choice (delta None) or a stream chunk's; `opening(choice
        index, its first response)`: what a streamed choice starts with before its first token (a chat's
        role, an echoed prompt), as a chunk's choice; None: nothing."""
        request_id = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        n = max(1, requests[0].sampling_params.n or 1)
        # Every prompt's request at once; leaving early (a disconnect, an error) cancels them all.
        # One prompt needs no merging: its responses are read in this task, without a queue.
        events = (_prompt_responses(self._run, 0, requests[0], n) if len(requests) == 1 else
                  merged([_prompt_producer(self._run, i, r, n) for i, r in enumerate(requests)]))
        if body.get("stream"):
            include_usage = oa.include_usage(body)
            return await self._stream(request, events, request_id, kind, make_choice, opening,
                                      oa.UsageTally(n) if include_usage else None)
        choices = [oa.Choice(i) for i in range(len(requests) * n)]
        usage = oa.UsageTally(n)
        async for index, response in events:
            choices[index].add(response)
            usage.add(index, response)
        for choice in choices:  # a prompt's scores come with its first sample: every sample shows them
            choice.prompt_logprobs = choices[choice.index - choice.index % n].prompt_logprobs
        return web.json_response({**oa.envelope(kind, request_id, self._served_name),
                                  "choices": [make_choice(c, None) for c in choices],
                                  "usage": usage.as_dict()})

    async def _stream(self, request, events, request_id, kind, make_choice, opening,
                      usage: oa.UsageTally | None) -> web.StreamResponse:
        """`usage`: counted and sent as the last chunk (`stream_options.include_usage`), or None."""
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        head = oa.envelope(chunk_kind, request_id, self._served_name)
        opened: set[int] = set()  # choices whose opening chunk is sent
        try:
            first_event = await anext(events)  # a refusal before any token is an HTTP error, not a stream
        except StopAsyncIteration:
            first_event = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunks = _ChunkWriter(response, head)
        try:
            pending = [first_event] if first_event is not None else []
            async for event in _chain(pending, events):
                index, delta = event
                if index not in opened:
                    opened.add(index)
                    if (first := opening(index, delta)) is not None:
                        await chunks.choice(first)
                await chunks.choice(make_choice(oa.Choice(index), delta))
                if usage is not None:
                    usage.add(index, delta)
            if usage is not None:
                await _send(response, {**head, "choices": [], "usage": usage.as_dict()})
        except RouterError as exc:  # after the first token the status is sent: the error rides the stream
            await _send(response, oa.error_of(exc).body)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class _ChunkWriter:
    """A stream's `data: {envelope..., "choices": [choice]}` events, the envelope encoded once:
    the same bytes `_send` writes for `{**head, "choices": [choice]}`."""

    def __init__(self, response: web.StreamResponse, head: dict[str, Any]) -> None:
        self._response = response
        self._prefix = b"data: " + _encode(head)[:-1].encode() + b',"choices":['

    async def choice(self, choice: dict[str, Any]) -> None:
        await self._response.write(self._prefix + _encode(choice).encode() + b"]}\n\n")


async def _prompt_responses(run: Runner, prompt_index: int, request: pdserve_pb2.GenerateRequest, n: int):
    """One prompt's responses as (choice index, response); choice = prompt × n + sample."""
    async for response in run(request):
        yield prompt_index * n + response.index, response


def _prompt_producer(run: Runner, prompt_index: int, request: pdserve_pb2.GenerateRequest, n: int):
    """One prompt's responses, put as `_prompt_responses` yields them (one producer of a merge)."""
    async def produce(put) -> None:
        async for item in _prompt_responses(run, prompt_index, request, n):
            put(item)
    return produce


async def _chain(first: list, rest: AsyncIterator):
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + _encode(payload).encode() + b"\n\n")


async def _grammar_library_ready(body: dict[str, Any]) -> None:
    """The grammar library's first import (seconds) in a thread, not on the loop every stream shares."""
    if constrains(body) and not library_loaded():
        await asyncio.to_thread(load_library)


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("body", "body must be JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("body", "body must be a JSON object")
    return body


def _error_response(exc: RouterError) -> web.Response:
    error = oa.error_of(exc)
    headers = {"Retry-After": RETRY_AFTER_S} if error.status == 429 else None
    return web.json_response(error.body, status=error.status, headers=headers)
