"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

Owns what a request that asks (`SamplingParams.prompt_logprobs = k`) collects while its
prompt is computed — `PromptLogprobs`, one entry per prompt token after the first (token 0
has nothing before it to score it) — which positions of a step's chunk still have to be
scored (`positions_to_score`), and vLLM's offline shape of the result (`as_vllm`).

The logprob of prompt token i+1 comes from the logits at position i, so a chunk scores its
own tokens but the first token of the next chunk too (from its last row), and the prompt's
last position scores nothing: its logits give the first sampled token. Entries are kept in
position order and never dropped, so a request preempted mid-prompt recomputes its KV from
position 0 but scores only the positions it had not scored yet: each entry exactly once.

Must never import torch (the router and the node fronts read these types) or decide what
is scheduled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: no torch here
    from pdserve.engine.request import Request
    from pdserve.engine.sampler import TokenLogprobs


@dataclass(slots=True)
class PromptLogprobs:
    """Entry j scores prompt token j+1: `token_ids[j]`, its logprob and the top alternatives."""

    num_top: int  # the request's prompt_logprobs
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} prompt tokens but {len(logprobs)} logprobs")
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)


def positions_to_score(request: Request, num_scheduled: int) -> range:
    """Positions of this step's chunk whose logits score a prompt token not scored yet.

    Position p scores prompt token p+1, so positions run up to the prompt's second to last;
    those already scored (before a preemption reset `num_computed_tokens`) are skipped.
    """
    collected = request.prompt_logprobs
    if collected is None:
        return range(0)
    start = max(request.num_computed_tokens, len(collected))
    end = min(request.num_computed_tokens + num_scheduled, request.num_prompt_tokens - 1)
    return range(start, max(start, end))


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's `Logprob`: one token's logprob, its 1-based rank in the distribution when it is
    known (a top alternative's place; the prompt token's own when it is among them, else
    None), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def as_vllm(collected: PromptLogprobs, decode: Callable[[int], str]) -> list[dict[int, Logprob] | None]:
    """vLLM's `RequestOutput.prompt_logprobs`: None for the first prompt token, then per token a
    dict token id -> Logprob holding the token itself and its top alternatives."""
    out: list[dict[int, Logprob] | None] = [None]
    for token_id, lp in zip(collected.token_ids, collected.logprobs):
        ranks = {t: rank for rank, t in enumerate(lp.top_token_ids, 1)}
        # The prompt token first, as vLLM orders it; then the alternatives, most likely first.
        entry = {token_id: Logprob(lp.token_logprob, ranks.get(token_id), decode(token_id))}
        for t, v in zip(lp.top_token_ids, lp.top_logprobs):
            entry.setdefault(t, Logprob(v, ranks[t], decode(t)))
        out.append(entry)
    return out
