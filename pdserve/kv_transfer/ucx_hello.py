"""The UCX transport's handshake messages (pdserve/kv_transfer/ucx.py): HELLO and HELLO_REPLY bodies,
JSON in a control message's `extra`, and the random tags that name transports and connections.

Must never: pickle, or trust a field it has not checked the type of.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .base import KVDescriptor
from .wire import ControlMsg, MsgKind, WireError


def random_tag() -> int:
    return int.from_bytes(os.urandom(8), "little")


def hello_msg(kind: MsgKind, desc: KVDescriptor, worker_address: str, fast_data_path: bool,
              auth_token: str | None = None, tags: tuple[int, int] | None = None,
              checksums: bool = False) -> ControlMsg:
    """HELLO: the connector's worker address and (its sends' tag, its receives' tag);
    HELLO_REPLY: the receiver's worker address when the fast data path is on, else empty,
    and whether it wants every push sealed with checksums (pdserve/kv_transfer/integrity.py)."""
    body = {"descriptor": json.loads(desc.to_bytes()), "worker_address": worker_address,
            "fast_data_path": fast_data_path, "checksums": checksums}
    if tags is not None:
        body["tags"] = list(tags)
    if auth_token is not None:
        body["auth_token"] = auth_token
    return ControlMsg(kind, extra=json.dumps(body).encode())


def hello_body(msg: ControlMsg) -> dict[str, Any]:
    try:
        body = json.loads(msg.extra)
    except ValueError as exc:
        raise WireError(f"malformed {msg.kind.name}: {exc}") from exc
    if not isinstance(body, dict):
        raise WireError(f"malformed {msg.kind.name}: not a JSON object")
    return body


def parse_hello(msg: ControlMsg) -> tuple[KVDescriptor, str, bool]:
    """(descriptor, worker address or "", wants the fast data path)."""
    try:
        body = json.loads(msg.extra)
        desc = KVDescriptor.from_bytes(json.dumps(body["descriptor"]).encode())
        return desc, str(body["worker_address"]), bool(body["fast_data_path"])
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed {msg.kind.name}: {exc}") from exc


def way_back(msg: ControlMsg) -> tuple[str, tuple[int, int]]:
    """A HELLO's worker address and tags (the connector's sends, its receives): how to answer."""
    if msg.kind is not MsgKind.HELLO:
        raise WireError(f"expected HELLO, got {msg.kind.name}")
    body = hello_body(msg)
    try:
        theirs_to_us, ours_to_them = body["tags"]
        return str(body["worker_address"]), (int(theirs_to_us), int(ours_to_them))
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed HELLO: {exc!r}") from exc
