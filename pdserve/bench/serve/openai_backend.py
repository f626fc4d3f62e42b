"""The benchmark's backend for any OpenAI-compatible HTTP server (`POST /v1/completions`, streamed).

Each request is greedy with exactly `output_len` tokens (`max_tokens` and `ignore_eos`, an
extension vLLM, SGLang and pdserve accept), its prompt the workload's token ids (or text), and
`stream_options.include_usage` so the server's own counts close the stream.

Token counts: a server-sent chunk carries one token's text on pdserve, vLLM and SGLang unless
the server fell behind (then it joins what waited), so each chunk with a choice counts one token;
when the final usage says more tokens than chunks came (a server that sent several in one
chunk), the rest are counted on the last chunk. The model's
limits come from `GET /v1/models` (`max_model_len`, as vLLM and pdserve give it, and pdserve's
`vocab_size`), or from `--max-model-len` / `--vocab-size` for a server that does not say them.
Failures are recorded under the gRPC code name of their HTTP status (429 → RESOURCE_EXHAUSTED),
so both backends' reports read alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdserve.bench.serve.client import MODEL_INFO_TIMEOUT_S, Call, ClientOptions, ServerModel
from pdserve.bench.serve.metrics import RequestTrace
from pdserve.bench.serve.workloads import ModelLimits, RequestSpec
from pdserve.router.fronts.openai_api import status_name_of_http

DATA = b"data: "


class OpenAIBackendError(ValueError):
    """The server's model list cannot give what the workload needs; the message says which flag can."""


class OpenAIBackend:
    def __init__(self, base_url: str, options: ClientOptions, model: str | None = None,
                 vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options
        self._model = model
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.auth_token}"} if self.options.auth_token else {}

    async def model(self) -> ServerModel:
        timeout = aiohttp.ClientTimeout(total=MODEL_INFO_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(f"{self.base_url}/models", headers=self._headers(),
                                ssl=self.options.ssl_context()) as response:
                if response.status != 200:
                    raise OpenAIBackendError(f"GET {self.base_url}/models: HTTP {response.status}: "
                                             f"{(await response.text())[:200]}")
                entries = (await response.json()).get("data") or []
        entry = self._pick(entries)
        self._model = entry["id"]
        vocab_size = self._vocab_size or entry.get("vocab_size")
        max_model_len = self._max_model_len or entry.get("max_model_len")
        for value, flag in ((vocab_size, "--vocab-size"), (max_model_len, "--max-model-len")):
            if not value:
                raise OpenAIBackendError(f"{self.base_url}/models does not say the model's {flag[2:]}: pass {flag}")
        record = {"backend": "openai", "base_url": self.base_url, "model": entry["id"], "vocab_size": vocab_size,
                  "max_model_len": max_model_len}
        return ServerModel(ModelLimits(int(vocab_size), int(max_model_len)), record)

    def _pick(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        names = [e.get("id") for e in entries]
        if self._model is None and entries:
            return entries[0]
        if self._model in names:
            return entries[names.index(self._model)]
        raise OpenAIBackendError(f"{self.base_url}/models lists {names}, not {self._model!r}: pass --model")

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Call]:
        # No connection limit: an open loop must never queue on the client's side.
        connector = aiohttp.TCPConnector(limit=0, ssl=self.options.ssl_context())
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers()) as http:
            async def call(spec: RequestSpec, trace: RequestTrace, start: float) -> None:
                await self._call(http, spec, trace, start)
            yield call

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        prompt = list(spec.token_ids) if spec.token_ids is not None else spec.text
        return {"model": self._model, "prompt": prompt, "max_tokens": spec.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def _call(self, http: aiohttp.ClientSession, spec: RequestSpec, trace: RequestTrace, start: float) -> None:
        trace.sent_s = time.perf_counter() - start
        try:
            async with http.post(f"{self.base_url}/completions", json=self.body(spec)) as response:
                if response.status != 200:
                    trace.status, trace.error = status_name_of_http(response.status), await _error_text(response)
                else:
                    await _read_stream(response, trace, start)
        except TimeoutError:
            trace.status, trace.error = "DEADLINE_EXCEEDED", f"no answer within {self.options.timeout_s} s"
        except Exception as err:  # noqa: BLE001 - one broken call is a failed request, not a failed run
            trace.status, trace.error = "UNKNOWN", f"{type(err).__name__}: {err}"
        trace.end_s = time.perf_counter() - start


async def _read_stream(response: aiohttp.ClientResponse, trace: RequestTrace, start: float) -> None:
    async for line in response.content:
        if not line.startswith(DATA):
            continue
        payload = line[len(DATA):].strip()
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:  # an error after the first token rides the stream
            error = chunk["error"]
            trace.status, trace.error = str(error.get("code") or "UNKNOWN"), str(error.get("message", ""))
            return
        _record(trace, chunk, time.perf_counter() - start)


def _record(trace: RequestTrace, chunk: dict[str, Any], at_s: float) -> None:
    trace.request_id = chunk.get("id", trace.request_id)
    if chunk.get("choices"):
        trace.chunks.append((at_s, 1))
    usage = chunk.get("usage")
    if usage:
        trace.input_len = usage.get("prompt_tokens", trace.input_len)
        missing = usage.get("completion_tokens", 0) - sum(count for _, count in trace.chunks)
        if missing > 0 and trace.chunks:  # a chunk that carried several tokens
            at, count = trace.chunks[-1]
            trace.chunks[-1] = (at, count + missing)


async def _error_text(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return json.loads(text)["error"]["message"]
    return text[:200]


