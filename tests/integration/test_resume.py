"""Resume after a node failure: prompt + the tokens already streamed, re-prefilled elsewhere.

A prefill core and a decode core in one process (tests/unit/node_pair.py) play the
second pair of nodes a sample resumes on: both get `resumed_token_ids` = the first k
tokens an uninterrupted run produced, the prefill node computes prompt + those and
samples token k+1, the decode node imports that KV and decodes the rest. Greedy output
must be transformers' reference from token k+1 on; seeded sampling (penalties and
min_tokens included) must give exactly the uninterrupted run's tokens, because the
draw is keyed by absolute output position and every rule counts the resumed tokens.
Every test ends with zero blocks in use on both engines.
"""

from __future__ import annotations

import pytest
import torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore, RequestRejected
from pdserve.engine.model_loader import load_model
from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.messages import StreamSubmit, FirstToken, PrefillSubmit, Ready

from pdserve.engine.structured_output import StructuredOutput

from tests.integration.reference import assert_matches, constrained_references, greedy_references
from tests.unit.node_pair import BLOCK_SIZE, Pair

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=MAX_TOKENS, min_tokens=4, seed=1234,
                        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
PROMPTS = [[(11 * i + 5 + salt) % 900 + 3 for i in range(n)] for n, salt in ((9, 0), (23, 1), (4, 2))]


@pytest.fixture(scope="module")
def model(model_dirs):
    model_dir = model_dirs["llama"]
    return str(model_dir), load_model(model_dir, torch.float32)


def run_resumed(model, req_id: str, prompt: list[int], params: SamplingParams, resumed: list[int],
                sample_index: int = 0) -> list[int]:
    """Every token after `resumed` that a fresh prefill + decode pair produces."""
    pair = Pair(*model)
    pair.decode.handle(StreamSubmit(req_id, prompt, params, sample_index, resumed, imports_kv=True))
    ready = pair.d_out.pop()
    assert isinstance(ready, Ready), ready
    assert len(ready.block_ids) == -(-(len(prompt) + len(resumed)) // BLOCK_SIZE)
    pair.prefill.handle(PrefillSubmit(req_id, prompt, params, sample_index, ready.kv_layout_id, ready.block_ids,
                                      resumed, pair.d_layout))
    pair.run()
    assert not pair.failures("p") and not pair.failures("d")
    first = pair.first_tokens()[req_id]
    assert isinstance(first, FirstToken)
    decoded = pair.decoded(req_id)
    tokens = [first.token_id] + [t for event in decoded for t in event.token_ids]
    assert decoded[-1].finish_reason is not None
    assert pair.used_blocks() == (0, 0)
    return tokens


def test_greedy_resume_continues_with_the_reference(model):
    refs = greedy_references(model[0], PROMPTS, [MAX_TOKENS] * len(PROMPTS))
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        for k in (0, 1, 5, MAX_TOKENS - 2):
            resumed = ref.token_ids[:k]
            rest = run_resumed(model, f"g{i}-{k}", prompt, GREEDY, resumed)
            assert_matches([resumed + rest], [ref])


def test_resume_one_token_before_max_tokens_ends_at_the_prefill_token(model):
    """The prefill node's token is the last one: the decode node ends it at once, frees everything."""
    ref = greedy_references(model[0], PROMPTS[:1], [MAX_TOKENS])[0]
    rest = run_resumed(model, "last", PROMPTS[0], GREEDY, ref.token_ids[: MAX_TOKENS - 1])
    assert rest == ref.token_ids[MAX_TOKENS - 1 :]


@pytest.mark.parametrize("sample_index", [0, 3])
def test_seeded_resume_draws_the_uninterrupted_stream(model, sample_index):
    for i, prompt in enumerate(PROMPTS):
        whole = run_resumed(model, f"s{i}", prompt, SEEDED, [], sample_index)
        assert len(whole) == MAX_TOKENS
        for k in (1, 3, 7):  # before, at and after min_tokens
            rest = run_resumed(model, f"s{i}-{k}", prompt, SEEDED, whole[:k], sample_index)
            assert whole[:k] + rest == whole, f"prompt {i}, resumed after {k}"


def test_colocated_engine_resumes_like_the_pair(model):
    """The offline engine (one policy for both phases) takes resumed tokens the same way."""
    model_dir, loaded = model
    config = EngineConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64,
                          max_num_batched_tokens=8, max_num_seqs=8)
    whole = run_resumed(model, "c", PROMPTS[1], SEEDED, [])
    engine = EngineCore(config, loaded=loaded)
    engine.add_request("c", PROMPTS[1], SEEDED, 0, whole[:5])
    rest: list[int] = []
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            rest.append(out.new_token_id)
            finish = out.finish_reason
    assert whole[:5] + rest == whole
    assert finish is FinishReason.LENGTH
    assert engine.kv.num_used_blocks == 0


def test_resumed_tokens_are_checked(model):
    model_dir, loaded = model
    config = EngineConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=64)
    engine = EngineCore(config, loaded=loaded)
    with pytest.raises(RequestRejected, match="resumed_token_ids contains"):
        engine.add_request("a", [1, 2], GREEDY, 0, [loaded.vocab_size])
    with pytest.raises(RequestRejected, match="already ended"):
        engine.add_request("b", [1, 2], GREEDY, 0, [5] * MAX_TOKENS)


CONSTRAINED_MAX = 24
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["word", "n"]}


def test_constrained_resume_replays_the_grammar_and_continues_exactly(model):
    """Token 1 on the prefill node under the grammar, the rest on the decode node from a matcher
    replayed over the tokens it was given: greedy equals transformers under xgrammar's processor,
    seeded equals the uninterrupted stream, resumed anywhere."""
    structured = StructuredOutput.json_schema(SCHEMA)
    greedy = SamplingParams(temperature=0.0, max_tokens=CONSTRAINED_MAX, structured_output=structured)
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=CONSTRAINED_MAX, structured_output=structured)
    for i, prompt in enumerate(PROMPTS[:2]):
        (ref,) = constrained_references(model[0], [prompt], structured, CONSTRAINED_MAX)
        for params, kind in ((greedy, "g"), (seeded, "s")):
            whole = run_resumed(model, f"j{kind}{i}", prompt, params, [])
            if kind == "g":
                assert whole == ref
            for k in (1, 4, len(whole) - 1):
                rest = run_resumed(model, f"j{kind}{i}-{k}", prompt, params, whole[:k])
                assert whole[:k] + rest == whole, f"prompt {i}, {kind}, resumed after {k}"
