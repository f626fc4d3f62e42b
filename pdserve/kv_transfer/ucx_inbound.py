"""Receiver side of one UCX connection: place pushes, deliver dones, ack each in order.

A message's life on the receiving rank (UCX loop thread):

    DATA header ─▶ validate dst blocks / layers / heads against our own cache, and the
                   byte count against the header (a count that does not add up drops the
                   connection: the bytes could not even be drained)
                ─▶ post the receive of every layer chunk into one reusable staging buffer
                ─▶ scatter each chunk into the dst blocks as it lands, each under the
                   request's write permit (`ReceiverSide.place`), digesting it first when
                   this side asked for checksums ─▶ SEAL: compare ─▶ ACK(seq)
    DONE        ─▶ deliver (req_id, payload) ─▶ ACK(seq)

A push whose digests do not match is acknowledged with an error, counted, and its request
refused: its done message is delivered as `INTEGRITY_REFUSAL` (pdserve/kv_transfer/integrity.py),
so the node never admits a request some of whose bytes are not what its sender sealed.

Messages are handled strictly one after another, so a DONE is delivered after the bytes
of every push sent before it. A failed validation still drains the bytes and answers
with an error ACK; a receive that times out retires its staging buffer for good. A push
whose request holds no permit for its blocks (the receiver freed them: cancelled, lease
over, or never granted) is drained and acknowledged OK but placed nowhere: its request
is over here, and an error would make the sender drop a connection others share.

Must never: write a block the header did not name, write outside `place`, reuse a
buffer a receive may still target, or pickle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from .base import KVCacheSpec
from .config import KVTransferConfig
from .integrity import INTEGRITY_REFUSAL, decode_digests, digest
from .layout import (cache_nbytes, check_incoming, incoming_nbytes, incoming_staging_shape, layer_chunks, scatter,
                     typed_view)
from .ucx_conn import TAG_MASK
from .ucx_runtime import as_bytes_array, recv_ctrl, send_ctrl
from .wire import STATUS_ERROR, STATUS_OK, ControlMsg, MsgKind, WireError


@dataclass(frozen=True)
class ReceiverSide:
    """What an inbound connection may touch on its rank, handed over explicitly."""

    spec: KVCacheSpec
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    num_blocks: int
    config: KVTransferConfig
    # ucxx.recv(buffer, tag=...) when data arrives on the worker by tag (fast path);
    # None when it rides this connection's control endpoint.
    worker_recv: Callable[..., Awaitable[Any]] | None
    deliver_done: Callable[[str, bytes], None]
    count: Callable[[bool, int, int, float], None]  # ok, nbytes, num_blocks, latency_s
    quarantine: list[torch.Tensor]
    # place(req_id, dst block ids, write) runs `write` if the request may write those
    # blocks and says whether it did; every scatter into the caches goes through it.
    place: Callable[[str, Sequence[int], Callable[[], None]], bool]
    verify: bool  # this side asked its senders to seal their pushes (HELLO_REPLY "checksums")
    count_checksum_failure: Callable[[], None]


class Inbound:
    """Receiver side of one connection: place pushes, deliver dones, ack each in order."""

    def __init__(self, side: ReceiverSide, ep: Any) -> None:
        self._side = side
        self._ep = ep
        self._spec = side.spec
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._acks: set[asyncio.Future] = set()  # in-flight ack sends, kept referenced
        # Requests a push of which failed its digests, until their done message (which it replaces).
        self._refused: set[str] = set()

    async def run(self, buf: np.ndarray) -> None:
        while True:
            msg = await recv_ctrl(self._ep, buf)
            if msg.kind is MsgKind.DATA:
                error = await self._on_data(msg, buf)
            elif msg.kind is MsgKind.DONE:
                self._deliver(msg)
                error = None
            elif msg.kind is MsgKind.BYE:
                return
            else:
                raise WireError(f"unexpected {msg.kind.name} on an open connection")
            ack = ControlMsg(MsgKind.ACK, seq=msg.seq, req_id=msg.req_id,
                             status=STATUS_ERROR if error else STATUS_OK,
                             extra=(error or "").encode())
            # Not awaited: the next header can be read while the ack goes out. A failed
            # ack means a dead connection, which the next receive reports.
            self._acks.add(asyncio.ensure_future(send_ctrl(self._ep, ack)))
            self._acks = {a for a in self._acks if not a.done()}

    def _deliver(self, msg: ControlMsg) -> None:
        payload = msg.extra
        if msg.req_id in self._refused:  # some of its bytes were not what was sealed: never admit it
            self._refused.discard(msg.req_id)
            payload = INTEGRITY_REFUSAL
        self._side.deliver_done(msg.req_id, payload)

    async def _on_data(self, msg: ControlMsg, buf: np.ndarray) -> str | None:
        start = time.monotonic()
        error = self._check(msg)
        expected = self._expected_nbytes(msg)
        if (msg.data_nbytes != expected or expected == 0 or msg.chunk_layers == 0
                or expected > self._cache_nbytes()):
            # Cannot even drain the bytes safely: drop the connection.
            raise WireError(f"DATA {msg.req_id!r} announces {msg.data_nbytes} bytes, "
                            f"its header implies {expected}")
        raw = self._staging_for(expected)
        try:
            placed, mismatch = await asyncio.wait_for(self._receive(msg, raw, error is None, buf),
                                                      self._side.config.transfer_timeout_s)
        except BaseException:
            # A worker-level receive may still be posted into this buffer (aborting the
            # endpoint does not cancel it): never reuse it, never free it.
            self._side.quarantine.append(self._staging)
            self._staging = torch.empty(0, dtype=torch.uint8)
            self._side.count(False, 0, 0, 0.0)
            raise
        if mismatch is not None:
            self._refused.add(msg.req_id)
            self._side.count_checksum_failure()
            error = error or mismatch
        if error is not None or placed:
            self._side.count(error is None, expected, len(msg.block_ids), time.monotonic() - start)
        return error

    async def _receive(self, msg: ControlMsg, raw: torch.Tensor, place: bool,
                       buf: np.ndarray) -> tuple[bool, str | None]:
        """(every chunk placed, why the digests do not match or None)."""
        digests: list[int] | None = [] if self._side.verify else None
        placed = await self._recv_and_place(msg, raw, place, digests)
        if digests is None:
            return placed, None
        seal = await recv_ctrl(self._ep, buf)
        if seal.kind is not MsgKind.SEAL or seal.seq != msg.seq:
            raise WireError(f"expected the SEAL of push {msg.seq}, got {seal.kind.name} {seal.seq}")
        sealed = decode_digests(seal.extra)
        if len(sealed) != len(digests):
            raise WireError(f"SEAL of push {msg.seq} has {len(sealed)} digests for {len(digests)} data messages")
        bad = [j for j, (ours, theirs) in enumerate(zip(digests, sealed)) if ours != theirs]
        if not bad:
            return placed, None
        return placed, (f"KV checksum mismatch in data message {bad[0]} of {len(digests)} of {msg.req_id!r}: "
                        "the request is refused here")

    async def _recv_and_place(self, msg: ControlMsg, raw: torch.Tensor, place: bool,
                              digests: list[int] | None) -> bool:
        """Post every chunk's receive at once; digest (into `digests`, when given) and
        scatter each as it lands, in order.

        True if every chunk was placed; False once a chunk was refused its permit (the
        rest is drained, not placed) or `place` was False."""
        per_layer = msg.data_nbytes // len(msg.layers)
        chunks = layer_chunks(len(msg.layers), msg.chunk_layers)
        recvs = [asyncio.ensure_future(self._recv_data(raw[lo * per_layer:hi * per_layer],
                                                       (msg.data_tag + j) & TAG_MASK))
                 for j, (lo, hi) in enumerate(chunks)]
        staging = typed_view(raw, self._staging_shape(msg), self._spec.torch_dtype)
        try:
            for (lo, hi), recv in zip(chunks, recvs):
                await recv
                if digests is not None:
                    digests.append(digest(as_bytes_array(raw[lo * per_layer:hi * per_layer])))
                if place:
                    place = self._side.place(msg.req_id, msg.block_ids, partial(
                        scatter, staging[lo:hi], msg.block_ids, msg.layers[lo:hi],
                        self._local_heads(msg), self._side.k_caches, self._side.v_caches))
        finally:
            for recv in recvs:
                recv.cancel()
        return place

    def _check(self, msg: ControlMsg) -> str | None:
        return check_incoming(msg.block_ids, msg.layers, msg.head_range, self._spec, self._side.num_blocks)

    def _expected_nbytes(self, msg: ControlMsg) -> int:
        return incoming_nbytes(len(msg.block_ids), len(msg.layers), msg.head_range, self._spec)

    async def _recv_data(self, raw: torch.Tensor, tag: int) -> None:
        if self._side.worker_recv is None:
            await self._ep.recv(as_bytes_array(raw))
        else:
            await self._side.worker_recv(as_bytes_array(raw), tag=tag)

    def _staging_shape(self, msg: ControlMsg) -> tuple[int, ...]:
        return incoming_staging_shape(len(msg.block_ids), len(msg.layers), msg.head_range, self._spec)

    def _local_heads(self, msg: ControlMsg) -> tuple[int, int]:
        held = self._spec.local_heads[0]
        return msg.head_range[0] - held, msg.head_range[1] - held

    def _cache_nbytes(self) -> int:
        return cache_nbytes(self._spec, self._side.num_blocks)

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging
