"""When a sampled token ends a sequence: the one rule every engine and the router apply.

Token-level stops only (stop token ids, eos unless ignored — both after `min_tokens` —
then `max_tokens` and the model's length). Stop strings are text, decided by whoever
detokenizes. Pure: no engine state, so a router can apply it to a token a prefill node
sampled without loading a model.
"""

from __future__ import annotations

from collections.abc import Container

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams


def token_finish_reason(
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    eos_token_ids: Container[int],
    max_model_len: int,
) -> FinishReason | None:
    """The reason the sequence ends at `token_id`, its `num_output_tokens`-th output token
    (`num_tokens` counts prompt + output); None if it goes on."""
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP
        if not params.ignore_eos and token_id in eos_token_ids:
            return FinishReason.STOP
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
