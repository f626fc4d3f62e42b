"""Tagged JSON for dataclass messages: the one encoding of the internal messages (a node's front ↔
its core, pdserve/node/messages.py; rank 0 ↔ its worker ranks, pdserve/ranks/tp_wire.py).

A `Codec` knows a closed set of message classes. `encode` writes `{"type": <class name>, "body":
{<field>: <value>}}`; `decode` reads it back into that class. A message is a dataclass whose
fields are JSON-native (str, int, float, bool, None, lists and str-keyed dicts of those), enums
(their values on the wire) or dataclasses of the same kind, nested as deep as needed. Nested
values are rebuilt from the fields' type hints — `X | None`, `list[X]`, `tuple[X, ...]`,
`dict[str, X]`, an enum, a dataclass — so no message class writes a `from_json` of its own.
Each class's rebuild is worked out once, on its first decode; a field that is JSON-native as it
comes off the wire costs nothing.

Must never: pickle, import another part or a third-party module, or hand back a message of a
class it was not given (an unknown tag is an error, as are missing or unexpected fields).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

Rebuild = Callable[[Any], Any]  # a wire value -> the field's value


class CodecError(ValueError):
    """Bytes that are not a message of this codec."""


class Codec:
    def __init__(self, classes: Iterable[type], error: type[ValueError] = CodecError, what: str = "message") -> None:
        """`error`: what decode raises (a subclass of ValueError; its user's own name for it);
        `what`: how its messages are named in errors ("node message")."""
        self._classes = {cls.__name__: cls for cls in classes}
        self._error = error
        self._what = what
        self._rebuilds: dict[type, list[tuple[str, Rebuild]]] = {}
        self._names: dict[type, tuple[str, ...]] = {}
        # One encoder, made once: the C encoder calls back only for dataclasses and plain enums.
        self._encoder = json.JSONEncoder(separators=(",", ":"), default=self._plain, check_circular=False)

    def encode(self, msg: Any) -> bytes:
        name = type(msg).__name__
        if self._classes.get(name) is not type(msg):
            raise self._error(f"{name} is not a {self._what}")
        return self._encoder.encode({"type": name, "body": msg}).encode()

    def decode(self, raw: bytes | str) -> Any:
        try:
            data = json.loads(raw)
            cls = self._classes[data["type"]]
            return self._build(cls, data["body"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._error(f"not a {self._what}: {exc!r}") from exc

    def _build(self, cls: type, body: dict[str, Any]) -> Any:
        if not isinstance(body, dict):
            raise TypeError(f"{cls.__name__} needs an object, got {type(body).__name__}")
        rebuilds = self._rebuilds.get(cls)
        if rebuilds is None:
            rebuilds = self._rebuilds[cls] = self._field_rebuilds(cls)
        for name, rebuild in rebuilds:
            value = body.get(name)
            if value is not None:  # absent: the field's default; None: None
                body[name] = rebuild(value)
        return cls(**body)  # a missing or unexpected field raises TypeError here

    def _field_rebuilds(self, cls: type) -> list[tuple[str, Rebuild]]:
        hints = typing.get_type_hints(cls)
        rebuilds = []
        for f in dataclasses.fields(cls):
            rebuild = self._rebuild_for(hints[f.name])
            if rebuild is not None:
                rebuilds.append((f.name, rebuild))
        return rebuilds

    def _rebuild_for(self, hint: Any) -> Rebuild | None:
        """How a wire value becomes a value of `hint`; None when the wire value already is one."""
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            return self._rebuild_for(inner[0]) if len(inner) == 1 else None  # `X | None`: None is kept as is
        if origin is list:
            item = self._rebuild_for(args[0]) if args else None
            return None if item is None else (lambda v: [None if x is None else item(x) for x in v])
        if origin is tuple:
            item = self._rebuild_for(args[0]) if args else None
            return tuple if item is None else (lambda v: tuple(None if x is None else item(x) for x in v))
        if origin is dict:
            item = self._rebuild_for(args[1]) if len(args) == 2 else None
            return None if item is None else (lambda v: {k: None if x is None else item(x) for k, x in v.items()})
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return hint
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            # A class that rebuilds itself from its plain fields (`rebuilt`: values checked once,
            # where they were made, e.g. SamplingParams) is not built, and checked, again.
            own = getattr(hint, "rebuilt", None)
            return own if own is not None else (lambda v: self._build(hint, v))
        return None

    def _plain(self, value: Any) -> Any:
        """What the JSON encoder cannot write itself: a dataclass as its fields, an enum as its value."""
        names = self._names.get(type(value))
        if names is None:
            if not dataclasses.is_dataclass(value) or isinstance(value, type):
                if isinstance(value, enum.Enum):
                    return value.value
                raise TypeError(f"{type(value).__name__} is not JSON-native, an enum or a dataclass")
            names = self._names[type(value)] = tuple(f.name for f in dataclasses.fields(value))
        return {name: getattr(value, name) for name in names}
