"""Turns engine-core tokens into what a caller sees: text deltas, stop strings, finish reasons.

One `SequenceStream` per generated sequence. It detokenizes incrementally, cuts the
text at the first stop string (the stop string itself is not returned) and, while a
stop string could still be forming, holds back the last few characters of a stream so
a caller never receives text that is later taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # types only: the router detokenizes without loading torch or model code
    from pdserve.engine.engine_core import EngineCoreOutput
    from pdserve.engine.prompt_logprobs import PromptLogprobs
    from pdserve.engine.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionDelta:
    """What one sequence produced in one step."""

    req_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the params ask


@dataclass(slots=True)
class SequenceStream:
    req_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    hold_back: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold_back = max((len(s) for s in self.params.stop), default=1) - 1

    def push(self, out: EngineCoreOutput) -> CompletionDelta:
        """Consume one token from the core; returns the delta to show the caller."""
        delta = self.push_token(out.new_token_id, out.logprobs, out.finish_reason)
        delta.prompt_logprobs = out.prompt_logprobs
        return delta

    def push_token(
        self, token_id: int, logprobs: TokenLogprobs | None, finish_reason: FinishReason | None
    ) -> CompletionDelta:
        """Consume one token, wherever it was sampled (a local core or a remote node)."""
        text = self.push_text(token_id, finish_reason)
        return CompletionDelta(
            self.req_id,
            text,
            [token_id],
            [logprobs] if logprobs is not None else [],
            self.finish_reason,
            self.stop_reason,
        )

    def push_text(self, token_id: int, finish_reason: FinishReason | None) -> str:
        """`push_token`'s text alone (the router relays a node's tokens and needs no delta object per token)."""
        before = len(self.text)
        self.text += self.detokenizer.push(token_id)
        if finish_reason is not None:
            self.text += self.detokenizer.flush()  # a trailing partial character, as decode() shows it
        self.finish_reason = finish_reason
        if finish_reason is FinishReason.STOP and token_id in self.params.stop_token_ids:
            self.stop_reason = token_id
        self._check_stop_strings(before)
        return self._take_text()

    def finish(self, finish_reason: FinishReason) -> CompletionDelta:
        """End the sequence without a new token (the sampler's node ended it after the last one)."""
        before = len(self.text)
        self.text += self.detokenizer.flush()
        self.finish_reason = finish_reason
        self._check_stop_strings(before)
        return CompletionDelta(self.req_id, self._take_text(), [], [], self.finish_reason, self.stop_reason)

    @property
    def hit_stop_string(self) -> bool:
        return isinstance(self.stop_reason, str)

    def _check_stop_strings(self, before: int) -> None:
        if not self.params.stop or self.hit_stop_string:
            return
        window_start = max(0, before - self.hold_back)
        hits = [(self.text.find(s, window_start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.text = self.text[:index]
        self.finish_reason = FinishReason.STOP
        self.stop_reason = stop

    def _take_text(self) -> str:
        end = len(self.text) if self.finish_reason else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
