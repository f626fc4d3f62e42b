"""The prefill node's front: decode nodes' KV layouts, fetched once per decode node run.

A `Prefill` request names its decode node (`decode_address`, the gRPC host:port the router
reached it at) and the layout its READY named (`decode_kv_layout_id`). The first request naming a
decode node, or an id other than the one known for it (the node started again), fetches the layout
with `DecodeNode.GetKVLayout`: one fetch at a time per decode node, the requests that arrive
meanwhile waiting on it. The core gets the layout once: `take_unsent` hands it to the first request
sent to the core after the fetch, in the same synchronous step that sends it (front → core
messages keep their order), so the core (pdserve/prefill_node/decode_layouts.py) has it before any request
that comes without it.

Must never: fetch per request, parse a layout (the core does, once), or let a request through that
names a layout its decode node no longer serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from pdserve.common.auth import open_channel
from pdserve.common.tls import TlsConfig
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.proto import node_pb2, node_pb2_grpc

Fetch = Callable[[str], Awaitable[tuple[str, str]]]  # decode address -> (layout id, layout JSON)


@dataclass(slots=True)
class _Known:
    layout_id: str
    layout: str
    sent: bool = False  # given to the core already


class LayoutCache:
    """The latest layout of every decode node this prefill node has pushed to, by address."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._known: dict[str, _Known] = {}
        self._fetching: dict[str, asyncio.Future[None]] = {}

    async def ensure(self, address: str, layout_id: str) -> None:
        """Know the layout `layout_id` of the decode node at `address`, fetching it unless known.
        Raises NodeError: UNAVAILABLE when it cannot be fetched or the node serves another now."""
        known = self._known.get(address)
        if known is not None and known.layout_id == layout_id:
            return
        pending = self._fetching.get(address)
        if pending is None:
            pending = asyncio.ensure_future(self._learn(address))
            self._fetching[address] = pending
            pending.add_done_callback(lambda _: self._fetching.pop(address, None))
        await asyncio.shield(pending)  # a caller that goes away does not cancel the others' fetch
        self._current(address, layout_id)

    def take_unsent(self, address: str, layout_id: str) -> str | None:
        """The layout's JSON if the core has not had it yet (had from now on); None if it has."""
        known = self._current(address, layout_id)
        if known.sent:
            return None
        known.sent = True
        return known.layout

    async def _learn(self, address: str) -> None:
        layout_id, layout = await self._fetch(address)
        known = self._known.get(address)
        if known is None or known.layout_id != layout_id:
            self._known[address] = _Known(layout_id, layout)

    def _current(self, address: str, layout_id: str) -> _Known:
        known = self._known.get(address)
        if known is None or known.layout_id != layout_id:
            serves = "no layout" if known is None else f"{known.layout_id!r}"
            raise NodeError(ErrorCode.UNAVAILABLE, f"decode_kv_layout_id {layout_id!r} is not the layout of the "
                                                   f"decode node at {address}, which serves {serves}: it started "
                                                   "again since its READY")
        return known


def grpc_fetch(token: str | None, timeout_s: float, tls: TlsConfig | None = None) -> Fetch:
    """`DecodeNode.GetKVLayout` over a channel of its own (mutual TLS when the node has it): a
    fetch happens once per decode node run."""
    async def fetch(address: str) -> tuple[str, str]:
        channel = open_channel(address, token, tls=tls)
        try:
            reply = await node_pb2_grpc.DecodeNodeStub(channel).GetKVLayout(node_pb2.KVLayoutRequest(),
                                                                            timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise NodeError(ErrorCode.UNAVAILABLE, f"cannot fetch the KV layout of the decode node at {address}: "
                                                   f"{exc.code().name} {exc.details()}") from exc
        finally:
            await channel.close()
        try:
            return reply.layout_id, reply.layout.decode()
        except UnicodeDecodeError as exc:
            raise NodeError(ErrorCode.INVALID_ARGUMENT,
                            f"kv_layout of the decode node at {address} is not UTF-8 JSON") from exc

    return fetch
