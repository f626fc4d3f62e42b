"""Receiver side of one torch.distributed pair: place pushes, deliver dones, ack each in order.

A message's life on the receiving rank (the pair's own receiver thread):

    DATA header ─▶ validate dst blocks / layers / heads against our own cache, and the byte
                   count against the header (a count that does not add up drops the pair: the
                   bytes could not even be drained)
                ─▶ receive the staging bytes (on the caches' device) within transfer_timeout_s
                ─▶ when this side asked for checksums: digest them, take the push's SEAL and
                   compare (a mismatch: nothing is placed, an error ACK, the request refused)
                ─▶ scatter them into the dst blocks under the request's write permit
                   (`ReceiverSide.place`) ─▶ ACK(seq)
    DONE        ─▶ deliver (req_id, payload), or `INTEGRITY_REFUSAL` in its place for a request
                   a push of which failed its checksum ─▶ ACK(seq)

Messages are handled strictly one after another, so a DONE is delivered after the bytes of
every push sent before it. A failed validation still drains the bytes and answers with an
error ACK; a push whose request holds no permit (cancelled, lease over, never granted) is
drained and acknowledged OK but placed nowhere, as on UCX (ucx_inbound.py). The pair ends when
a data receive fails (the peer went mid-push) or the transport closes (`close`: CLOSE is set
as the next message, or the loop sees the flag between two messages).

Must never: write a block the header did not name, write outside `place`, or pickle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from functools import partial

import torch

from .integrity import INTEGRITY_REFUSAL, decode_digests, digest_tensor
from .layout import cache_nbytes, check_incoming, incoming_nbytes, incoming_staging_shape, scatter, typed_view
from .torch_pair import PairGroup, finish_device_work
from .ucx_inbound import ReceiverSide
from .wire import STATUS_ERROR, STATUS_OK, ControlMsg, MsgKind, WireError

logger = logging.getLogger(__name__)


class TorchInbound:
    def __init__(self, side: ReceiverSide, pair: PairGroup, peer: str) -> None:
        self._side = side
        self._spec = side.spec
        self._pair = pair
        self._peer = peer
        self._staging = torch.empty(0, dtype=torch.uint8, device=pair.device)
        self._closed = threading.Event()
        # Requests a push of which failed its digest, until their done message (which it replaces).
        self._refused: set[str] = set()
        self.next_seq = 1  # the message this loop waits for

    def close(self, closer) -> None:
        """End the loop: at once if it waits for a message, else after the one it handles
        (a message it reads from now on is dropped, failing its push on the sender's side).
        `closer`: a store client of this rank's own (not the loop's, which may be waiting)."""
        self._closed.set()
        self._pair.close_receiver(closer, self.next_seq)

    def run(self) -> None:
        """Until the pair breaks or closes; never raises."""
        try:
            for seq in itertools.count(1):
                self.next_seq = seq
                msg = None if self._closed.is_set() else self._pair.recv_ctrl(seq)
                # A message read once closing began is dropped: the sender may have overwritten
                # the CLOSE key with it, and nothing is placed or delivered after close().
                if msg is None or self._closed.is_set():
                    return
                if msg.seq != seq:
                    raise WireError(f"message {msg.seq} where {seq} was due")
                error = self._on_message(msg)
                self._pair.send_ctrl(seq, ControlMsg(MsgKind.ACK, seq=seq, req_id=msg.req_id,
                                                     status=STATUS_ERROR if error else STATUS_OK,
                                                     extra=(error or "").encode()), ack=True)
        except Exception as exc:  # peer gone mid-push, or a protocol error: drop the pair
            logger.info("inbound KV pair from %s ended: %r", self._peer, exc)
        finally:
            self._pair.abort()

    def _on_message(self, msg: ControlMsg) -> str | None:
        if msg.kind is MsgKind.DONE:
            refused = msg.req_id in self._refused
            self._refused.discard(msg.req_id)
            self._side.deliver_done(msg.req_id, INTEGRITY_REFUSAL if refused else msg.extra)
            return None
        if msg.kind is not MsgKind.DATA:
            raise WireError(f"unexpected {msg.kind.name} on an open pair")
        return self._on_data(msg)

    def _on_data(self, msg: ControlMsg) -> str | None:
        start = time.monotonic()
        error = check_incoming(msg.block_ids, msg.layers, msg.head_range, self._spec, self._side.num_blocks)
        expected = incoming_nbytes(len(msg.block_ids), len(msg.layers), msg.head_range, self._spec)
        if msg.data_nbytes != expected or expected == 0 or expected > cache_nbytes(self._spec, self._side.num_blocks):
            raise WireError(f"DATA {msg.req_id!r} announces {msg.data_nbytes} bytes, its header implies {expected}")
        raw = self._staging_for(expected)
        try:
            self._pair.recv_data(raw[:expected], self._side.config.transfer_timeout_s)
        except BaseException:
            self._side.count(False, 0, 0, 0.0)
            raise
        mismatch = self._check_seal(msg, raw[:expected])  # taken for a refused header too: no key lingers
        error = error or mismatch
        placed = error is None and self._place(msg, raw)
        if error is not None or placed:
            self._side.count(error is None, expected, len(msg.block_ids), time.monotonic() - start)
        return error

    def _check_seal(self, msg: ControlMsg, data: torch.Tensor) -> str | None:
        """Why the push's bytes are not what its sender sealed, or None (also when unchecked)."""
        if not self._side.verify:
            return None
        sealed = decode_digests(self._pair.recv_seal(msg.seq, self._side.config.transfer_timeout_s))
        if len(sealed) != 1:  # one data message per push on this transport
            raise WireError(f"SEAL of push {msg.seq} has {len(sealed)} digests for 1 data message")
        if sealed[0] == digest_tensor(data):
            return None
        self._refused.add(msg.req_id)
        self._side.count_checksum_failure()
        return f"KV checksum mismatch in data message 0 of 1 of {msg.req_id!r}: the request is refused here"

    def _place(self, msg: ControlMsg, raw: torch.Tensor) -> bool:
        shape = incoming_staging_shape(len(msg.block_ids), len(msg.layers), msg.head_range, self._spec)
        held = self._spec.local_heads[0]
        local_heads = (msg.head_range[0] - held, msg.head_range[1] - held)
        staging = typed_view(raw, shape, self._spec.torch_dtype)
        placed = self._side.place(msg.req_id, msg.block_ids, partial(
            scatter, staging, msg.block_ids, msg.layers, local_heads, self._side.k_caches, self._side.v_caches))
        finish_device_work(self._pair.device)  # the ack says the bytes are in the blocks
        return placed

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self._pair.device)
        return self._staging
