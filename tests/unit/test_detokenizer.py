"""Incremental detokenization: the streamed deltas add up to the full decode.

Uses the factory's byte-level BPE, whose rare characters (emoji, most CJK) are split
into several byte tokens, so a delta boundary can fall inside a UTF-8 character.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.model_factory import build_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "emoji 😀🚀✨ family 👨‍👩‍👧‍👦 flag 🇯🇵 thumbs 👍🏽 done ✅",
    "我们在服务器上运行大型语言模型，東京の天気は晴れです。안녕하세요 𠀋𪚥",
    "def f(x):\n    return x  # naïve café → ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "مرحبا بالعالم नमस्ते e\u0301 a\u0308 and a literal \ufffd replacement char",
]
PROMPT = "The answer, in 中文: "


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(960)


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = [detok.push(token_id) for token_id in output_ids]
    assert detok.text == "".join(deltas)
    return deltas


def splits_a_character(tokenizer, ids: list[int]) -> bool:
    """Whether some prefix of ids ends inside a multi-byte UTF-8 character."""
    return any(tokenizer.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))


def test_test_data_splits_characters_across_tokens(tokenizer):
    for text in TEXTS[1:]:
        assert splits_a_character(tokenizer, tokenizer(text)["input_ids"]), text


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text):
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    output_ids = tokenizer(text)["input_ids"]
    deltas = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    # Only the test text's literal U+FFFD may show up, never a partial character.
    assert sum(d.count("\ufffd") for d in deltas) == text.count("\ufffd")
    assert sum(1 for d in deltas if d) > len(output_ids) // 3  # streamed, not held to the end


def test_partial_character_is_held_then_emitted_whole(tokenizer):
    ids = tokenizer("😀")["input_ids"]
    assert len(ids) > 1  # the emoji is rarer than the training corpus' merges
    assert stream(tokenizer, [], ids) == [""] * (len(ids) - 1) + ["😀"]


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer("a 世")["input_ids"] + [0] + tokenizer("界 b")["input_ids"]
    assert "".join(stream(tokenizer, [0], ids)) == tokenizer.decode(ids, skip_special_tokens=True) == "a 世界 b"
    kept = "".join(stream(tokenizer, [0], ids, skip_special_tokens=False))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) == "a 世<|endoftext|>界 b"


def test_ids_beyond_the_tokenizer_vocab_are_dropped_like_decode(tokenizer):
    ids = tokenizer("ok 😀")["input_ids"]
    ids.insert(2, len(tokenizer) + 100)  # models may have more rows than the tokenizer
    assert "".join(stream(tokenizer, [], ids)) == tokenizer.decode(ids) == "ok 😀"


def test_literal_replacement_char_at_the_end_waits_for_flush(tokenizer):
    ids = tokenizer("ok \ufffd")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detok.push(token_id) for token_id in ids) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok \ufffd"


def test_flush_emits_trailing_partial_bytes(tokenizer):
    ids = tokenizer("end 😀")["input_ids"][:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.push(token_id) for token_id in ids)
    assert text == "end "
    assert text + detok.flush() == tokenizer.decode(ids)
    assert detok.flush() == ""


def test_decode_window_stays_short(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer(PROMPT)["input_ids"])
    for token_id in tokenizer(" ".join(TEXTS) * 4)["input_ids"]:
        detok.push(token_id)
        assert len(detok._tokens) <= 8  # only the last emitted token(s) plus pending bytes


@settings(max_examples=150, deadline=None)
@given(prompt=st.text(max_size=16), text=st.text(max_size=48))
def test_any_text_streams_exactly(tokenizer, prompt, text):
    output_ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, tokenizer(prompt)["input_ids"])
    deltas = [detok.push(token_id) for token_id in output_ids]
    tail = detok.flush()
    expected = tokenizer.decode(output_ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == expected == text.replace("<|endoftext|>", "")
    # Only a literal U+FFFD at the very end (indistinguishable from a partial
    # character until the next token) waits for flush().
    assert tail == "" or tail == "\ufffd" * len(tail)
    assert sum(d.count("\ufffd") for d in deltas + [tail]) == text.count("\ufffd")


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=1023), max_size=40))
def test_any_ids_stream_then_flush_to_decode(tokenizer, ids):
    # Arbitrary ids need not be valid UTF-8; flush() gives what decode() shows.
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.push(token_id) for token_id in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
