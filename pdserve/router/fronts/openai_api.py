"""OpenAI's request and response shapes, translated to and from the router's own.

A `/v1/completions` or `/v1/chat/completions` body becomes one `GenerateRequest` per prompt
(the router's public gRPC request), so HTTP requests take the same validation, admission,
deadlines, failover and cancellation as gRPC ones; chat messages become a prompt through the
tokenizer's chat template. Router responses become OpenAI's objects and stream chunks; a
router error becomes OpenAI's error JSON with the HTTP status its gRPC code maps to.

Pure functions: no network, no event loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest, ModelNotFound, NeedsNodes, status_of
from pdserve.router.fronts.structured_fields import structured_output

FINISH_REASONS = {pdserve_pb2.FINISH_REASON_STOP: "stop", pdserve_pb2.FINISH_REASON_LENGTH: "length",
                  pdserve_pb2.FINISH_REASON_ABORT: "abort"}
# OpenAI's sampling fields that map one to one onto the router's.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "n", "prompt_logprobs")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    # A request this cluster cannot run as it stands (beam search, no colocated node): vLLM answers
    # an unsupported option 400, which the OpenAI client raises as BadRequestError.
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}




def status_name_of_http(status: int) -> str:
    """The gRPC code's name an HTTP status answers for (HTTP_STATUS read backwards, the first code
    that maps to it); `HTTP_<n>` otherwise."""
    for code, (http_status, _) in HTTP_STATUS.items():
        if http_status == status:
            return code.name
    return f"HTTP_{status}"


@dataclass(frozen=True)
class HTTPError:
    status: int
    body: dict[str, Any]


def error_of(error: BaseException) -> HTTPError:
    """OpenAI's error JSON and the HTTP status for a router error (500 for anything unexpected)."""
    code, message = status_of(error)
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    param = error.field if isinstance(error, (InvalidRequest, NeedsNodes)) else None
    return HTTPError(status, {"error": {"message": message, "type": kind, "param": param, "code": code.name}})


def check_model(body: dict[str, Any], served_name: str) -> None:
    model = body.get("model")
    if model is not None and model != served_name:
        raise ModelNotFound(f"model {model!r} is not served here; this server serves {served_name!r}")


def token_id(value: Any) -> bool:
    """A JSON integer (JSON's true and false arrive as Python bools, which are ints too)."""
    return isinstance(value, int) and not isinstance(value, bool)


def sampling_params(body: dict[str, Any], default_max_tokens: int | None) -> pdserve_pb2.SamplingParams:
    """The router's sampling params from OpenAI's fields; a wrongly typed field is refused by name."""
    params = pdserve_pb2.SamplingParams()
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        try:
            if name == "stop_token_ids":
                params.stop_token_ids.extend(value)
            else:
                setattr(params, name, value)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(name, f"{name} has the wrong type: {exc}") from None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is not None:
        _set(params, "max_tokens", max_tokens)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("stop", "stop must be a string or a list of strings")
        params.stop.extend(stops)
    logprobs = _logprobs_field(body)
    if logprobs is not None:
        _set(params, "logprobs", logprobs)
        if body.get("echo") is True:  # the echoed prompt's tokens are scored like the completion's
            _set(params, "prompt_logprobs", max(params.prompt_logprobs, logprobs))
    constraint = structured_output(body)
    if constraint is not None:
        params.structured_output.CopyFrom(constraint)
    return params


def _logprobs_field(body: dict[str, Any]) -> int | None:
    """Completions: `logprobs` is a count. Chat: `logprobs` is a flag and `top_logprobs` the count."""
    value = body.get("logprobs")
    if isinstance(value, bool):
        top = body.get("top_logprobs") or 0
        if not isinstance(top, int) or isinstance(top, bool):
            raise InvalidRequest("top_logprobs", "top_logprobs must be an integer")
        return top if value else None
    return value


def include_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`: a stream's last chunk carries the usage."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", "stream_options must be an object")
    return bool(options.get("include_usage"))


def _set(params: pdserve_pb2.SamplingParams | pdserve_pb2.BeamSearch, name: str, value: object) -> None:
    try:
        setattr(params, name, value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(name, f"{name} has the wrong type: {exc}") from None


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(token_id(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(token_id(t) for t in p)) for p in prompt):
        return list(prompt)
    raise InvalidRequest("prompt", "prompt must be a string, a list of strings, a list of token ids, "
                                   "or a list of such lists")


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    """Ids a request gives are inside the vocabulary: before anything decodes or packs them (a
    tokenizer or protobuf raises on an id beyond its integer type). The router's validator says
    the same of gRPC's token_ids."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field, f"{field} contains {bad}, outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class Echo:
    """What `echo: true` puts before one prompt's completions: the prompt's text and, when the
    request asks for logprobs, its first token (the one the prompt's scores start after)."""

    text: str = ""
    first_token_id: int | None = None


def echoes(body: dict[str, Any], prompts: list[str | list[int]], tokenizer) -> list[Echo]:
    """Per prompt, its `Echo` (token ids decoded; a text tokenized as the router does); empty without echo."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise InvalidRequest("echo", "echo must be true or false")
    if not echo:
        return [Echo()] * len(prompts)
    scored = body.get("logprobs") is not None
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        out.append(Echo(text, ids[0] if scored and ids else None))
    return out


def beam_search(body: dict[str, Any], params: pdserve_pb2.SamplingParams) -> pdserve_pb2.BeamSearch | None:
    """vLLM's extra params: `use_beam_search`, `best_of` (the beam width; default `n`) and
    `length_penalty`; `n` beams come back, best first. Not streamed: beams change until the end.
    Sets `n` explicitly (1 when unset), since the router's default for a beam search is every beam."""
    use = body.get("use_beam_search", False)
    if not isinstance(use, bool):
        raise InvalidRequest("use_beam_search", "use_beam_search must be true or false")
    if not use:
        return None
    if body.get("stream"):
        raise InvalidRequest("stream", "stream must be false with use_beam_search: the beams change until the "
                                       "search ends, so they come back whole")
    if not params.HasField("n"):
        params.n = 1
    option = pdserve_pb2.BeamSearch()
    _set(option, "beam_width", body.get("best_of") or params.n)
    if body.get("length_penalty") is not None:
        _set(option, "length_penalty", body["length_penalty"])
    return option


def generate_request(prompt: str | list[int], params: pdserve_pb2.SamplingParams,
                     beam: pdserve_pb2.BeamSearch | None = None) -> pdserve_pb2.GenerateRequest:
    if isinstance(prompt, str):
        request = pdserve_pb2.GenerateRequest(text=prompt, sampling_params=params)
    else:
        request = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling_params=params)
    if beam is not None:
        request.beam_search.CopyFrom(beam)
    return request


def chat_prompt(body: dict[str, Any], tokenizer, template: str | None) -> str:
    """The chat's messages rendered by the tokenizer's chat template (or `template`), ready for
    the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise InvalidRequest("messages", "messages must be a non-empty list of {role, content} objects")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", "this model has no chat template: use /v1/completions, or start the "
                                         "router with --chat-template FILE")
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's: name the field
        raise InvalidRequest("messages", f"the chat template cannot render these messages: {exc}") from None


# -- responses ------------------------------------------------------------------------------
@dataclass
class Choice:
    """One sample's text so far, as one OpenAI choice."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[pdserve_pb2.TokenLogprobs] | None = None
    prompt_logprobs: list[pdserve_pb2.TokenLogprobs] | None = None  # on the prompt's first sample only

    def add(self, response: pdserve_pb2.GenerateResponse) -> None:
        self.text += response.text
        if response.prompt_logprobs:
            self.prompt_logprobs = list(response.prompt_logprobs)
        if response.logprobs:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(response.logprobs)
        if response.finish_reason:
            self.finish_reason = FINISH_REASONS[response.finish_reason]


def completion_logprobs(entries: Sequence[pdserve_pb2.TokenLogprobs], tokenizer) -> dict[str, Any] | None:
    if not entries:
        return None
    return {
        "tokens": [tokenizer.decode([e.token_id]) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{tokenizer.decode([t.token_id]): t.logprob for t in e.top} for e in entries],
        "text_offset": [],
    }


def echoed_logprobs(first_token_id: int, scored: Sequence[pdserve_pb2.TokenLogprobs], tokenizer) -> dict[str, Any]:
    """The echoed prompt's part of a completion's `logprobs`: its first token has none (nothing
    comes before it), then each scored prompt token, as vLLM answers `echo` with `logprobs`."""
    after = completion_logprobs(scored, tokenizer) or {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    return {"tokens": [tokenizer.decode([first_token_id]), *after["tokens"]],
            "token_logprobs": [None, *after["token_logprobs"]], "top_logprobs": [None, *after["top_logprobs"]],
            "text_offset": []}


def joined_logprobs(*parts: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completion `logprobs` parts one after the other (the echoed prompt's, then the completion's)."""
    present = [p for p in parts if p]
    if not present:
        return None
    return {key: [item for p in present for item in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                       "text_offset")}


def prompt_logprobs(scored: Sequence[pdserve_pb2.TokenLogprobs], tokenizer) -> list[dict[str, Any] | None]:
    """`prompt_logprobs` as vLLM answers it: None for the first prompt token, then per token a map of
    token id to {logprob, rank, decoded_token}, the prompt's own token first."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    out: list[dict[str, Any] | None] = [None]
    for e in scored:
        ranks = {t.token_id: i + 1 for i, t in enumerate(e.top)}
        row = {str(e.token_id): entry(e.token_id, e.logprob, ranks.get(e.token_id))}
        row.update({str(t.token_id): entry(t.token_id, t.logprob, i + 1) for i, t in enumerate(e.top)
                    if str(t.token_id) not in row})
        out.append(row)
    return out


def chat_logprobs(entries: Sequence[pdserve_pb2.TokenLogprobs], tokenizer) -> dict[str, Any] | None:
    if not entries:
        return None
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                        for e in entries]}


@dataclass
class UsageTally:
    """One HTTP request's usage over its prompts × `n` samples: every sample's completion tokens,
    each prompt's tokens once (from its first sample's last response)."""

    n: int
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, index: int, response: pdserve_pb2.GenerateResponse) -> None:
        if response.HasField("usage") and response.finish_reason:
            self.completion_tokens += response.usage.completion_tokens
            if index % self.n == 0:
                self.prompt_tokens += response.usage.prompt_tokens

    def as_dict(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}
