"""The decode nodes' KV layouts a prefill node's core knows, each parsed and checked once.

A request names its decode node's layout by id (`PrefillSubmit.kv_layout_id`); the front
attaches the layout itself (JSON: every rank's address, block count and cache shape, as the
decode node's `GetKVLayout` answers it) to the first request naming an id it has not given the
core yet. `resolve` parses it then, checks it is the layout the id names, and keeps the result
under the id — the layout, or the error every later request naming it gets. A layout of a decode
node this core already knows under another id (the node started again on its addresses) replaces
the old one, whose connection is then forgotten: nothing more is pushed to the caches it named, and
a request still naming the old id is UNAVAILABLE (READY'd before the restart: the router resumes it).

Must never: parse a layout twice, or answer a request with a layout other than the one its id names.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.node.errors import ErrorCode, NodeError
from pdserve.ranks.kv_ranks import NodeKVDescriptor


class DecodeLayouts:
    def __init__(self, forget_peer: Callable[[str], None] = lambda layout_id: None) -> None:
        self._forget_peer = forget_peer  # a replaced layout's connection (PeerConnections.forget)
        self._known: dict[str, NodeKVDescriptor | NodeError] = {}

    def resolve(self, layout_id: str, layout: str | None) -> NodeKVDescriptor:
        """The layout `layout_id` names; `layout` is its JSON the first time. Raises NodeError."""
        known = self._known.get(layout_id)
        if known is None:
            known = self._learn(layout_id, layout)
        if isinstance(known, NodeError):
            raise known
        return known

    def _learn(self, layout_id: str, layout: str | None) -> NodeKVDescriptor | NodeError:
        if not layout_id:
            raise NodeError(ErrorCode.INVALID_ARGUMENT, "decode_kv_layout_id must not be empty")
        if layout is None:  # not remembered: the id may name a layout this node gets later
            raise NodeError(ErrorCode.INVALID_ARGUMENT,
                            f"decode_kv_layout_id {layout_id!r} names no decode node layout this node has")
        known = _parse(layout_id, layout)
        if isinstance(known, NodeKVDescriptor):
            self._replace_older(known)
        self._known[layout_id] = known
        return known

    def _replace_older(self, layout: NodeKVDescriptor) -> None:
        for old_id, old in list(self._known.items()):
            if isinstance(old, NodeKVDescriptor) and old.key == layout.key:
                self._known[old_id] = NodeError(ErrorCode.UNAVAILABLE, f"decode_kv_layout_id {old_id!r} is gone: "
                                                f"its decode node started again with {layout.layout_id!r}")
                self._forget_peer(old_id)


def _parse(layout_id: str, layout: str) -> NodeKVDescriptor | NodeError:
    try:
        descriptor = NodeKVDescriptor.from_bytes(layout.encode())
    except (ValueError, KeyError, TypeError) as exc:
        return NodeError(ErrorCode.INVALID_ARGUMENT, f"kv_layout of {layout_id!r} is not a KV layout: {exc}")
    if descriptor.layout_id != layout_id:
        return NodeError(ErrorCode.INVALID_ARGUMENT,
                         f"kv_layout is the layout {descriptor.layout_id!r}, not decode_kv_layout_id {layout_id!r}")
    return descriptor
