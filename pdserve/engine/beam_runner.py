"""Runs beam searches on one engine core: every beam is an engine request, forked from its parent.

`BeamSearches` is step-incremental, so a node's core loop runs searches beside ordinary
requests in the same engine steps: it feeds every step's outputs to `take`, which keeps the
beams' outputs, advances the searches they complete and hands back the other requests'
outputs untouched, with the searches that ended. `BeamSearchRunner` (the offline
`LLM.beam_search`) is the same object driven by a loop of its own.

A search starts as one request (its prompt): `add` computes it here; `adopt` takes over one whose
prompt KV a prefill node computed and imported (`EngineCore.add_prefilled`), with the prompt's top
log-probabilities that node reported, so its first step is already taken. Each step every running beam samples (greedy,
reporting its top `beams_to_keep` log-probabilities) and is paused; once all beams of a search
have reported, `BeamSearchState` picks the next beams and this module turns them into requests:
  - a next beam that extends beam b with b's own greedy token *is* b (resumed as it is);
  - any other (b, token) is `EngineCore.fork(b, child, token)`: the child shares b's blocks,
    and the partial last block is copied only when one of them writes it (copy-on-write);
  - beams nobody extends are aborted, which frees what only they held.
Forks are made before aborts so a shared block never drops to zero references in between.
A search that ends (or is aborted) aborts every beam it still holds: no block outlives it.
Must never: choose tokens itself (BeamSearchState does) or touch blocks (the engine does).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.admission import RequestRejected
from pdserve.engine.beam_search import BeamSearchParams, BeamSearchState, BeamTop, Hypothesis, NextBeam
from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class FinishedSearch:
    search_id: str
    hypotheses: list[Hypothesis]  # best first
    num_prompt_tokens: int
    num_cached_tokens: int  # of the prompt, found in the prefix cache


@dataclass(slots=True)
class _Search:
    search_id: str
    state: BeamSearchState
    req_ids: list[str]  # the running beams' requests, in `state.beams` order
    reported: dict[str, EngineCoreOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0

    @property
    def complete(self) -> bool:
        return len(self.reported) == len(self.req_ids)


class BeamSearches:
    """Every beam search running on one engine, advanced by that engine's step outputs."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._eos = tuple(engine.loaded.eos_token_ids)
        self._searches: dict[str, _Search] = {}
        self._owner: dict[str, _Search] = {}  # beam req_id -> its search
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._searches)

    def add(self, search_id: str, prompt: list[int], params: BeamSearchParams) -> None:
        """Start a search; RequestRejected (naming the field) when it can never run here."""
        beam_params = self.request_params(search_id, prompt, params)
        req_id = self._beam_id(search_id)
        self.engine.add_request(req_id, prompt, beam_params)
        self._register(search_id, params, req_id)

    def request_params(self, search_id: str, prompt: list[int], params: BeamSearchParams) -> SamplingParams:
        """The params of the search's first request (every beam's), once the search is known to fit
        here; RequestRejected (naming the field) when it can never run here."""
        _check_single_rank(self.engine)
        if search_id in self._searches:
            raise RequestRejected(f"request_id {search_id!r} is already in use")
        try:
            keep = params.beams_to_keep(len(self._eos))
        except ValueError as exc:
            raise RequestRejected(str(exc)) from exc
        self._check_fits(prompt, params)
        # The engine never ends a beam itself: eos and max_tokens are the search's to apply.
        return SamplingParams(temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True, logprobs=keep)

    def adopt(self, search_id: str, params: BeamSearchParams, first: EngineCoreOutput,
              top: BeamTop) -> list[FinishedSearch]:
        """Start a search whose prompt was computed elsewhere (a prefill node): `first` is its request's
        first output here (`EngineCore.add_prefilled`, made with `request_params`), `top` the prompt's
        last position's top log-probabilities as the prefill node reported them. Its first step is
        taken at once; the search, if that already ended it."""
        keep = params.beams_to_keep(len(self._eos))
        if len(top.token_ids) < keep or len(top.logprobs) != len(top.token_ids):
            raise ValueError(f"search {search_id!r} needs the prompt's top {keep} log-probabilities; "
                             f"got {len(top.token_ids)}")
        self._register(search_id, params, first.req_id)
        logprobs = TokenLogprobs(top.logprobs[0], list(top.token_ids[:keep]), list(top.logprobs[:keep]))
        _, finished = self.take([dataclasses.replace(first, logprobs=logprobs)])
        return finished

    def _register(self, search_id: str, params: BeamSearchParams, req_id: str) -> None:
        search = _Search(search_id, BeamSearchState(params, self._eos), [req_id])
        self._searches[search_id] = search
        self._owner[req_id] = search

    def take(self, outputs: Sequence[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[FinishedSearch]]:
        """One step's outputs: those of requests that are not beams, and the searches that ended."""
        others: list[EngineCoreOutput] = []
        touched: dict[str, _Search] = {}
        for out in outputs:
            search = self._owner.get(out.req_id)
            if search is None:
                others.append(out)
                continue
            assert out.finish_reason is None, "beam requests are never ended by the engine"
            self.engine.pause(out.req_id)  # until its search has heard from every beam
            if not search.reported and len(search.req_ids) == 1 and not search.state.beams[0].token_ids:
                search.num_cached_tokens = out.num_cached_tokens  # the prompt's first step
            search.reported[out.req_id] = out
            touched[search.search_id] = search
        finished = [self._advance(s) for s in touched.values() if s.complete]
        return others, [f for f in finished if f is not None]

    def search_of(self, req_id: str) -> str | None:
        """The search a beam's engine request belongs to (None: not a beam)."""
        search = self._owner.get(req_id)
        return search.search_id if search is not None else None

    def abort(self, search_id: str) -> bool:
        """Drop a search and every beam it holds (their blocks are freed); False if unknown."""
        search = self._searches.pop(search_id, None)
        if search is None:
            return False
        for req_id in search.req_ids:
            self.engine.abort(req_id)
            del self._owner[req_id]
        return True

    def abort_all(self) -> None:
        for search_id in list(self._searches):
            self.abort(search_id)

    def _advance(self, search: _Search) -> FinishedSearch | None:
        tops = [_top(search.reported[r]) for r in search.req_ids]
        num_prompt_tokens = search.reported[search.req_ids[0]].num_prompt_tokens
        following = search.state.step(tops)
        if search.state.done:
            self.abort(search.search_id)
            return FinishedSearch(search.search_id, search.state.results(), num_prompt_tokens,
                                  search.num_cached_tokens)
        new_ids = self._requests_for(search, following)
        for req_id in set(search.req_ids) - set(new_ids):
            self.engine.abort(req_id)
            del self._owner[req_id]
        for req_id in set(search.req_ids) & set(new_ids):
            self.engine.resume(req_id)
        search.req_ids, search.reported = new_ids, {}
        return None

    def _requests_for(self, search: _Search, following: list[NextBeam]) -> list[str]:
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
            child_id = self._beam_id(search.search_id)
            out = self.engine.fork(parent_id, child_id, beam.token_id)
            assert out.finish_reason is None, "beam requests are never ended by the engine"
            self._owner[child_id] = search
            new_ids.append(child_id)
        return new_ids

    def _beam_id(self, search_id: str) -> str:
        return f"{search_id}/beam-{next(self._ids)}"

    def _check_fits(self, prompt: list[int], params: BeamSearchParams) -> None:
        if len(prompt) + params.max_tokens >= self.engine.max_model_len:
            raise RequestRejected(f"max_tokens: prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} do "
                                  f"not fit the model's {self.engine.max_model_len} (a beam computes one token more "
                                  "than it keeps)")


class BeamSearchRunner:
    """Offline: runs a batch of searches to the end, stepping the engine itself."""

    def __init__(self, engine: EngineCore) -> None:
        _check_single_rank(engine)
        self.engine = engine
        self._searches = BeamSearches(engine)

    def run(self, prompts: Sequence[list[int]], params: BeamSearchParams, prefix: str = "beam") -> list[list[Hypothesis]]:
        """Each prompt's `beam_width` hypotheses, best first."""
        ids = [f"{prefix}-{i}" for i in range(len(prompts))]
        results: dict[str, list[Hypothesis]] = {}
        try:
            for search_id, prompt in zip(ids, prompts):
                self._searches.add(search_id, prompt, params)
            while len(self._searches):
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished():
                    raise RuntimeError("beam search stalled: beams wait with nothing scheduled")
                others, finished = self._searches.take(outputs)
                assert not others, "the offline runner's engine runs only beams"
                results.update((f.search_id, f.hypotheses) for f in finished)
        finally:
            self._searches.abort_all()
        return [results[search_id] for search_id in ids]


def _check_single_rank(engine: EngineCore) -> None:
    if engine.config.tensor_parallel_size > 1:
        # Copy-on-write reaches every rank, but beam search is only checked on one.
        raise RequestRejected("beam_width: beam search runs on a single-rank engine (tensor_parallel_size 1)")


def _top(out: EngineCoreOutput) -> BeamTop:
    assert out.logprobs is not None, "beam requests ask for logprobs"
    return BeamTop(out.logprobs.top_token_ids, out.logprobs.top_logprobs)
