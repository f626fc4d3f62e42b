"""Benchmark: per-token mask cost of the grammar libraries on CPU, the demo tokenizer's vocabulary.

Run `python -m pdserve.bench.grammar_libs [--model DIR]`. For each library that imports
(xgrammar, llguidance, outlines-core) and each case (a JSON schema, a regex), it compiles the
grammar once for the tokenizer (timed), then walks the tokens of one valid output: before each
token it fills the next-token bitmask, then advances the matcher with the token. It prints the
compile time and the median and p99 microseconds per token of fill + advance. What the engine pays
per constrained row per step is that figure; the choice of library is written in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from pdserve.model_factory import ensure_demo_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
INSTANCE = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
                       "address": {"city": "London", "zip": "W1"}})
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
REGEX_TEXT = "555-867-5309 ext. 42"


@dataclass
class Walk:
    compile_s: float
    per_token_us: list[float]


Matcher = tuple[Callable[[], None], Callable[[int], None]]  # fill the mask, advance by a token


def _walk(build: Callable[[], Matcher], token_ids: list[int]) -> Walk:
    start = time.perf_counter()
    fill, advance = build()
    compile_s = time.perf_counter() - start
    costs = []
    for t in token_ids:
        start = time.perf_counter()
        fill()
        advance(t)
        costs.append((time.perf_counter() - start) * 1e6)
    return Walk(compile_s, costs)


def xgrammar_builder(tokenizer, vocab: int, eos: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])

    def build(kind: str, spec: str) -> Matcher:
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_json_schema(spec) if kind == "json" else compiler.compile_regex(spec)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        return (lambda: matcher.fill_next_token_bitmask(bitmask)), (lambda t: _check(matcher.accept_token(t)))
    return build


def llguidance_builder(tokenizer, vocab: int, eos: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def build(kind: str, spec: str) -> Matcher:
        grammar = (llguidance.LLMatcher.grammar_from_json_schema(spec) if kind == "json"
                   else llguidance.LLMatcher.grammar_from_regex(spec))
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        return (lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0),
                lambda t: _check(matcher.consume_token(t)))
    return build


def outlines_builder(tokenizer, vocab: int, eos: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    tokens: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id == eos:
            continue
        tokens.setdefault(bytes(byte_decoder[c] for c in token), []).append(token_id)
    vocabulary = Vocabulary(eos, tokens)

    def build(kind: str, spec: str) -> Matcher:
        regex = build_regex_from_schema(spec) if kind == "json" else spec
        guide = Guide(Index(regex, vocabulary))
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        return (lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size()),
                lambda t: guide.advance(t))
    return build


def _check(ok: bool) -> None:
    if not ok:
        raise RuntimeError("the matcher refused a token of the valid output")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: what byte each character of a byte-level BPE token stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


LIBRARIES = {"xgrammar": xgrammar_builder, "llguidance": llguidance_builder, "outlines-core": outlines_builder}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder whose tokenizer to use (default: the demo model)")
    args = parser.parse_args()
    model = args.model or str(ensure_demo_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    cases = [("json", json.dumps(SCHEMA), INSTANCE), ("regex", REGEX, REGEX_TEXT)]
    print(f"tokenizer of {model}: {len(tokenizer)} tokens, model vocab {vocab}")
    print(f"{'library':<14} {'case':<6} {'tokens':>6} {'compile ms':>10} {'median us/tok':>13} {'p99 us/tok':>10}")
    for name, make in LIBRARIES.items():
        try:
            builder = make(tokenizer, vocab, eos)
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc})")
            continue
        for kind, spec, text in cases:
            token_ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
            try:
                walks = [_walk(lambda: builder(kind, spec), token_ids) for _ in range(5)]
            except Exception as exc:  # a library that cannot run a case says so, the others go on
                print(f"{name:<14} {kind:<6} failed: {type(exc).__name__}: {exc}")
                continue
            costs = sorted(c for w in walks[1:] for c in w.per_token_us)
            compile_ms = statistics.median(w.compile_s for w in walks) * 1e3
            print(f"{name:<14} {kind:<6} {len(token_ids):>6} {compile_ms:>10.1f} {statistics.median(costs):>13.1f} "
                  f"{costs[int(0.99 * (len(costs) - 1))]:>10.1f}")


if __name__ == "__main__":
    main()
