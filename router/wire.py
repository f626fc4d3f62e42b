"""Conversions between the router's engine-side values and the protobuf messages.

Owns: proto `SamplingParams` ↔ engine `SamplingParams`, finish reasons both ways, and
the token-level stop rule for token 1 (which the prefill node samples but does not
report a finish reason for). It never talks to the network and never validates beyond
what `SamplingParams` itself checks.
"""

from __future__ import annotations

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2

# Optional scalar fields whose proto name is the engine's keyword.
_OPTIONAL_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "max_tokens", "min_tokens", "logprobs",
)

FINISH_TO_PROTO = {
    None: pdserve_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pdserve_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: pdserve_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pdserve_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_kwargs(msg: pdserve_pb2.SamplingParams) -> dict[str, object]:
    """The engine keywords the client set; unset fields are left to the engine's defaults."""
    kwargs: dict[str, object] = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    return kwargs


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
    return msg


