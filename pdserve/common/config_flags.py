"""Command-line flags derived from a config dataclass: one home for each knob and its default.

A frozen config dataclass is the contract; its fields become flags (`max_num_seqs` ->
`--max-num-seqs`, under an optional prefix: `kv_` + `port` -> `--kv-port`), with the
field's default, its type (`int | None` -> int, default None), and what its metadata adds:

    help     the flag's help text
    choices  the values argparse accepts
    parse    a callable turning the flag's text into the value (e.g. a core list)
    aliases  further flag names (an older spelling kept working)
    flag     False: the field is not a flag (set by the program, not the user)

A bool field becomes `--name` / `--no-name`. `values_from_args` reads the parsed values
back by the same names, so parser and config never disagree about a flag.

Must never: validate values (the config's own __post_init__ does, naming the field) or
import anything above pdserve/common/.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any


def config_fields(cls: type, skip: Iterable[str] = (), only: Iterable[str] | None = None) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags: not nested configs, not flag=False, not skipped, and
    among `only` when it is given."""
    hints = typing.get_type_hints(cls)
    skipped, wanted = set(skip), None if only is None else set(only)
    return [f for f in dataclasses.fields(cls)
            if f.name not in skipped and (wanted is None or f.name in wanted)
            and f.metadata.get("flag", True) and not _is_config(hints[f.name])]


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, prefix: str = "",
                    skip: Iterable[str] = (), defaults: dict[str, Any] | None = None,
                    only: Iterable[str] | None = None) -> None:
    """One flag per field of `cls` (see the module docstring); `defaults` overrides a field's
    default for this parser only (a node that pins cores, say)."""
    hints = typing.get_type_hints(cls)
    for f in config_fields(cls, skip, only):
        default = (defaults or {}).get(f.name, _default_of(f))
        names = [flag_name(prefix + f.name), *f.metadata.get("aliases", ())]
        dest = prefix + f.name
        base = _base_type(hints[f.name])
        help_text = f.metadata.get("help")
        if base is bool:  # (a bool field always has a default)
            parser.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
            continue
        parse = f.metadata.get("parse", base)
        required = _default_of(f) is dataclasses.MISSING and f.name not in (defaults or {})
        parser.add_argument(*names, dest=dest, type=parse, default=None if required else default,
                            required=required, choices=f.metadata.get("choices"), help=help_text,
                            metavar=f.metadata.get("metavar"))


def values_from_args(args: argparse.Namespace, cls: type, prefix: str = "", skip: Iterable[str] = ()) -> dict:
    """The keyword arguments of `cls` that `add_config_args` made flags for."""
    return {f.name: getattr(args, prefix + f.name) for f in config_fields(cls, skip) if hasattr(args, prefix + f.name)}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING  # a required field: a required flag


def _base_type(hint: Any) -> type:
    """`int | None` -> int; `tuple[int, ...] | None` -> tuple (a field like that needs `parse`)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


def _is_config(hint: Any) -> bool:
    return dataclasses.is_dataclass(_base_type(hint))
