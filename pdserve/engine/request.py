"""A request's state inside one engine: its tokens, progress and how it left.

The engine core owns these objects; the scheduler moves them between its waiting and
running queues and the KV cache manager keys blocks by `req_id`. A request leaves an
engine FINISHED (with a `FinishReason` its caller sees) or HANDED_OFF: a prefill node's
engine lets go of it at its first token, its KV still held, and it goes on elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.prompt_logprobs import PromptLogprobs
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch: the router and the node fronts read requests' enums without it
    from pdserve.engine.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    SWAPPED = "swapped"  # preempted with its KV in the host swap space (pdserve/engine/swap_space.py)
    HANDED_OFF = "handed_off"  # left at its first token with its KV; not finished, so no FinishReason


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"  # cancelled by the caller


@dataclass(frozen=True, slots=True)
class PendingFork:
    """A sample to fork from the request's next sampled token (the n samples of one prompt)."""

    req_id: str
    sample_index: int


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int  # order of arrival: the preemption victim is the latest
    seed: int
    sample_index: int = 0  # which of the n samples of the caller's request
    # prompt + output; the scheduler computes KV for all of these.
    token_ids: list[int] = field(default_factory=list)
    # A resumed request (its first node failed) starts with the tokens already generated.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    arrival_time: float = 0.0  # when it joined the scheduler's queue (pdserve/engine/prompt_admission.py)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Collected while the prompt is computed, when the params ask; handed out (and None from
    # then on) with the first token this engine samples.
    prompt_logprobs: PromptLogprobs | None = None
    # Samples drawn from the same logits as this request's next token, each then forked off
    # sharing its blocks (engine_core.EngineCore.fork); emptied once they are.
    pending_forks: list[PendingFork] = field(default_factory=list)
    # The matcher of a constrained request (params.structured_output), attached once its grammar is
    # compiled; it is scheduled only then (pdserve/engine/grammar.py's GrammarGate).
    grammar: RequestGrammar | None = None
    # Does it leave this engine at its first sampled token, its KV held for a decode node (a
    # prompt exported by a prefill node, or by a decode node started with --serve-prefill)?
    hands_off: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs(self.params.prompt_logprobs)

    @property
    def scores_prompt(self) -> bool:
        """Does this request still need the logits of prompt positions it has not scored?"""
        collected = self.prompt_logprobs
        return collected is not None and len(collected) < self.num_prompt_tokens - 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def hand_off(self) -> None:
        self.status = RequestStatus.HANDED_OFF
