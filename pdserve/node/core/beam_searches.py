"""What a node kind that runs beam searches (colocated, decode) shares: the option read into the
engine's `BeamSearchParams`, and a finished search as the one `BeamsDone` message it answers.

Must never: run a search (pdserve/engine/beam_runner.py does) or answer the front itself.
"""

from __future__ import annotations

from pdserve.engine.admission import RequestRejected
from pdserve.engine.beam_runner import FinishedSearch
from pdserve.engine.beam_search import BeamSearchParams
from pdserve.engine.request import FinishReason
from pdserve.node.messages import BeamOption, BeamResult, BeamsDone, StreamSubmit


def beam_params(beam: BeamOption, msg: StreamSubmit) -> BeamSearchParams:
    """RequestRejected (naming the field) for a search no node can run."""
    if msg.resumed_token_ids:
        raise RequestRejected("resumed_token_ids: a beam search is never resumed")
    try:
        return BeamSearchParams(beam.beam_width, msg.params.max_tokens, beam.length_penalty, msg.params.ignore_eos)
    except ValueError as exc:
        raise RequestRejected(str(exc)) from exc


def beams_done(search: FinishedSearch) -> BeamsDone:
    beams = [BeamResult(h.token_ids, (FinishReason.STOP if h.ended_by_eos else FinishReason.LENGTH).value,
                        h.cum_logprob, h.score) for h in search.hypotheses]
    return BeamsDone(search.search_id, beams, search.num_prompt_tokens, search.num_cached_tokens)
