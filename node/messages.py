"""Typed messages between a node's gRPC front and its engine-core process.

One encode/decode pair (`encode`, `decode`): plain JSON tagged with the message's type
name. Every message is a dataclass of JSON-native fields; the few nested values
(sampling params, logprobs, error codes, stats) are rebuilt by their class's
`from_json`. A request's life over these messages:

    prefill:   front ─PrefillSubmit─▶ core ─FirstToken | RequestFailed─▶ front
    decode:    front ─StreamSubmit─▶ core ─Ready─▶ front, then ─Tokens…(last: finish_reason)─▶
               or ─RequestFailed─▶ at any point
    colocated: front ─StreamSubmit─▶ core ─Tokens…(last: finish_reason)─▶ front,
               or ─RequestFailed─▶ at any point; a beam search (StreamSubmit.beam set)
               answers one ─BeamsDone─▶ instead of Tokens
    either:  front ─Abort─▶ core (the caller went away; no answer)
    stats:   core ─StatsPush─▶ front, unasked, at most every stats_push_interval_s (the
             front caches it for heartbeats); front ─StatsQuery─▶ core ─StatsReply─▶ front

Must never: pickle, carry tensors, or import torch (the front imports this module).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.counters import TransferStats
from pdserve.node.errors import ErrorCode


class MessageError(ValueError):
    """Bytes that are not a message of this protocol."""


@dataclass(slots=True)
class Logprobs:
    """The engine's `TokenLogprobs` of one token, as plain data."""

    token_logprob: float  # of the sampled token
    top_token_ids: list[int]  # most likely first
    top_logprobs: list[float]

    @classmethod
    def of(cls, engine_logprobs: Any) -> Logprobs | None:
        """From the engine's TokenLogprobs (or None); typed Any to keep torch out of the front."""
        if engine_logprobs is None:
            return None
        return cls(float(engine_logprobs.token_logprob), list(engine_logprobs.top_token_ids),
                   list(engine_logprobs.top_logprobs))


@dataclass(slots=True)
class PromptLogprobs:
    """The engine's `PromptLogprobs`, as plain data: entry j scores prompt token j+1."""

    token_ids: list[int]
    logprobs: list[Logprobs]

    @classmethod
    def of(cls, engine_prompt: Any) -> PromptLogprobs | None:
        """From the engine's PromptLogprobs (or None); typed Any to keep torch out of the front."""
        if engine_prompt is None:
            return None
        return cls(list(engine_prompt.token_ids), [Logprobs.of(lp) for lp in engine_prompt.logprobs])

    @classmethod
    def from_json(cls, body: dict[str, Any] | None) -> PromptLogprobs | None:
        if body is None:
            return None
        return cls(body["token_ids"], [Logprobs(**lp) for lp in body["logprobs"]])


@dataclass(slots=True)
class BeamOption:
    """A beam search instead of one sample (max_tokens and ignore_eos are the params')."""

    beam_width: int
    length_penalty: float = 1.0


@dataclass(slots=True)
class BeamResult:
    """One finished hypothesis, as plain data."""

    token_ids: list[int]
    finish_reason: str  # FinishReason.value: "stop" when eos ended it, else "length"
    cumulative_logprob: float
    score: float


class _Message:
    """Default JSON rebuild: the fields are already JSON-native."""

    __slots__ = ()

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Any:
        return cls(**body)


# -- front -> core -------------------------------------------------------------------
@dataclass(slots=True)
class PrefillSubmit(_Message):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int
    kv_layout_id: str  # names the decode node's KV layout (NodeKVDescriptor.layout_id)
    dst_block_ids: list[int]  # the decode node's reserved blocks, in prompt (+ resumed) order
    # Tokens the sample already generated elsewhere (a resume): prefilled, counted as output.
    resumed_token_ids: list[int] = field(default_factory=list)
    # The layout's JSON, on the first request naming an id the core has not had yet; None after.
    kv_layout: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PrefillSubmit:
        return cls(**{**body, "params": _params(body["params"])})


@dataclass(slots=True)
class StreamSubmit(_Message):
    """A request whose tokens stream back (a decode or a colocated node's call)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_index: int
    # Tokens the sample already generated elsewhere (a resume): they count as output, and
    # their KV arrives with the prompt's (decode) or is computed with it (colocated).
    resumed_token_ids: list[int] = field(default_factory=list)
    beam: BeamOption | None = None  # a beam search, colocated or decode node (sample_index, seed unused)
    # Its KV comes from a prefill node (a decode node's `Decode` call: the KV import stage takes
    # it), or is computed here (`Generate`: a colocated node, a decode node with --local-prefill).
    imports_kv: bool = False

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StreamSubmit:
        beam = body.get("beam")
        return cls(**{**body, "params": _params(body["params"]), "beam": None if beam is None else BeamOption(**beam)})


@dataclass(slots=True)
class Abort(_Message):
    req_id: str


@dataclass(slots=True)
class StatsQuery(_Message):
    query_id: int


@dataclass(slots=True)
class Shutdown(_Message):
    pass


# -- core -> front -------------------------------------------------------------------
@dataclass(slots=True)
class CoreStarted(_Message):
    """The core has loaded the model and registered its KV cache: it serves from now on."""

    fingerprint: dict[str, Any]  # KVCacheSpec.fingerprint(): what the node registers with the router
    # A node with a KV transport: its layout (NodeKVDescriptor JSON) and the id requests name it by.
    kv_layout_id: str = ""
    kv_layout: str = ""


@dataclass(slots=True)
class CoreFailed(_Message):
    message: str
    # The core refused its configuration (a model folder or dtype it cannot serve): `message`
    # is the whole story, one line naming the flag, and the node exits as for a usage error.
    refused: bool = False


@dataclass(slots=True)
class Ready(_Message):
    req_id: str
    kv_layout_id: str  # the decode node's layout, named (its front answers GetKVLayout with it)
    block_ids: list[int]


@dataclass(slots=True)
class FirstToken(_Message):
    req_id: str
    token_id: int
    logprobs: Logprobs | None
    num_cached_tokens: int
    prefill_s: float  # arrival at the core -> token 1 sampled
    kv_transfer_s: float  # token 1 sampled -> the last push and the done message acknowledged
    kv_transfer_bytes: int
    prompt_logprobs: PromptLogprobs | None = None  # when the params ask: scored with the prompt here

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> FirstToken:
        return cls(**{**body, "logprobs": _logprobs(body["logprobs"]),
                      "prompt_logprobs": PromptLogprobs.from_json(body.get("prompt_logprobs"))})


@dataclass(slots=True)
class Tokens(_Message):
    req_id: str
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # one per token
    finish_reason: str | None = None  # FinishReason.value once the request ended
    stop_token_id: int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # a colocated node's first event, when asked

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Tokens:
        return cls(**{**body, "logprobs": [_logprobs(lp) for lp in body["logprobs"]],
                      "prompt_logprobs": PromptLogprobs.from_json(body.get("prompt_logprobs"))})


@dataclass(slots=True)
class BeamsDone(_Message):
    """A beam search's answer, once it ended: every hypothesis, best first."""

    req_id: str
    beams: list[BeamResult]
    num_prompt_tokens: int
    num_cached_tokens: int

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> BeamsDone:
        return cls(**{**body, "beams": [BeamResult(**b) for b in body["beams"]]})


@dataclass(slots=True)
class RequestFailed(_Message):
    req_id: str
    code: ErrorCode
    message: str

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RequestFailed:
        return cls(**{**body, "code": ErrorCode(body["code"])})


@dataclass(slots=True)
class StatsData:
    kind: str
    num_blocks: int
    used_blocks: int
    # Named as NodeStats names it: blocks held outside the scheduler (a decode node's
    # reservations awaiting KV, a prefill node's blocks awaiting push acknowledgements).
    reserved_blocks: int
    num_waiting: int
    num_running: int
    queued_prefill_tokens: int
    kv_transfer: TransferStats = field(default_factory=TransferStats)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    tensor_parallel_size: int = 1
    # The same side as kv_transfer, per rank (rank order); kv_transfer is their sum.
    kv_transfer_ranks: list[TransferStats] = field(default_factory=list)
    num_swapped: int = 0  # preempted requests with their KV in the swap space
    swap_blocks: int = 0
    used_swap_blocks: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    forked_samples: int = 0  # samples forked off a sibling sample's first logits (node/core/sibling_forks.py)
    failed_requests: int = 0  # failed because a step they were in raised (engine StepFailed)


@dataclass(slots=True)
class StatsReply(_Message):
    query_id: int
    stats: StatsData

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StatsReply:
        return cls(query_id=body["query_id"], stats=_stats(body["stats"]))


@dataclass(slots=True)
class StatsPush(_Message):
    """A snapshot the core sends unasked, so the front always has a recent one."""

    stats: StatsData

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> StatsPush:
        return cls(stats=_stats(body["stats"]))


Message = (PrefillSubmit | StreamSubmit | Abort | StatsQuery | Shutdown | CoreStarted | CoreFailed
           | Ready | FirstToken | Tokens | BeamsDone | RequestFailed | StatsReply | StatsPush)

_TYPES: dict[str, type[_Message]] = {
    cls.__name__: cls
    for cls in (PrefillSubmit, StreamSubmit, Abort, StatsQuery, Shutdown, CoreStarted, CoreFailed,
                Ready, FirstToken, Tokens, BeamsDone, RequestFailed, StatsReply, StatsPush)
}


def encode(msg: Message) -> bytes:
    name = type(msg).__name__
    if name not in _TYPES:
        raise MessageError(f"{name} is not a node message")
    return json.dumps({"type": name, "body": _plain(msg)}, separators=(",", ":")).encode()


def decode(raw: bytes) -> Message:
    try:
        data = json.loads(raw)
        cls = _TYPES[data["type"]]
        return cls.from_json(data["body"])
    except (ValueError, KeyError, TypeError) as exc:
        raise MessageError(f"not a node message: {exc!r}") from exc


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _params(body: dict[str, Any]) -> SamplingParams:
    return SamplingParams.rebuilt(body)  # checked once, by the front that built them from the request


def _stats(body: dict[str, Any]) -> StatsData:
    ranks = [TransferStats(**rank) for rank in body.get("kv_transfer_ranks", [])]
    return StatsData(**{**body, "kv_transfer": TransferStats(**body["kv_transfer"]), "kv_transfer_ranks": ranks})


def _logprobs(body: dict[str, Any] | None) -> Logprobs | None:
    return None if body is None else Logprobs(**body)

