"""The internal messages' one codec: tagged JSON, nested dataclasses and enums rebuilt from type
hints, and a clear error for anything that is not one of its messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import pytest

from pdserve.common.codec import Codec, CodecError


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, slots=True)
class Point:
    x: int
    y: float


@dataclass(slots=True)
class Shape:
    name: str
    points: list[Point]
    colour: Colour
    centre: Point | None = None
    tags: tuple[str, ...] = ()
    by_name: dict[str, Point] = field(default_factory=dict)
    sparse: list[Point | None] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Empty:
    pass


CODEC = Codec((Shape, Empty))


@pytest.mark.parametrize("msg", [
    Shape("a", [Point(1, 2.5), Point(-3, 0.0)], Colour.BLUE, Point(0, 1.0), ("x", "y"), {"p": Point(4, 4.5)},
          [None, Point(7, 7.0)], {"k": 3}),
    Shape("b", [], Colour.RED),
    Empty(),
])
def test_a_message_round_trips_with_its_nested_values_rebuilt(msg):
    raw = CODEC.encode(msg)
    assert isinstance(raw, bytes) and raw.startswith(b'{"type":')  # JSON, never pickle
    assert CODEC.decode(raw) == msg


def test_the_wire_form_is_tagged_json_with_enum_values():
    assert CODEC.encode(Shape("s", [Point(1, 2.0)], Colour.RED)) == (
        b'{"type":"Shape","body":{"name":"s","points":[{"x":1,"y":2.0}],"colour":"red","centre":null,'
        b'"tags":[],"by_name":{},"sparse":[],"extra":{}}}')


@pytest.mark.parametrize("raw", [
    b"", b"[]", b"{}", b'{"type": "Nope", "body": {}}', b'{"type": "Point", "body": {"x": 1, "y": 2}}',
    b'{"type": "Empty", "body": {"x": 1}}', b'{"type": "Shape", "body": {"name": "s", "points": []}}',
    b'{"type": "Shape", "body": {"name": "s", "points": [], "colour": "green"}}',
    b'{"type": "Shape", "body": {"name": "s", "points": [{"x": 1}], "colour": "red"}}',
    b'{"type": "Shape", "body": {"name": "s", "points": [3], "colour": "red"}}',
    b'{"type": "Shape", "body": []}',
])
def test_anything_else_is_the_codecs_error(raw):
    with pytest.raises(CodecError, match="not a message"):
        CODEC.decode(raw)


def test_a_user_names_its_own_error():
    class NotMine(ValueError):
        pass

    codec = Codec((Empty,), NotMine, "test message")
    with pytest.raises(NotMine, match="not a test message"):
        codec.decode(b'{"type": "Shape", "body": {}}')
    with pytest.raises(NotMine, match="Point is not a test message"):
        codec.encode(Point(1, 2.0))
