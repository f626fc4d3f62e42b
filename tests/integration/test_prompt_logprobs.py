"""Prompt logprobs from the offline API equal transformers' log_softmax of the same forward.

In float32, within 1e-5: chunked prompts (longer than max_num_batched_tokens), k = 0 and
k = 3, both model paths, a request preempted mid-prompt (each entry scored exactly once),
and a prompt already in the prefix cache (no hit taken: every position is computed).
Every test ends with zero blocks in use.
"""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model_loader import load_reference_model
from pdserve.engine.prompt_logprobs import Logprob

TOLERANCE = 1e-5
PROMPT = [(7 * i + 3) % 900 + 5 for i in range(150)]  # chunked by 32: five chunks, four boundaries


@pytest.fixture(scope="module")
def reference(model_dirs):
    """[len(prompt), vocab] float32 log_softmax of transformers' logits, one forward per prompt."""
    model = load_reference_model(model_dirs["llama"], torch.float32)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)

    return logprobs


def assert_prompt_logprobs(got: list[dict[int, Logprob] | None] | None, ref: torch.Tensor, prompt: list[int],
                           k: int) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None  # nothing before the first token scores it
    for i in range(1, len(prompt)):
        entry, row = got[i], ref[i - 1]  # position i-1 scores token i
        assert next(iter(entry)) == prompt[i]  # the prompt token first, as vLLM orders it
        assert abs(entry[prompt[i]].logprob - row[prompt[i]].item()) <= TOLERANCE, f"prompt token {i}"
        top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == list(range(1, k + 1))
        # Values, not ids: a tiny random model's near-ties may order equal logprobs either way.
        expected = row.topk(k).values.tolist()
        assert all(abs(a.logprob - b) <= TOLERANCE for a, b in zip(top, expected)), f"top of prompt token {i}"
        assert set(entry) <= {prompt[i], *row.topk(k + 2).indices.tolist()}


def _no_leaks(llm: LLM) -> None:
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prompt_logprobs_equal_transformers(model_dirs, reference, impl, k):
    llm = LLM(model_dirs["llama"], dtype="float32", model_impl=impl, block_size=8, max_num_batched_tokens=32,
              max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k)
    short = PROMPT[:5]  # first, so the long prompt's first chunk shares its step: both score rows there
    short_out, long_out = llm.generate([short, PROMPT], params, use_tqdm=False)
    assert_prompt_logprobs(long_out.prompt_logprobs, reference(PROMPT), PROMPT, k)
    assert_prompt_logprobs(short_out.prompt_logprobs, reference(short), short, k)
    assert len(long_out.outputs[0].token_ids) == 3
    _no_leaks(llm)


def test_requests_that_do_not_ask_get_none_and_one_token_prompts_get_none_only(model_dirs):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=32, max_num_seqs=8)
    plain, single = llm.generate([PROMPT, PROMPT[:1]], [SamplingParams(max_tokens=2),
                                                        SamplingParams(max_tokens=2, prompt_logprobs=2)],
                                 use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert single.prompt_logprobs == [None]
    _no_leaks(llm)


def test_a_cached_prompt_is_computed_again_and_scores_the_same(model_dirs, reference):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks now in the prefix cache
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert out.outputs[0].token_ids and llm.engine.kv.pool.stats.hits == 0
    assert_prompt_logprobs(out.prompt_logprobs, reference(PROMPT), PROMPT, 1)
    _no_leaks(llm)


def test_n_samples_score_the_prompt_once(model_dirs, reference):
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert_prompt_logprobs(out.prompt_logprobs, reference(PROMPT), PROMPT, 2)
    _no_leaks(llm)


def test_a_request_preempted_mid_prompt_scores_each_token_once(model_dirs, reference):
    """A decoding request outgrows a small pool while a second, scoring its prompt, is
    mid-prompt: the second is preempted (its blocks freed, its scores kept) and recomputed."""
    llm = LLM(model_dirs["llama"], dtype="float32", block_size=8, num_blocks=24, max_num_batched_tokens=32,
              max_num_seqs=8, enable_prefix_caching=False)
    engine = llm.engine
    first = PROMPT[:140]
    decoder = engine.add_request("decoder", first, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    while decoder.num_computed_tokens < len(first):
        engine.step()
    scorer = engine.add_request("scorer", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    preempted_with_scores, outputs = False, []
    while engine.has_unfinished():
        outputs.extend(o for o in engine.step() if o.req_id == "scorer")
        collected = scorer.prompt_logprobs
        preempted_with_scores |= (scorer.num_computed_tokens == 0 and collected is not None and len(collected) > 0)
    assert preempted_with_scores, "the scorer was never preempted mid-prompt"
    (out,) = outputs
    assert out.prompt_logprobs is not None and out.prompt_logprobs.token_ids == PROMPT[1:]
    got = [None, *({t: Logprob(lp.token_logprob)} for t, lp in zip(out.prompt_logprobs.token_ids,
                                                                     out.prompt_logprobs.logprobs))]
    assert_prompt_logprobs_own(got, reference(PROMPT), PROMPT)
    _no_leaks(llm)


def assert_prompt_logprobs_own(got, ref: torch.Tensor, prompt: list[int]) -> None:
    assert len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(got[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) <= TOLERANCE, f"prompt token {i}"
