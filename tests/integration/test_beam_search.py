"""Beam search on a real model: the same sequences, in the same order, as transformers
`generate(num_beams=k, do_sample=False, length_penalty=...)` in float32; beams share blocks
(copy-on-write counted) and every test ends with zero blocks in use."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve import LLM
from pdserve.engine.beam_search import BeamSearchParams
from pdserve.engine.beam_runner import BeamSearches
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams

from .reference import greedy_references, peak_blocks, transformers_beams

PROMPTS = [[5, 17, 99, 3, 44, 8, 21, 7, 60, 13, 2], list(range(1, 20)), [9, 9, 9]]
# Tokens the tiny llama's beams produce mid-search on PROMPTS[0] (found by running it): made eos
# in a copy of the model, so beams end early and the length penalty ranks unequal lengths.
FREQUENT_TOKENS = [524, 236]


@pytest.fixture(scope="module")
def eos_model_dir(model_dirs, tmp_path_factory):
    target = tmp_path_factory.mktemp("beam") / "llama-eos"
    shutil.copytree(model_dirs["llama"], target)
    path = target / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = [*FREQUENT_TOKENS, 0]
    path.write_text(json.dumps(config))
    return target


def check_against_transformers(llm: LLM, model_dir, params: BeamSearchParams, eos) -> None:
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        expected, scores = transformers_beams(model_dir, prompt, params, eos)
        assert [s.token_ids for s in out.sequences] == expected
        if scores is not None:
            assert [s.score for s in out.sequences] == pytest.approx(scores, rel=1e-5, abs=1e-5)
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("beam_width,length_penalty,max_tokens", [(3, 1.0, 12), (4, 0.5, 10), (2, 2.0, 9), (1, 1.0, 6)])
def test_beams_equal_transformers_to_max_tokens(model_dirs, beam_width, length_penalty, max_tokens):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=16)
    params = BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos=True)
    check_against_transformers(llm, model_dirs["llama"], params, eos=None)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_beams_ending_in_eos_equal_transformers(eos_model_dir, length_penalty):
    llm = LLM(eos_model_dir, dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=16)
    params = BeamSearchParams(beam_width=3, max_tokens=14, length_penalty=length_penalty)
    if length_penalty <= 1.0:  # a stronger penalty favours the longer beams that eos did not end
        (out,) = llm.beam_search(PROMPTS[:1], params)
        assert any(s.finish_reason is FinishReason.STOP for s in out.sequences)
    check_against_transformers(llm, eos_model_dir, params, eos=[*FREQUENT_TOKENS, 0])


def test_beams_share_blocks_and_copy_only_partial_blocks_they_write(model_dirs):
    # Block size 4, prompt of 11 tokens: the prompt's last block is partial and shared by every beam.
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
              enable_prefix_caching=False)
    kv = llm.engine.kv
    params = BeamSearchParams(beam_width=3, max_tokens=1 + 4, ignore_eos=True)
    with peak_blocks(llm) as peak:
        (out,) = llm.beam_search(PROMPTS[:1], params)
    expected, _ = transformers_beams(model_dirs["llama"], PROMPTS[0], params, None)
    assert [s.token_ids for s in out.sequences] == expected
    # Unshared, 3 beams of 11 + 4 computed tokens would hold 3 * 4 = 12 blocks; sharing the 2 full
    # prompt blocks holds at most 2 + 3 * 2 = 8.
    assert peak[0] <= 8
    # Every copy is of a partial block one beam wrote while another held it: at most one per
    # beam per step after the first, so fewer than width * (max_tokens - 1).
    assert 0 < kv.num_cow_copies <= 3 * 4
    assert kv.num_used_blocks == 0


def test_beam_width_beyond_the_logprobs_limit_is_refused(model_dirs):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4, ignore_eos=True).beams_to_keep(0)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_searches_run_beside_ordinary_requests_in_the_same_steps(model_dirs):
    """What a node's core loop does: every step's outputs go through `BeamSearches.take`; the
    ordinary request's outputs come back untouched and token-exact, the beams equal transformers."""
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=16)
    engine = llm.engine
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    searches = BeamSearches(engine)
    searches.add("s0", PROMPTS[0], params)
    engine.add_request("plain", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    searches.add("s1", PROMPTS[2], params)
    plain: list[int] = []
    finished = {}
    steps_with_both = 0
    while engine.has_unfinished():
        others, done = searches.take(engine.step())
        steps_with_both += bool(others) and len(searches) > 0
        plain += [o.new_token_id for o in others]
        finished.update((f.search_id, f) for f in done)
    assert steps_with_both > 0
    assert plain == greedy_references(model_dirs["llama"], [PROMPTS[1]], [10])[0].token_ids
    for search_id, prompt in (("s0", PROMPTS[0]), ("s1", PROMPTS[2])):
        expected, _ = transformers_beams(model_dirs["llama"], prompt, params, None)
        assert [h.token_ids for h in finished[search_id].hypotheses] == expected
        assert finished[search_id].num_prompt_tokens == len(prompt)
    assert engine.kv.num_used_blocks == 0


def test_an_aborted_search_frees_every_beam(model_dirs):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=16)
    searches = BeamSearches(llm.engine)
    searches.add("s", PROMPTS[1], BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        assert searches.take(llm.engine.step()) == ([], [])
    assert llm.engine.kv.num_used_blocks > 0
    assert searches.abort("s") and not searches.abort("s")
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.has_unfinished()
