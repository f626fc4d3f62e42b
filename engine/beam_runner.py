"""Runs beam searches on one engine core: every beam is an engine request, forked from its parent.

A search starts as one request (its prompt). Each step every running beam samples (greedy,
reporting its top `beams_to_keep` log-probabilities) and is paused; once all beams of a search
have reported, `BeamSearchState` picks the next beams and this module turns them into requests:
  - a next beam that extends beam b with b's own greedy token *is* b (resumed as it is);
  - any other (b, token) is `EngineCore.fork(b, child, token)`: the child shares b's blocks,
    and the partial last block is copied only when one of them writes it (copy-on-write);
  - beams nobody extends are aborted, which frees what only they held.
Forks are made before aborts so a shared block never drops to zero references in between.
Beams of different searches, and the beams of one search, run batched in the same steps.
Must never: choose tokens itself (BeamSearchState does) or touch blocks (the engine does).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.beam_search import BeamSearchParams, BeamSearchState, BeamTop, Hypothesis, NextBeam
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _Search:
    state: BeamSearchState
    req_ids: list[str]  # the running beams' requests, in `state.beams` order
    reported: dict[str, EngineCoreOutput] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.reported) == len(self.req_ids)


class BeamSearchRunner:
    def __init__(self, engine: EngineCore) -> None:
        if engine.config.tensor_parallel_size > 1:
            # Copy-on-write reaches every rank, but beam search is only checked on one.
            raise ValueError("beam search runs on a single-rank engine (tensor_parallel_size 1)")
        self.engine = engine
        self._ids = itertools.count()

    def run(self, prompts: Sequence[list[int]], params: BeamSearchParams, prefix: str = "beam") -> list[list[Hypothesis]]:
        """Each prompt's `beam_width` hypotheses, best first."""
        eos = tuple(self.engine.loaded.eos_token_ids)
        keep = params.beams_to_keep(len(eos))
        # The engine never ends a beam itself: eos and max_tokens are the search's to apply.
        beam_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True, logprobs=keep)
        searches: list[_Search] = []
        owner: dict[str, _Search] = {}
        try:
            for i, prompt in enumerate(prompts):
                self._check_fits(prompt, params)
                req_id = f"{prefix}-{i}-{next(self._ids)}"
                self.engine.add_request(req_id, prompt, beam_params)
                search = _Search(BeamSearchState(params, eos), [req_id])
                searches.append(search)
                owner[req_id] = search
            self._drive(searches, owner)
        finally:
            for req_id in owner:
                self.engine.abort(req_id)
        return [s.state.results() for s in searches]

    def _drive(self, searches: list[_Search], owner: dict[str, _Search]) -> None:
        while any(not s.state.done for s in searches):
            outputs = self.engine.step()
            if not outputs and not self.engine.has_unfinished():
                raise RuntimeError("beam search stalled: beams wait with nothing scheduled")
            for out in outputs:
                assert out.finish_reason is None, "beam requests are never ended by the engine"
                self.engine.pause(out.req_id)  # until its search has heard from every beam
                owner[out.req_id].reported[out.req_id] = out
            for search in searches:
                if not search.state.done and search.complete:
                    self._advance(search, owner)

    def _advance(self, search: _Search, owner: dict[str, _Search]) -> None:
        tops = [_top(search.reported[r]) for r in search.req_ids]
        following = search.state.step(tops)
        new_ids = self._requests_for(search, following, owner)
        for req_id in set(search.req_ids) - set(new_ids):
            self.engine.abort(req_id)
            del owner[req_id]
        for req_id in set(search.req_ids) & set(new_ids):
            self.engine.resume(req_id)
        search.req_ids, search.reported = new_ids, {}

    def _requests_for(self, search: _Search, following: list[NextBeam], owner: dict[str, _Search]) -> list[str]:
        """The request of every next beam: the parent itself when it continues with its own greedy
        token (once), else a fork of it."""
        new_ids: list[str] = []
        kept: set[str] = set()
        for beam in following:
            parent_id = search.req_ids[beam.parent]
            if beam.token_id == search.reported[parent_id].new_token_id and parent_id not in kept:
                kept.add(parent_id)
                new_ids.append(parent_id)
                continue
            child_id = f"{parent_id.rsplit('-', 1)[0]}-{next(self._ids)}"
            out = self.engine.fork(parent_id, child_id, beam.token_id)
            assert out.finish_reason is None, "beam requests are never ended by the engine"
            owner[child_id] = search
            new_ids.append(child_id)
        return new_ids

    def _check_fits(self, prompt: list[int], params: BeamSearchParams) -> None:
        if len(prompt) + params.max_tokens >= self.engine.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} do not fit the "
                             f"model's {self.engine.max_model_len} (a beam computes one token more than it keeps)")


def _top(out: EngineCoreOutput) -> BeamTop:
    assert out.logprobs is not None, "beam requests ask for logprobs"
    return BeamTop(out.logprobs.top_token_ids, out.logprobs.top_logprobs)
