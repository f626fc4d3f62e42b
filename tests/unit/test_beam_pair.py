"""A beam search on a prefill + decode pair (decode_node/core.py, `BeamSearches.adopt`): the prefill
node computes the prompt and samples it with the search's top 2k logprobs; the decode node starts
the search from the imported prompt. Same hypotheses as one engine running the search itself;
every block returned, whether the search ends, is aborted mid-search, or before its KV arrives.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.beam_runner import BeamSearchRunner
from pdserve.engine.beam_search import BeamSearchParams
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.errors import ErrorCode
from pdserve.node.messages import Abort, BeamOption, BeamsDone, PrefillSubmit, Ready, RequestFailed, StreamSubmit
from pdserve.prefill_node.kv_export import prefill_params

from .node_pair import Pair, engine_config


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def start(pair: Pair, req_id: str, prompt: list[int], params: BeamSearchParams, keep: int | None = None) -> Ready:
    """Play the router: reserve on the decode node, then prefill with the search's logprobs."""
    node_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
    pair.decode.handle(StreamSubmit(req_id, prompt, node_params, 0, imports_kv=True, beam=BeamOption(params.beam_width,
                                                                                    params.length_penalty)))
    ready = pair.d_out.pop()
    assert isinstance(ready, Ready), ready
    keep = 2 * params.beam_width if keep is None else keep
    sampled = prefill_params(SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=keep))
    pair.prefill.handle(PrefillSubmit(req_id, prompt, sampled, 0, ready.kv_layout_id, ready.block_ids,
                                      kv_layout=pair.d_layout))
    return ready


@pytest.mark.parametrize("prompt_len", [1, 8, 11])
def test_a_search_on_a_pair_equals_one_engine_running_it(model, prompt_len):
    prompt = [(7 * i + 3) % 900 + 5 for i in range(prompt_len)]
    params = BeamSearchParams(beam_width=3, max_tokens=7, length_penalty=0.5, ignore_eos=True)
    pair = Pair(*model)
    start(pair, "search", prompt, params)
    pair.run()
    (done,) = [m for m in pair.d_out if isinstance(m, BeamsDone)]
    colocated = EngineCore(engine_config(model[0], 64), ColocatedPolicy(), model[1])
    (expected,) = BeamSearchRunner(colocated).run([prompt], params)
    assert [b.token_ids for b in done.beams] == [h.token_ids for h in expected]
    assert [b.score for b in done.beams] == pytest.approx([h.score for h in expected], rel=1e-5, abs=1e-6)
    assert (done.req_id, done.num_prompt_tokens) == ("search", prompt_len)
    assert pair.all_blocks_returned()


def test_a_search_of_one_token_ends_at_its_first_step(model):
    pair = Pair(*model)
    start(pair, "short", [5, 6, 7], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True))
    pair.run()
    (done,) = [m for m in pair.d_out if isinstance(m, BeamsDone)]
    assert [len(b.token_ids) for b in done.beams] == [1, 1]
    assert pair.all_blocks_returned()


def test_an_aborted_search_frees_every_beam_and_its_reservation(model):
    pair = Pair(*model)
    params = BeamSearchParams(beam_width=4, max_tokens=40, ignore_eos=True)
    start(pair, "mid", list(range(5, 16)), params)
    for _ in range(6):
        pair.tick()
    assert pair.d_engine.kv.num_used_blocks > 0 and len(pair.decode.beams) == 1
    pair.decode.handle(Abort("mid"))
    pair.run()
    assert len(pair.decode.beams) == 0 and not [m for m in pair.d_out if isinstance(m, BeamsDone)]
    # Before its KV arrives: the reservation alone is freed.
    pair.decode.handle(StreamSubmit("early", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), 0, imports_kv=True,
                                    beam=BeamOption(2, 1.0)))
    assert isinstance(pair.d_out.pop(), Ready) and pair.table.num_reserved_blocks == 1
    pair.decode.handle(Abort("early"))
    assert pair.table.num_reserved_blocks == 0
    assert pair.all_blocks_returned()


def test_a_prefill_that_reports_too_few_logprobs_fails_the_search_and_frees_it(model):
    pair = Pair(*model)
    start(pair, "few", [5, 6, 7, 8], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True), keep=2)
    pair.run()
    (failed,) = pair.failures("d").values()
    assert failed.code is ErrorCode.INTERNAL and "top 6 log-probabilities" in failed.message
    assert pair.all_blocks_returned()
