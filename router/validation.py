"""The edge of the router: a `GenerateRequest` becomes prompt token ids and engine `SamplingParams`.

Owns every check a request must pass before any node sees it: a prompt (text or token
ids, exactly one, non-empty), ids inside the vocabulary, a prompt shorter than the
model, `max_tokens` that fits beside it, `n` within the router's limit, and every
sampling value (through `SamplingParams`, whose messages already name the field). It
also resolves the request id and the seed, once, so every node draws the same stream.
Every refusal is an `InvalidRequest` naming the field; it never picks a status code
itself and never talks to a node.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest
from pdserve.router.model import RouterModel
from pdserve.router.wire import sampling_kwargs

SEED_BITS = 63
# The engine's default, read from the dataclass (a slots class keeps no class attribute).
DEFAULT_MAX_TOKENS = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens")


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # seed resolved; max_tokens fits the model


class RequestValidator:
    def __init__(
        self,
        model: RouterModel,
        max_n: int,
        draw_seed: Callable[[], int] | None = None,
        new_request_id: Callable[[], str] | None = None,
    ) -> None:
        self._model = model
        self._max_n = max_n
        self._draw_seed = draw_seed or (lambda: random.SystemRandom().getrandbits(SEED_BITS))
        self._new_request_id = new_request_id or (lambda: uuid.uuid4().hex)

    def validate(self, request: pdserve_pb2.GenerateRequest) -> ValidatedRequest:
        """The request as the nodes will run it, or `InvalidRequest` naming the bad field."""
        prompt = self._prompt_token_ids(request)
        params = self._sampling_params(request.sampling_params, len(prompt))
        return ValidatedRequest(request.request_id or self._new_request_id(), prompt, params)

    def _prompt_token_ids(self, request: pdserve_pb2.GenerateRequest) -> tuple[int, ...]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt", "prompt must be set: exactly one of text and token_ids")
        if which == "text":
            ids = tuple(self._model.tokenizer.encode(request.text))
            field = "text"
        else:
            ids = tuple(request.token_ids.ids)
            field = "token_ids"
        if not ids:
            raise InvalidRequest(field, f"{field} must not be empty (the prompt has no tokens)")
        vocab = self._model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(field, f"{field} contains {bad}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self._model.max_model_len:
            raise InvalidRequest(
                field, f"{field} has {len(ids)} tokens; the model holds {self._model.max_model_len} in all"
            )
        return ids

    def _sampling_params(self, msg: pdserve_pb2.SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        kwargs = sampling_kwargs(msg)
        room = self._model.max_model_len - num_prompt_tokens
        if "max_tokens" not in kwargs:
            kwargs["max_tokens"] = min(DEFAULT_MAX_TOKENS, room)  # the default never overflows
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            raise InvalidRequest(_field_of(exc), str(exc)) from exc
        if params.max_tokens > room:
            raise InvalidRequest(
                "max_tokens",
                f"max_tokens must be <= {room} (the model holds {self._model.max_model_len} tokens "
                f"and the prompt has {num_prompt_tokens}), got {params.max_tokens}",
            )
        if params.n > self._max_n:
            raise InvalidRequest("n", f"n must be <= {self._max_n}, got {params.n}")
        if params.seed is None:
            params = dataclasses.replace(params, seed=self._draw_seed())
        return params


def _field_of(error: ValueError) -> str:
    # SamplingParams messages start with the field's name ("top_p must be in (0, 1], got 2").
    return str(error).split(" ", 1)[0]
