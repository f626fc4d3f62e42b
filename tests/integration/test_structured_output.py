"""Structured output offline, on a random-weight model: the grammar alone makes the output valid.

Greedy float32 tokens equal transformers `generate` with xgrammar's own logits processor on the
same compiled grammar; every output parses and validates; n > 1 and seeds draw what separate
seeded requests draw; a grammar that cannot finish ends with "length". Every test ends with zero
blocks in use.
"""

from __future__ import annotations

import json
from concurrent.futures import Future

import jsonschema
import pytest

from pdserve import LLM, SamplingParams, StructuredOutput
from pdserve.engine.grammar import GrammarCompiler, GrammarGate
from pdserve.engine.request import FinishReason, Request

from .reference import constrained_references

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "count", "color", "tags"],
}
GRAMMAR = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [0-9] | "x"'
CASES = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput.regex(r"(cat|dog)s? [0-9]{1,3}"),
    "choice": StructuredOutput.choice(["yes", "no", "it depends"]),
    "grammar": StructuredOutput.grammar(GRAMMAR),
}
PROMPTS = ["Hello there, general", "def add(a, b):\n    return", "x" * 30]


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(model_dirs["llama"], dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=16)


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert engine.kv.num_used_blocks == 0
        assert not engine.has_unfinished()


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_tokens_equal_transformers_with_the_libraries_logits_processor(llm, model_dirs, kind):
    structured = CASES[kind]
    params = SamplingParams(temperature=0, max_tokens=48, structured_output=structured)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        (expected,) = constrained_references(model_dirs["llama"], [out.prompt_token_ids], structured, 48)
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason is FinishReason.STOP


def test_json_outputs_parse_and_validate_against_the_schema(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=17, max_tokens=64, structured_output=CASES["json_schema"])
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        for sample in out.outputs:
            assert sample.finish_reason is FinishReason.STOP
            jsonschema.validate(json.loads(sample.text), SCHEMA)


def test_n_samples_under_a_grammar_draw_what_separate_seeded_requests_draw(llm):
    structured = CASES["grammar"]
    (together,) = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=24,
                                                            structured_output=structured), use_tqdm=False)
    alone = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=5, max_tokens=24,
                                                      structured_output=structured), use_tqdm=False)[0]
    assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in together.outputs}) > 1


def test_constrained_and_unconstrained_rows_share_a_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=48, structured_output=CASES["regex"])
    alone_free = llm.generate(PROMPTS, free, use_tqdm=False)
    alone_constrained = llm.generate(PROMPTS, constrained, use_tqdm=False)
    mixed = llm.generate(PROMPTS * 2, [free] * 3 + [constrained] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone_free + alone_constrained]


def test_json_object_always_opens_an_object_or_array(llm):
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=StructuredOutput.json_object())
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        assert out.outputs[0].text[:1] in ("{", "[")


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    params = SamplingParams(temperature=0, max_tokens=5, structured_output=StructuredOutput.regex("a{20}"))
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert out.outputs[0].text == "a" * len(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason is FinishReason.LENGTH


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(llm):
    structured = StructuredOutput.regex("never-compiled-before [0-9]+")
    llm.engine.add_request("held", [1, 2, 3], SamplingParams(max_tokens=4, structured_output=structured))
    assert llm.engine.abort("held")
    assert not llm.engine.has_unfinished()


class HeldCompiler:
    """A compiler whose compiles end when the test says."""

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def compile(self, structured: StructuredOutput) -> Future:
        self.futures.append(Future())
        return self.futures[-1]


def test_the_gate_holds_a_request_until_its_grammar_is_compiled_and_fails_a_failed_compile(llm):
    loaded = llm.engine.loaded
    compiled = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids).compile(
        CASES["choice"]).result()
    compiler = HeldCompiler()
    gate = GrammarGate(lambda: compiler)
    params = SamplingParams(structured_output=CASES["choice"])
    ok, bad = Request("ok", [1, 2], params, 0, seed=0), Request("bad", [1, 2], params, 1, seed=0)
    for request in (ok, bad):
        gate.start(request)
        assert not gate.attach_if_ready(request)
        gate.hold(request)
    assert gate.ready() == ([], []) and len(gate) == 2
    compiler.futures[0].set_result(compiled)
    error = RuntimeError("no")
    compiler.futures[1].set_exception(error)
    assert gate.ready() == ([ok], [(bad, error)])
    assert ok.grammar is not None and bad.grammar is None and len(gate) == 0


def test_min_tokens_with_a_constraint_is_refused_by_name():
    with pytest.raises(ValueError, match="^min_tokens must be 0 with structured_output: the grammar decides where "
                                         "the output ends, got 2$"):
        SamplingParams(min_tokens=2, max_tokens=4, structured_output=CASES["choice"])


@pytest.mark.parametrize("structured, message", [
    (StructuredOutput("json_schema", '{"type": "objectx"}'), 'structured_output.json_schema: Unsupported type "objectx"'),
    (StructuredOutput("regex", "[a-"), "structured_output.regex: Regex parsing error at position 4: Unclosed '['"),
    (StructuredOutput("grammar", "root ::= foo"), 'structured_output.grammar: EBNF parser error at line 1, column 10: '
                                                  'Rule "foo" is not defined'),
    (StructuredOutput("choice", "[]"), "structured_output.choice: the list of choices is empty"),
])
def test_a_bad_constraint_is_refused_with_the_libraries_message(structured, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_output=structured)
    assert str(info.value) == message
