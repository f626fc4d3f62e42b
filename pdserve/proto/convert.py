"""The one pair of conversions between the protobuf messages and the engine's values,
used by the router, by every node and by the `pdserve generate` client.

Owns: proto `SamplingParams` ↔ engine `SamplingParams` (the router reads what a client
set, sends nodes every field explicitly; a node takes the router's seed), finish reasons
both ways (and their names), a token's logprobs → proto, and a prompt's → proto.

Why this module, unlike the generated stubs beside it, imports the engine: the
conversion needs both types, and the engine must never import proto or grpc, so the
dependency can only run this way (tests/unit/test_layering.py lets proto import engine
and nothing else). It imports only the engine's plain-data modules, never torch.

Must never: validate beyond what `SamplingParams` itself checks, pick a status code, or
talk to the network.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import StructuredKind, StructuredOutput
from pdserve.proto import pdserve_pb2

# Optional scalar fields whose proto name is the engine's keyword.
_OPTIONAL_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
)

FINISH_TO_PROTO: dict[FinishReason | None, int] = {
    None: pdserve_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pdserve_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: pdserve_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pdserve_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO: dict[int, FinishReason | None] = {v: k for k, v in FINISH_TO_PROTO.items()}


class TokenLogprobs(Protocol):
    """What the engine's and the node messages' logprobs of one token both carry."""

    token_logprob: float  # of the sampled token
    top_token_ids: list[int]  # most likely first
    top_logprobs: list[float]


class PromptLogprobs(Protocol):
    """What the engine's and the node messages' prompt logprobs both carry."""

    token_ids: list[int]  # prompt tokens 1.. in order
    logprobs: Sequence[TokenLogprobs]  # one per token id


# -- sampling parameters ----------------------------------------------------------------
def sampling_kwargs(msg: pdserve_pb2.SamplingParams) -> dict[str, object]:
    """The engine keywords the client set; unset fields are left to the engine's defaults."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.HasField("structured_output"):
        kwargs["structured_output"] = structured_from_proto(msg.structured_output)
    return kwargs


def structured_from_proto(msg: pdserve_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no constraint of the oneof is set (or json_object is false)."""
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return StructuredOutput.choice(list(msg.choice.options))
    if kind == "json_object":
        return StructuredOutput.json_object()
    return StructuredOutput(kind, getattr(msg, kind))


def structured_to_proto(structured: StructuredOutput) -> pdserve_pb2.StructuredOutput:
    kind = StructuredKind(structured.kind)
    if kind is StructuredKind.CHOICE:
        return pdserve_pb2.StructuredOutput(choice=pdserve_pb2.Choices(options=json.loads(structured.spec)))
    if kind is StructuredKind.JSON_OBJECT:
        return pdserve_pb2.StructuredOutput(json_object=True)
    return pdserve_pb2.StructuredOutput(**{kind.value: structured.spec})


def params_from_proto(msg: pdserve_pb2.SamplingParams, seed: int) -> SamplingParams:
    """A node's engine params; `seed` is the router's resolved one. `n` is dropped: a node
    runs one sample, named by sample_index. Raises ValueError naming a bad field."""
    kwargs = sampling_kwargs(msg)
    kwargs.pop("n", None)
    kwargs["seed"] = seed
    return SamplingParams(**kwargs)


def params_to_proto(params: SamplingParams) -> pdserve_pb2.SamplingParams:
    """Every field set explicitly, so a node applies exactly what the router resolved."""
    msg = pdserve_pb2.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.top_k is not None:
        msg.top_k = params.top_k
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return msg


# -- finish reasons ---------------------------------------------------------------------
def finish_reason_to_proto(reason: FinishReason | str | None) -> int:
    """The wire value of a finish reason, given as the enum or as its value (what the
    node's core messages carry); None: not finished."""
    return FINISH_TO_PROTO[None if reason is None else FinishReason(reason)]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """None for FINISH_REASON_UNSPECIFIED (not finished) and for a value this build does not know."""
    return FINISH_FROM_PROTO.get(value)


def finish_reason_name(value: int) -> str | None:
    """"stop", "length", "abort", or None while unfinished: what the client prints."""
    reason = finish_reason_from_proto(value)
    return None if reason is None else reason.value


# -- logprobs ---------------------------------------------------------------------------
def logprobs_to_proto(token_id: int, logprobs: TokenLogprobs) -> pdserve_pb2.TokenLogprobs:
    top = [pdserve_pb2.TopLogprob(token_id=t, logprob=lp)
           for t, lp in zip(logprobs.top_token_ids, logprobs.top_logprobs)]
    return pdserve_pb2.TokenLogprobs(token_id=token_id, logprob=logprobs.token_logprob, top=top)


def prompt_logprobs_to_proto(prompt: PromptLogprobs) -> list[pdserve_pb2.TokenLogprobs]:
    """Entry j scores prompt token j+1: GenerateResponse.prompt_logprobs' shape."""
    return [logprobs_to_proto(t, lp) for t, lp in zip(prompt.token_ids, prompt.logprobs)]
