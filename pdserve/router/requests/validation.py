"""The edge of the router: a `GenerateRequest` becomes prompt token ids and engine `SamplingParams`.

Owns every check a request must pass before any node sees it: a request id of bounded
length, a prompt (text or token ids, exactly one, non-empty) within the router's limits
(characters before tokenizing, tokens after), ids inside the vocabulary, a prompt
shorter than the model, `max_tokens` that fits beside it, a prompt + `max_tokens` that
the largest live KV pools can hold, `n` within the router's limit, bounded stop lists,
and every sampling value (through `SamplingParams`, whose messages already name the
field). It also resolves the request id and the seed, once, so every node draws the
same stream. Every refusal is an `InvalidRequest` whose message starts with the field's
name; it never picks a status code itself and never talks to a node.
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2
from pdserve.proto.convert import sampling_kwargs
from pdserve.router.requests.beam_option import BeamOption, beam_option
from pdserve.router.config import RequestLimits
from pdserve.router.errors import InvalidRequest
from pdserve.router.model import RouterModel
from pdserve.router.cluster.registry import NodeKind, NodeRegistry

SEED_BITS = 63
# The engine's default, read from the dataclass (a slots class keeps no class attribute).
DEFAULT_MAX_TOKENS = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens")


def kv_blocks(num_tokens: int, block_size: int) -> int:
    """KV blocks of `block_size` tokens that hold `num_tokens` (the last one may be partial)."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # seed resolved; max_tokens fits the model and the pools
    beam: BeamOption | None = None  # a beam search; params.n is then the number of beams returned

    def max_kv_blocks(self, block_size: int, max_model_len: int) -> int:
        """The most KV blocks a node may hold for one sample of this request: prompt +
        max_tokens, never beyond the model's length."""
        return kv_blocks(min(len(self.prompt_token_ids) + self.params.max_tokens, max_model_len), block_size)


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """The largest KV pool, in blocks, among live nodes of each pool (None: none known).

    A decode node (or a colocated one, on the baseline) must hold prompt + max_tokens; a
    prefill node the prompt and token 1.
    """

    block_size: int
    decode_blocks: int | None = None
    prefill_blocks: int | None = None
    decode_role: str = "decode"  # what messages call the pool that holds the whole request

    def blocks_for(self, num_tokens: int) -> int:
        return kv_blocks(num_tokens, self.block_size)


def _unknown_capacity() -> KVCapacity:
    return KVCapacity(block_size=1)


def live_capacity(registry: NodeRegistry, block_size: int) -> Callable[[], KVCapacity]:
    """Reads the largest pools from the live nodes' last stats, at each request."""

    def largest(kind: NodeKind) -> int | None:
        return max((e.stats.num_blocks for e in registry.live(kind) if e.stats is not None), default=None)

    def capacity() -> KVCapacity:
        if registry.live(NodeKind.COLOCATED):  # the orchestrator then runs every request there
            return KVCapacity(block_size, largest(NodeKind.COLOCATED), None, "colocated")
        return KVCapacity(block_size, largest(NodeKind.DECODE), largest(NodeKind.PREFILL))

    return capacity


class RequestValidator:
    def __init__(
        self,
        model: RouterModel,
        max_n: int,
        draw_seed: Callable[[], int] | None = None,
        new_request_id: Callable[[], str] | None = None,
        limits: RequestLimits = RequestLimits(),
        capacity: Callable[[], KVCapacity] = _unknown_capacity,
    ) -> None:
        self._model = model
        self._max_n = max_n
        self._limits = limits
        self._capacity = capacity
        # A prompt of max_model_len tokens leaves no room to generate one.
        self._max_prompt_tokens = min(limits.max_prompt_tokens or model.max_model_len, model.max_model_len - 1)
        self._draw_seed = draw_seed or (lambda: random.SystemRandom().getrandbits(SEED_BITS))
        self._new_request_id = new_request_id or (lambda: uuid.uuid4().hex)

    def validate(self, request: pdserve_pb2.GenerateRequest) -> ValidatedRequest:
        """The request as the nodes will run it, or `InvalidRequest` naming the bad field."""
        request_id = self._request_id(request.request_id)
        self._check_stop_lists(request.sampling_params)
        prompt, field = self._prompt_token_ids(request)
        capacity = self._capacity()
        params = self._sampling_params(request.sampling_params, len(prompt), capacity)
        _check_capacity(capacity, len(prompt), params.max_tokens, field)
        if not request.HasField("beam_search"):
            return ValidatedRequest(request_id, prompt, params)
        beam, num_returned = beam_option(request.beam_search, request.sampling_params, params,
                                         len(self._model.eos_token_ids))
        return ValidatedRequest(request_id, prompt, dataclasses.replace(params, n=num_returned), beam)

    def tokenize(self, text: str) -> list[int]:
        """`text` as token ids, refused like a prompt when it is too long to tokenize."""
        self._check_text_length(text)
        return list(self._model.tokenizer.encode(text))

    # -- request id ------------------------------------------------------------------
    def _request_id(self, given: str) -> str:
        if not given:
            return self._new_request_id()
        limit = self._limits.max_request_id_chars
        if len(given) > limit:
            raise InvalidRequest("request_id", f"request_id must be at most {limit} characters, got {len(given)}")
        if not given.isprintable():
            # It reaches logs and node request ids: no control characters.
            raise InvalidRequest("request_id", "request_id must hold only printable characters")
        return given

    # -- prompt ----------------------------------------------------------------------
    def _prompt_token_ids(self, request: pdserve_pb2.GenerateRequest) -> tuple[tuple[int, ...], str]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt", "prompt must be set: exactly one of text and token_ids")
        if which == "text":
            self._check_text_length(request.text)
            ids, field = tuple(self._model.tokenizer.encode(request.text)), "text"
        else:
            field = "token_ids"
            self._check_num_tokens(field, len(request.token_ids.ids))  # before copying them
            ids = tuple(request.token_ids.ids)
        if not ids:
            raise InvalidRequest(field, f"{field} must not be empty (the prompt has no tokens)")
        vocab = self._model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(field, f"{field} contains {bad}, outside the vocabulary [0, {vocab})")
        self._check_num_tokens(field, len(ids))
        return ids, field

    def _check_text_length(self, text: str) -> None:
        limit = self._limits.max_prompt_chars
        if len(text) > limit:
            raise InvalidRequest("text", f"text must be at most {limit} characters, got {len(text)}")

    def _check_num_tokens(self, field: str, num_tokens: int) -> None:
        if num_tokens >= self._model.max_model_len:
            raise InvalidRequest(
                field, f"{field} has {num_tokens} tokens; the model holds {self._model.max_model_len} in all"
            )
        if num_tokens > self._max_prompt_tokens:
            raise InvalidRequest(
                field, f"{field} has {num_tokens} tokens; this router accepts at most {self._max_prompt_tokens}"
            )

    # -- sampling --------------------------------------------------------------------
    def _check_stop_lists(self, msg: pdserve_pb2.SamplingParams) -> None:
        """Bounds the engine does not know: how many stop strings and ids, how long."""
        limits = self._limits
        if len(msg.stop) > limits.max_stop_strings:
            raise InvalidRequest("stop", f"stop must hold at most {limits.max_stop_strings} strings, "
                                         f"got {len(msg.stop)}")
        longest = max(map(len, msg.stop), default=0)
        if longest > limits.max_stop_string_chars:
            raise InvalidRequest("stop", f"stop strings must be at most {limits.max_stop_string_chars} "
                                         f"characters, got one of {longest}")
        if len(msg.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids must hold at most {limits.max_stop_token_ids} "
                                                   f"ids, got {len(msg.stop_token_ids)}")
        vocab = self._model.vocab_size
        beyond = next((t for t in msg.stop_token_ids if t >= vocab), None)
        if beyond is not None:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids contains {beyond}, outside the vocabulary "
                                                   f"[0, {vocab})")

    def _sampling_params(self, msg: pdserve_pb2.SamplingParams, num_prompt_tokens: int,
                         capacity: KVCapacity) -> SamplingParams:
        kwargs = sampling_kwargs(msg)
        room = self._model.max_model_len - num_prompt_tokens
        if "max_tokens" not in kwargs:  # the default never overflows the model or the pools
            kwargs["max_tokens"] = min(DEFAULT_MAX_TOKENS, room, _pool_room(capacity, num_prompt_tokens))
        if kwargs.get("seed") is None:  # drawn before the params are built: they are built (and checked) once
            kwargs["seed"] = self._draw_seed()
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
        return params


def _pool_room(capacity: KVCapacity, num_prompt_tokens: int) -> int:
    """How many tokens the largest decode node can generate after this prompt (>= 1, so
    that a prompt too long for the pools is refused naming the prompt, not max_tokens)."""
    if capacity.decode_blocks is None:
        return DEFAULT_MAX_TOKENS
    return max(1, capacity.decode_blocks * capacity.block_size - num_prompt_tokens)


def _check_capacity(capacity: KVCapacity, num_prompt_tokens: int, max_tokens: int, field: str) -> None:
    """A request no live node could ever hold is bad input, not a reason to retry."""
    for pool, blocks in (("prefill", capacity.prefill_blocks), (capacity.decode_role, capacity.decode_blocks)):
        needed = capacity.blocks_for(num_prompt_tokens + 1)  # the prompt and token 1
        if blocks is not None and needed > blocks:
            raise InvalidRequest(
                field, f"{field} has {num_prompt_tokens} tokens and needs {needed} KV blocks of "
                       f"{capacity.block_size} tokens; the largest {pool} node holds {blocks}"
            )
    blocks = capacity.decode_blocks
    needed = capacity.blocks_for(num_prompt_tokens + max_tokens)
    if blocks is not None and needed > blocks:
        limit = blocks * capacity.block_size - num_prompt_tokens
        raise InvalidRequest(
            "max_tokens", f"max_tokens must be <= {limit}: the prompt ({num_prompt_tokens} tokens) and "
                          f"max_tokens ({max_tokens}) need {needed} KV blocks of {capacity.block_size} "
                          f"tokens; the largest {capacity.decode_role} node holds {blocks}"
        )


def _field_of(error: ValueError) -> str:
    # SamplingParams messages start with the field's name ("top_p must be in (0, 1], got 2").
    return str(error).split(" ", 1)[0].rstrip(":")  # "structured_output.regex: <the library's message>"
