"""A beam search's option on the public API (`GenerateRequest.beam_search`), checked.

`beam_option` (called by the validator): beam_width within what the logprobs cap allows, a
finite length_penalty, n (beams returned) within beam_width, and no sampling field a beam search
cannot honour — beams are chosen by log-probability, so temperature > 0, top_p, top_k, min_p
and the penalties would be silently ignored, and stop strings, stop token ids, min_tokens and
logprobs would change what a beam is, and a structured output is not searched under; each is refused INVALID_ARGUMENT naming it. Running the
search is the sample driver's (pdserve/router/dispatch/driver.py), collecting pdserve/router/requests/beam_results.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, max_beam_width
from pdserve.proto import pdserve_pb2
from pdserve.router.errors import InvalidRequest

_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
# Fields whose non-default value a beam search cannot honour (temperature is checked apart:
# 0 and unset are both fine).
_REFUSED_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "min_tokens", "stop", "stop_token_ids", "logprobs", "prompt_logprobs", "structured_output")


@dataclass(frozen=True, slots=True)
class BeamOption:
    beam_width: int
    length_penalty: float

    def to_proto(self) -> pdserve_pb2.BeamSearch:
        return pdserve_pb2.BeamSearch(beam_width=self.beam_width, length_penalty=self.length_penalty)


def beam_option(msg: pdserve_pb2.BeamSearch, sampling: pdserve_pb2.SamplingParams, params: SamplingParams,
                num_eos: int) -> tuple[BeamOption, int]:
    """The option and the number of beams to return, or InvalidRequest naming the field."""
    cap = max_beam_width(num_eos, params.ignore_eos)
    if not 1 <= msg.beam_width <= cap:
        raise InvalidRequest("beam_width", f"beam_width must be in [1, {cap}] (each beam reports its top "
                                           f"max(2, 1 + #eos ids) * beam_width logprobs, at most {MAX_LOGPROBS}), "
                                           f"got {msg.beam_width}")
    length_penalty = msg.length_penalty if msg.HasField("length_penalty") else 1.0
    if not math.isfinite(length_penalty):
        raise InvalidRequest("length_penalty", f"length_penalty must be finite, got {length_penalty}")
    num_returned = sampling.n if sampling.HasField("n") else msg.beam_width
    if not 1 <= num_returned <= msg.beam_width:
        raise InvalidRequest("n", f"n (beams returned) must be in [1, beam_width {msg.beam_width}] with beam search, "
                                  f"got {num_returned}")
    if params.temperature > 0 and sampling.HasField("temperature"):
        raise InvalidRequest("temperature", "temperature must be 0 or unset with beam search: beams are chosen by "
                                            f"log-probability, never sampled; got {params.temperature}")
    for name in _REFUSED_FIELDS:
        if getattr(params, name) != _DEFAULTS[name]:
            raise InvalidRequest(name, f"{name} cannot be honoured by beam search: leave it unset")
    return BeamOption(msg.beam_width, length_penalty), num_returned
