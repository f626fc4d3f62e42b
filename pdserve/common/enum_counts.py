"""A count per member of an enum, read whole by a metrics collector at scrape time."""

from __future__ import annotations

import collections
from enum import Enum
from typing import Generic, TypeVar

E = TypeVar("E", bound=Enum)


class EnumCounts(Generic[E]):
    """How often each member of `members` was counted. `snapshot` has every member, zeros
    included, so each labelled series exists before its first count."""

    def __init__(self, members: type[E]) -> None:
        self._members = members
        self.counts: collections.Counter[E] = collections.Counter()

    def count(self, member: E) -> None:
        self.counts[member] += 1

    def snapshot(self) -> dict[E, int]:
        return {member: self.counts[member] for member in self._members}
