"""What a request constrains its output to: a JSON schema, any JSON object, a regex, a choice or a grammar.

`StructuredOutput` is the one description every API builds (HTTP `response_format` and vLLM's
`guided_*` / `structured_outputs` fields, gRPC's `GenerateRequest.structured_output`, the offline
`SamplingParams`) and every node receives. It is plain data (two strings), so it crosses process
boundaries and hashes as the key of a compiled grammar. `grammar_of` turns it into the grammar
library's (xgrammar's) `Grammar`, which checks it: a bad schema, regex or grammar raises
`ValueError` naming the field and the library's message, wherever the params are built — so a
router refuses it before any node sees it. Compiling for a tokenizer is pdserve/engine/grammar.py's.

xgrammar is imported on first use: a process that never sees a constraint never loads it.
"""

from __future__ import annotations

import enum
import json
import re
import sys
from dataclasses import dataclass
from typing import Any


class StructuredKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # spec: "" (any JSON object or array)
    REGEX = "regex"  # spec: the regular expression
    CHOICE = "choice"  # spec: a JSON array of the strings to choose from
    GRAMMAR = "grammar"  # spec: an EBNF grammar (GBNF-style, rule `root`)


# The library prefixes its messages with a timestamp and its C++ source position: not the caller's business.
_LIBRARY_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    kind: str  # a StructuredKind value; a str so the codec and protos carry it as plain data
    spec: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in _KINDS:
            raise ValueError(f"structured_output.kind must be one of {sorted(_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_output.{self.kind} must be a str, got {type(self.spec).__name__}")
        object.__setattr__(self, "kind", str(StructuredKind(self.kind).value))

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> StructuredOutput:
        return cls(StructuredKind.JSON_SCHEMA.value, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls(StructuredKind.JSON_OBJECT.value, "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls(StructuredKind.REGEX.value, pattern)

    @classmethod
    def choice(cls, options: list[str] | tuple[str, ...]) -> StructuredOutput:
        if not isinstance(options, (list, tuple)) or not all(isinstance(o, str) for o in options):
            raise ValueError("structured_output.choice must be a list of str")
        return cls(StructuredKind.CHOICE.value, json.dumps(list(options)))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutput:
        return cls(StructuredKind.GRAMMAR.value, ebnf)

    @property
    def field_name(self) -> str:
        """The name a caller's message gives this constraint."""
        return f"structured_output.{self.kind}"


_KINDS = frozenset(k.value for k in StructuredKind)


def library_loaded() -> bool:
    return "xgrammar" in sys.modules


def load_library() -> None:
    """Import the grammar library: seconds the first time (it loads its compiled core and its kernels'
    dependencies), so a caller on an event loop runs it in a thread before its first `grammar_of`."""
    import xgrammar  # noqa: F401


def grammar_of(structured: StructuredOutput):
    """The library's `Grammar` for `structured`; ValueError naming the field and the library's message."""
    import xgrammar as xgr

    kind, spec = StructuredKind(structured.kind), structured.spec
    try:
        if kind is StructuredKind.JSON_SCHEMA:
            # Compact JSON: free whitespace lets a model wander in blanks until max_tokens.
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind is StructuredKind.JSON_OBJECT:
            return xgr.Grammar.builtin_json_grammar()
        if kind is StructuredKind.REGEX:
            return xgr.Grammar.from_regex(spec)
        if kind is StructuredKind.CHOICE:
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _LIBRARY_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
        raise ValueError(f"{structured.field_name}: {message}") from None


def _choice_ebnf(spec: str) -> str:
    options = json.loads(spec)
    if not options:
        raise ValueError("the list of choices is empty")
    # A JSON string literal is also an EBNF one (same escapes).
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
