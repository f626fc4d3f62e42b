"""Incremental detokenization: one token id in, the text it completes out.

Owns the per-sequence decode window. Each step decodes only a few tokens (the
prefix/read-offset technique vLLM uses), never the whole output, and it holds text
back while the newest tokens end in an incomplete UTF-8 character, so a delta never
carries a U+FFFD that a later token would have completed. It must never emit text
it later takes back: deltas + `flush()` are exactly
`tokenizer.decode(output_ids, skip_special_tokens=...)` for any ids. For valid UTF-8
`flush()` returns "" unless the text ends in a literal U+FFFD, which looks like a
partial character until the next token arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend

# Prompt tokens decoded with the output, so a token's text is decoded in context
# (e.g. leading-space rules of SentencePiece tokenizers); vLLM uses the same 5.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._id_to_token, self._decode_tokens = _token_calls(tokenizer)
        self._skip_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        # Added tokens decode to their literal content, not through the decoder.
        self._added_tokens = frozenset(tokenizer.get_added_vocab())
        context = [t for t in prompt_token_ids[-INITIAL_CONTEXT_TOKENS:] if t not in self._skip_ids]
        # Window of token strings: [prefix_offset, read_offset) is text already
        # emitted (kept as decode context), [read_offset, end) is not emitted yet.
        self._tokens: list[str] = [t for t in tokenizer.convert_ids_to_tokens(context) if t is not None]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # all output text emitted so far

    def push(self, token_id: int) -> str:
        """Add one output token; returns the newly completed text (possibly "")."""
        if token_id in self._skip_ids:
            return ""
        token = self._id_to_token(token_id)
        if token is None:  # id beyond the tokenizer's vocab: decode() drops it too
            return ""
        self._tokens.append(token)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing visible) so far
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of a sequence: the held-back text, partial bytes shown as U+FFFD."""
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        """Text of the emitted context, and of the context plus the pending tokens."""
        prefix = self._tokens_to_string(self._tokens[self._prefix_offset : self._read_offset])
        full = self._tokens_to_string(self._tokens[self._prefix_offset :])
        return prefix, full

    def _emit(self, delta: str) -> str:
        # The pending tokens become the next step's context; older ones are dropped so
        # the window (and the work per step) stays a few tokens long.
        del self._tokens[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def _tokens_to_string(self, tokens: list[str]) -> str:
        if not self._added_tokens.intersection(tokens):
            return self._decode_tokens(tokens)
        # Same as tokenizer.decode: runs of ordinary tokens go through the decoder,
        # added tokens are inserted verbatim.
        parts: list[str] = []
        run: list[str] = []
        for token in tokens:
            if token not in self._added_tokens:
                run.append(token)
                continue
            if run:
                parts.append(self._decode_tokens(run))
                run = []
            parts.append(token)
        if run:
            parts.append(self._decode_tokens(run))
        return "".join(parts)


def _token_calls(tokenizer: PreTrainedTokenizerBase) -> tuple[Callable[[int], str | None], Callable[[list[str]], str]]:
    """`convert_ids_to_tokens` for one id and `convert_tokens_to_string`, bound once. A fast
    tokenizer that keeps transformers' own two methods gets the Rust calls they make, without
    their per-call wrapper (looking the decoder up costs more than decoding a few tokens)."""
    cls = type(tokenizer)
    backend = tokenizer.backend_tokenizer if isinstance(tokenizer, TokenizersBackend) else None
    if (backend is None or backend.decoder is None
            or cls.convert_ids_to_tokens is not TokenizersBackend.convert_ids_to_tokens
            or cls.convert_tokens_to_string is not TokenizersBackend.convert_tokens_to_string):
        return tokenizer.convert_ids_to_tokens, tokenizer.convert_tokens_to_string
    return backend.id_to_token, backend.decoder.decode
