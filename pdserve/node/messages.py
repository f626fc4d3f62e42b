"""Typed messages between a node's gRPC front and its engine-core process.

One encode/decode pair (`encode`, `decode`): the internal messages' one codec (pdserve/common/codec.py),
plain JSON tagged with the message's type name. Every message is a dataclass of JSON-native
fields; the nested values (sampling params, logprobs, error codes, stats) are rebuilt from the
fields' types. A request's life over these messages:

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

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.codec import Codec
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_shape import StepTotals
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


# -- front -> core -------------------------------------------------------------------
@dataclass(slots=True)
class PrefillSubmit:
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
    placement_stamp: int = 0  # the router's (node.proto PrefillRequest.placement_stamp)


@dataclass(slots=True)
class StreamSubmit:
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
    placement_stamp: int = 0  # the router's (node.proto SampleRequest.placement_stamp)


@dataclass(slots=True)
class Abort:
    req_id: str


@dataclass(slots=True)
class StatsQuery:
    query_id: int


@dataclass(slots=True)
class Shutdown:
    pass


# -- core -> front -------------------------------------------------------------------
@dataclass(slots=True)
class CoreStarted:
    """The core has loaded the model and registered its KV cache: it serves from now on."""

    fingerprint: dict[str, Any]  # KVCacheSpec.fingerprint(): what the node registers with the router
    # A node with a KV transport: its layout (NodeKVDescriptor JSON) and the id requests name it by.
    kv_layout_id: str = ""
    kv_layout: str = ""


@dataclass(slots=True)
class CoreFailed:
    message: str
    # The core refused its configuration (a model folder or dtype it cannot serve): `message`
    # is the whole story, one line naming the flag, and the node exits as for a usage error.
    refused: bool = False


@dataclass(slots=True)
class Ready:
    req_id: str
    kv_layout_id: str  # the decode node's layout, named (its front answers GetKVLayout with it)
    block_ids: list[int]


@dataclass(slots=True)
class FirstToken:
    req_id: str
    token_id: int
    logprobs: Logprobs | None
    num_cached_tokens: int
    prefill_s: float  # arrival at the core -> token 1 sampled
    kv_transfer_s: float  # token 1 sampled -> the last push and the done message acknowledged
    kv_transfer_bytes: int
    prompt_logprobs: PromptLogprobs | None = None  # when the params ask: scored with the prompt here


@dataclass(slots=True)
class Tokens:
    req_id: str
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # one per token
    finish_reason: str | None = None  # FinishReason.value once the request ended
    stop_token_id: int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # a colocated node's first event, when asked

    @classmethod
    def joined(cls, parts: list[Tokens]) -> Tokens:
        """One request's consecutive messages as one: their tokens and logprobs in order, the
        first one's prompt logprobs, the last one's end (only the last may carry one)."""
        last = parts[-1]
        return cls(last.req_id, [t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs],
                   last.finish_reason, last.stop_token_id, parts[0].prompt_logprobs)


@dataclass(slots=True)
class BeamsDone:
    """A beam search's answer, once it ended: every hypothesis, best first."""

    req_id: str
    beams: list[BeamResult]
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class RequestFailed:
    req_id: str
    code: ErrorCode
    message: str


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
    preemptions: int = 0  # recomputed and swapped out alike
    forked_samples: int = 0  # samples forked off a sibling sample's first logits (pdserve/node/core/sibling_forks.py)
    failed_requests: int = 0  # failed because a step they were in raised (engine StepFailed)
    kv_transfer_sent: TransferStats = field(default_factory=TransferStats)  # whatever the kind
    placed_through: int = 0  # the highest placement stamp the core had taken in (NodeStats.placed_through)
    steps: StepTotals = field(default_factory=StepTotals)  # the engine's steps, summed (NodeStats.steps)


@dataclass(slots=True)
class StatsReply:
    query_id: int
    stats: StatsData


@dataclass(slots=True)
class StatsPush:
    """A snapshot the core sends unasked, so the front always has a recent one."""

    stats: StatsData


Message = (PrefillSubmit | StreamSubmit | Abort | StatsQuery | Shutdown | CoreStarted | CoreFailed
           | Ready | FirstToken | Tokens | BeamsDone | RequestFailed | StatsReply | StatsPush)

_CODEC = Codec((PrefillSubmit, StreamSubmit, Abort, StatsQuery, Shutdown, CoreStarted, CoreFailed, Ready,
                FirstToken, Tokens, BeamsDone, RequestFailed, StatsReply, StatsPush), MessageError, "node message")


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


def decode(raw: bytes) -> Message:
    """Raises MessageError for bytes that are not a node message."""
    return _CODEC.decode(raw)
