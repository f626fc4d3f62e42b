"""Beam search's bookkeeping: which beams go on and which hypotheses are finished, step by step.

Pure: it reads each running beam's top log-probabilities and answers the next beams (each
named by the beam it extends and the token it appends) and the finished hypotheses. It never
runs the model or holds blocks; pdserve/engine/beam_runner.py drives the engine with it.

The rules are transformers' `generate(num_beams=k, do_sample=False, early_stopping=False)`
(transformers/generation/utils.py `_beam_search`), so the same model gives the same sequences
in the same order:
  - a beam's score is its cumulative log-probability (float32, added as torch adds it);
  - each step the best `beams_to_keep = max(2, 1 + #eos) * k` candidates over all beams are
    taken (enough that k of them do not end in eos);
  - of those, the ones among the first k that end (eos, or max_tokens reached) become
    hypotheses scored `score / generated_len ** length_penalty` (eos counted in the length);
    only the best k hypotheses are kept; ending candidates past the first k are dropped;
  - the best k candidates that do not end are the next beams;
  - it stops once every candidate ends (max_tokens) or, with k hypotheses held, the best
    running score / generated_len ** length_penalty cannot beat the worst of them;
  - hypotheses come back best first.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import MAX_LOGPROBS, _as_float, _as_int, beams_to_keep


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "beam_width", _as_int("beam_width", self.beam_width))
        object.__setattr__(self, "max_tokens", _as_int("max_tokens", self.max_tokens))
        object.__setattr__(self, "length_penalty", _as_float("length_penalty", self.length_penalty))
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    def beams_to_keep(self, num_eos: int) -> int:
        """Candidates taken per step; each beam must report this many top log-probabilities."""
        keep = beams_to_keep(self.beam_width, num_eos, self.ignore_eos)
        if keep > MAX_LOGPROBS:
            raise ValueError(f"beam_width {self.beam_width} needs the top {keep} log-probabilities of every beam "
                             f"(model with {num_eos} eos ids); at most {MAX_LOGPROBS}")
        return keep


@dataclass(slots=True)
class Beam:
    token_ids: list[int]  # generated so far
    score: torch.Tensor  # float32 scalar: cumulative log-probability


@dataclass(slots=True)
class Hypothesis:
    token_ids: list[int]  # generated, eos included when eos ended it
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    ended_by_eos: bool


@dataclass(frozen=True, slots=True)
class NextBeam:
    parent: int  # index into the previous step's beams
    token_id: int
    score: torch.Tensor


@dataclass(slots=True)
class BeamTop:
    """One running beam's reported top log-probabilities, most likely first."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]


@dataclass(slots=True)
class BeamSearchState:
    params: BeamSearchParams
    eos_token_ids: Collection[int]
    beams: list[Beam] = field(default_factory=lambda: [Beam([], torch.zeros((), dtype=torch.float32))])
    hypotheses: list[tuple[torch.Tensor, Hypothesis]] = field(default_factory=list)  # best first
    done: bool = False

    def step(self, tops: Sequence[BeamTop]) -> list[NextBeam]:
        """Advance one token given every running beam's tops (in `beams` order); the new beams,
        or [] once the search is done (then `results()`)."""
        assert len(tops) == len(self.beams), f"{len(tops)} tops for {len(self.beams)} beams"
        k = self.params.beam_width
        keep = self.params.beams_to_keep(len(self.eos_token_ids))
        candidates = self._candidates(tops)[:keep]
        length = len(self.beams[0].token_ids) + 1
        ends = [self._ends(c.token_id, length) for c in candidates]
        for rank, (c, end) in enumerate(zip(candidates, ends)):
            if end and rank < k:
                self._add_hypothesis(c, length)
        following = [c for c, end in zip(candidates, ends) if not end][:k]
        if all(ends) or not self._can_improve(following, length):
            self.done = True
            return []
        self.beams = [Beam([*self.beams[c.parent].token_ids, c.token_id], c.score) for c in following]
        return following

    def results(self) -> list[Hypothesis]:
        return [h for _, h in self.hypotheses]

    def _candidates(self, tops: Sequence[BeamTop]) -> list[NextBeam]:
        out = []
        for i, (beam, top) in enumerate(zip(self.beams, tops)):
            scores = torch.tensor(top.logprobs, dtype=torch.float32) + beam.score  # float32, as transformers adds
            out.extend(NextBeam(i, int(t), s) for t, s in zip(top.token_ids, scores))
        # Best first; equal scores keep transformers' flattened (beam, token) order.
        return sorted(out, key=lambda c: (-float(c.score), c.parent, c.token_id))

    def _ends(self, token_id: int, length: int) -> bool:
        eos = not self.params.ignore_eos and token_id in self.eos_token_ids
        return eos or length >= self.params.max_tokens

    def _add_hypothesis(self, c: NextBeam, length: int) -> None:
        normalised = c.score / (length ** self.params.length_penalty)  # float32 tensor, as transformers divides
        tokens = [*self.beams[c.parent].token_ids, c.token_id]
        eos = not self.params.ignore_eos and c.token_id in self.eos_token_ids
        hyp = Hypothesis(tokens, float(c.score), float(normalised), eos)
        merged = [*self.hypotheses, (normalised, hyp)]
        merged.sort(key=lambda item: -float(item[0]))  # stable: earlier hypotheses win ties
        self.hypotheses = merged[: self.params.beam_width]

    def _can_improve(self, following: list[NextBeam], length: int) -> bool:
        """transformers' early_stopping=False heuristic: the best running beam at today's length."""
        if len(self.hypotheses) < self.params.beam_width:
            return True
        best_running = following[0].score / (length ** self.params.length_penalty)
        worst = min(float(s) for s, _ in self.hypotheses)
        return float(best_running) > worst
