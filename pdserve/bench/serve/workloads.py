"""Request workloads: what the i-th request of a benchmark asks for.

Owns the prompt/output length distributions (fixed, uniform, chat-like log-normal),
the synthetic prompts built from them (seeded random token ids) and the JSONL reader
for a user's own traffic. Pure: request i of run r is a function of the seed, i and
r; its lengths of the seed and i alone, so runs at different rates send the same
lengths in the same order, with fresh prompt tokens per run (no prefix-cache hits
across a sweep's probes). Never
talks to the server; the model's vocabulary and length limit come in as a `ModelLimits`.

Every request generates exactly its output length: the client sends `max_tokens =
output_len` with `ignore_eos`, so a length distribution is an output-length distribution.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# ShareGPT's mean prompt and output lengths in tokens, as reported by the vLLM paper
# (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023, §6.1, Fig. 11). The paper shows histograms but no spread;
# CHAT_SIGMA is our choice of log-normal shape (median = 0.61 × mean, p99 ≈ 6 × mean).
CHAT_INPUT_MEAN = 161.31
CHAT_OUTPUT_MEAN = 337.99
CHAT_SIGMA = 1.0


class WorkloadError(ValueError):
    """A workload that cannot be built: bad parameters or a bad dataset line."""


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts (from GetModelInfo)."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestSpec:
    """One request: a prompt (token ids or text, exactly one) and how many tokens to generate."""

    output_len: int
    token_ids: tuple[int, ...] | None = None
    text: str | None = None

    @property
    def input_len(self) -> int | None:
        """Prompt tokens when the prompt is token ids; a text prompt's count comes from the server."""
        return len(self.token_ids) if self.token_ids is not None else None


class Workload(Protocol):
    def request(self, index: int, run: int = 0) -> RequestSpec:
        """Request `index` of run `run` (a sweep's probe); runs send the same lengths."""
        ...


class LengthDistribution(Protocol):
    def check(self, limits: ModelLimits) -> None:
        """Raise WorkloadError if a request could not fit the model."""
        ...

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        """(input_len, output_len) of one request."""
        ...


# --------------------------------------------------------------------------- lengths


def _check_fits(input_len: int, output_len: int, limits: ModelLimits) -> None:
    if input_len < 1 or output_len < 1:
        raise WorkloadError(f"lengths must be >= 1, got input {input_len}, output {output_len}")
    if input_len + output_len > limits.max_model_len:
        raise WorkloadError(
            f"input {input_len} + output {output_len} tokens exceed the model's max_model_len {limits.max_model_len}"
        )


@dataclass(frozen=True)
class FixedLengths:
    input_len: int
    output_len: int

    def check(self, limits: ModelLimits) -> None:
        _check_fits(self.input_len, self.output_len, limits)

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        return self.input_len, self.output_len


@dataclass(frozen=True)
class UniformLengths:
    """Lengths uniform over inclusive ranges, drawn independently."""

    input_range: tuple[int, int]
    output_range: tuple[int, int]

    def check(self, limits: ModelLimits) -> None:
        for name, (low, high) in (("input", self.input_range), ("output", self.output_range)):
            if low > high:
                raise WorkloadError(f"{name} range {low}:{high} is empty")
        _check_fits(self.input_range[0], self.output_range[0], limits)
        _check_fits(self.input_range[1], self.output_range[1], limits)

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        return (int(rng.integers(self.input_range[0], self.input_range[1], endpoint=True)),
                int(rng.integers(self.output_range[0], self.output_range[1], endpoint=True)))


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length given by its mean (in tokens) and the σ of its log."""

    mean: float
    sigma: float

    def __post_init__(self) -> None:
        if not (self.mean >= 1 and self.sigma >= 0):
            raise WorkloadError(f"log-normal needs mean >= 1 and sigma >= 0, got {self.mean}, {self.sigma}")

    def sample(self, rng: np.random.Generator) -> int:
        mu = math.log(self.mean) - self.sigma * self.sigma / 2  # E[exp(N(mu, σ²))] = mean
        return max(1, round(float(rng.lognormal(mu, self.sigma))))


@dataclass(frozen=True)
class ChatLengths:
    """Chat-like traffic: log-normal prompt and output lengths, clipped to the model.

    A prompt keeps at most max_model_len - 1 tokens and its output what room is left,
    so every request is one the server accepts.
    """

    max_model_len: int
    input: LogNormal = LogNormal(CHAT_INPUT_MEAN, CHAT_SIGMA)
    output: LogNormal = LogNormal(CHAT_OUTPUT_MEAN, CHAT_SIGMA)

    def check(self, limits: ModelLimits) -> None:
        if self.max_model_len < 2:
            raise WorkloadError(f"max_model_len {self.max_model_len} leaves no room for a prompt and an output")

    def sample(self, rng: np.random.Generator) -> tuple[int, int]:
        input_len = min(self.input.sample(rng), self.max_model_len - 1)
        output_len = min(self.output.sample(rng), self.max_model_len - input_len)
        return input_len, output_len


# --------------------------------------------------------------------------- workloads


class SyntheticWorkload:
    """Random token-id prompts of sampled lengths; never an end-of-sequence id in a prompt."""

    def __init__(self, lengths: LengthDistribution, limits: ModelLimits, seed: int) -> None:
        lengths.check(limits)
        self._lengths = lengths
        self._seed = seed
        self._allowed_ids = np.setdiff1d(np.arange(limits.vocab_size), np.array(limits.eos_token_ids, dtype=np.int64))
        if len(self._allowed_ids) == 0:
            raise WorkloadError("the vocabulary has no token ids to build prompts from")

    def request(self, index: int, run: int = 0) -> RequestSpec:
        input_len, output_len = self._lengths.sample(np.random.default_rng((self._seed, index)))
        # Fresh tokens every run: a probe must not find the previous probe's prompts in the
        # server's prefix cache, or a sweep would measure cache hits instead of prefills.
        tokens = np.random.default_rng((self._seed, index, run))
        ids = self._allowed_ids[tokens.integers(0, len(self._allowed_ids), input_len)]
        return RequestSpec(output_len=output_len, token_ids=tuple(int(t) for t in ids))


class JsonlWorkload:
    """A user's requests in file order, starting over at the top when there are more requests than lines."""

    def __init__(self, requests: list[RequestSpec]) -> None:
        if not requests:
            raise WorkloadError("the dataset has no requests")
        self._requests = requests

    def request(self, index: int, run: int = 0) -> RequestSpec:
        # The user's own text, the same every run (a server may serve repeats from its prefix cache).
        return self._requests[index % len(self._requests)]


def read_jsonl(path: str | Path) -> JsonlWorkload:
    """Lines of `{"prompt": "<text>", "output_len": <int >= 1>}`; blank lines are skipped.

    Raises WorkloadError naming the file and line of the first bad line.
    """
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse_line(line))
            except WorkloadError as err:
                raise WorkloadError(f"{path}:{number}: {err}") from None
    return JsonlWorkload(requests)


def _parse_line(line: str) -> RequestSpec:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"not JSON ({err.msg})") from None
    if not isinstance(entry, dict):
        raise WorkloadError(f"expected an object, got {type(entry).__name__}")
    prompt, output_len = entry.get("prompt"), entry.get("output_len")
    if not isinstance(prompt, str) or not prompt:
        raise WorkloadError('"prompt" must be a non-empty string')
    # bool is an int subclass; `true` is not a length.
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise WorkloadError(f'"output_len" must be an integer >= 1, got {output_len!r}')
    return RequestSpec(output_len=output_len, text=prompt)
