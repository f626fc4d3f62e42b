"""What a request asks of the sampler, validated once at the edge.

`SamplingParams` owns the per-request sampling knobs (vLLM's names and defaults) and
their validation: every bad value raises `ValueError` naming the field, at
construction, so nothing downstream re-checks them. Numbers are normalised to plain
`int`/`float` and `stop`/`stop_token_ids` to tuples, so the object is hashable and
compares by value. Params that cross a process boundary after their checks (a node's front
builds them from the request; its core gets their fields) come back with `rebuilt`, which
checks nothing again. It never touches tensors or tokenizers.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Integral, Real

from pdserve.engine.structured_output import StructuredOutput, grammar_of

MAX_LOGPROBS = 20


def beams_to_keep(beam_width: int, num_eos: int, ignore_eos: bool) -> int:
    """The candidates a beam search takes per step, so the top log-probabilities every beam must
    report: 2 per beam, or 1 + #eos ids when more (a beam ended by eos must not leave fewer than
    `beam_width` to go on), as transformers' beam search takes them."""
    return max(2, 1 + (0 if ignore_eos else num_eos)) * beam_width


def max_beam_width(num_eos: int, ignore_eos: bool) -> int:
    """The widest beam search whose candidates fit MAX_LOGPROBS."""
    return MAX_LOGPROBS // beams_to_keep(1, num_eos, ignore_eos)
# The additive penalties take OpenAI's (and vLLM's) range.
MAX_ABS_PENALTY = 2.0
# The repetition penalty divides a seen token's positive logit and multiplies a negative
# one: past these bounds a float32 logit overflows to inf and the draw turns to NaN (a
# penalty of 1e-38 would make every draw pick the last vocabulary id). A factor of 100
# either way is already far beyond any useful setting (1.0-2.0 in practice).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# Above this the distribution is all but flat for any real model's logits; a larger one
# buys nothing and, past float32's range, divides -inf by inf (NaN) in the sampler.
MAX_TEMPERATURE = 100.0


def _as_int(name: str, value: object) -> int:
    # bool is an Integral; a True where a count belongs is a caller bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _as_sent(bound: float) -> float:
    """`bound` as a float32 proto field carries it (ints are exact, and may not fit)."""
    if isinstance(bound, int):
        return bound
    return struct.unpack("f", struct.pack("f", bound))[0]


def _check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    # Proto floats are float32: a client's 0.01 arrives as 0.0099999998. Each bound also
    # admits its float32 rounding, so a value sent exactly at the bound is not refused.
    if low is not None and value < min(low, _as_sent(low)):
        raise ValueError(f"{name} must be >= {low:g}, got {value:g}")
    if high is not None and value > max(high, _as_sent(high)):
        raise ValueError(f"{name} must be <= {high:g}, got {value:g}")


def _as_stop(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"stop must be a str or a list of str, got {type(value).__name__}")
    for s in value:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop must not contain empty strings")
    return tuple(value)


def _as_token_ids(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of int, got {type(value).__name__}")
    ids = tuple(_as_int(name, t) for t in value)
    for t in ids:
        _check_range(name, t, 0, None)
    return ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # [0, 100]; 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int | None = None  # None => off
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # [0.01, 100]; 1 => off
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs to return; 0 => only the sampled token's
    # Per prompt token after the first: its logprob and this many top alternatives (0 => only
    # its own). None => off. A request that asks never takes a prefix-cache hit (the skipped
    # positions' logits are what it asks for).
    prompt_logprobs: int | None = None
    # The output must match this (pdserve/engine/structured_output.py); None => unconstrained.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stopping()
        self._validate_structured_output()

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen

    def _validate_counts(self) -> None:
        self._set("n", _as_int("n", self.n))
        _check_range("n", self.n, 1, None)
        self._set("max_tokens", _as_int("max_tokens", self.max_tokens))
        _check_range("max_tokens", self.max_tokens, 1, None)
        self._set("min_tokens", _as_int("min_tokens", self.min_tokens))
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.seed is not None:
            self._set("seed", _as_int("seed", self.seed))
        if self.logprobs is not None:
            self._set("logprobs", _as_int("logprobs", self.logprobs))
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self._set("prompt_logprobs", _as_int("prompt_logprobs", self.prompt_logprobs))
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    def _validate_distribution(self) -> None:
        self._set("temperature", _as_float("temperature", self.temperature))
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self._set("top_p", _as_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if self.top_k is not None:
            self._set("top_k", _as_int("top_k", self.top_k))
            _check_range("top_k", self.top_k, 1, None)
        self._set("min_p", _as_float("min_p", self.min_p))
        _check_range("min_p", self.min_p, 0.0, 1.0)

    def _validate_penalties(self) -> None:
        self._set("repetition_penalty", _as_float("repetition_penalty", self.repetition_penalty))
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        self._set("presence_penalty", _as_float("presence_penalty", self.presence_penalty))
        _check_range("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        self._set("frequency_penalty", _as_float("frequency_penalty", self.frequency_penalty))
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)

    def _validate_stopping(self) -> None:
        self._set("stop", _as_stop(self.stop))
        self._set("stop_token_ids", _as_token_ids("stop_token_ids", self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    def _validate_structured_output(self) -> None:
        if self.structured_output is None:
            return
        if not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")
        if self.min_tokens:
            # Masking eos where only eos completes the grammar would leave no token to draw.
            raise ValueError("min_tokens must be 0 with structured_output: the grammar decides where the output "
                             f"ends, got {self.min_tokens}")
        grammar_of(self.structured_output)  # parsed here so a bad one is refused where the params are built

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def rebuilt(cls, values: Mapping[str, object]) -> SamplingParams:
        """Params already checked where they were built, from their fields as plain data (JSON
        made the tuples lists): the same value, without a second validation. Every field must be
        there: a missing or unknown one is a TypeError, as for the constructor."""
        names = _FIELD_NAMES
        if set(values) != names:
            raise TypeError(f"SamplingParams fields differ: missing {sorted(names - set(values))}, "
                            f"unknown {sorted(set(values) - names)}")
        params = object.__new__(cls)
        for name in names:
            value = values[name]
            if name in ("stop", "stop_token_ids"):
                value = tuple(value)
            elif name == "structured_output" and isinstance(value, Mapping):
                value = StructuredOutput(**value)
            params._set(name, value)
        return params


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
