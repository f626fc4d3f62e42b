"""Control messages of the KV transfer protocol: one fixed header, one encode/decode pair.

Layout (little endian), then the body:

    magic "PDKV" | version u16 | kind u16 | seq u64 | data_tag u64 | data_nbytes u64
    | status u32 | head_start u32 | head_end u32 | n_blocks u32 | n_layers u32
    | chunk_layers u32 | req_id_len u32 | extra_len u32
    body: req_id (utf-8) | block ids (int32 x n_blocks) | layers (int32 x n_layers) | extra

`extra` is JSON for HELLO / HELLO_REPLY, the opaque payload for DONE, the error text
of a failed ACK and, for SEAL, the u64 digests of a push's data messages in order
(pdserve/kv_transfer/integrity.py): sent right after them, when the receiver asked for checksums. KV bytes never travel here: a DATA message announces the raw staging
buffer (`data_nbytes`) that follows it as ceil(n_layers / chunk_layers) messages, chunk j
holding layers [j * chunk_layers, (j + 1) * chunk_layers) of the staging layout and tagged
`data_tag + j`, so that gather, wire and scatter of consecutive chunks overlap.

Must never: pickle, or trust a length it has not checked against the buffer.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"PDKV"
WIRE_VERSION = 3  # 2: SEAL; 3: connections from worker addresses (HELLO's tags, BYE)
HEADER = struct.Struct("<4sHHQQQIIIIIIII")

STATUS_OK = 0
STATUS_ERROR = 1


class WireError(ValueError):
    """A control message that does not decode: wrong magic, version or lengths."""


class MsgKind(enum.IntEnum):
    HELLO = 1        # connector -> receiver: spec, num_blocks, worker address, tags
    HELLO_REPLY = 2  # receiver -> connector: accepted / refused (+ its spec)
    DATA = 3         # sender -> receiver: a push; the staging bytes follow
    DONE = 4         # sender -> receiver: request complete, opaque payload
    ACK = 5          # receiver -> sender: seq placed (or failed, with error text)
    SEAL = 6         # sender -> receiver: the digests of push seq's data messages
    BYE = 7          # sender -> receiver: closing (a worker-address connection has no close of its own)


@dataclass(slots=True)
class ControlMsg:
    kind: MsgKind
    seq: int = 0
    req_id: str = ""
    data_tag: int = 0
    data_nbytes: int = 0
    status: int = STATUS_OK
    head_range: tuple[int, int] = (0, 0)
    block_ids: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    chunk_layers: int = 0
    extra: bytes = b""

    def encode(self) -> bytes:
        req = self.req_id.encode()
        header = HEADER.pack(MAGIC, WIRE_VERSION, int(self.kind), self.seq, self.data_tag,
                             self.data_nbytes, self.status, self.head_range[0],
                             self.head_range[1], len(self.block_ids), len(self.layers),
                             self.chunk_layers, len(req), len(self.extra))
        return b"".join((header, req, _ints(self.block_ids), _ints(self.layers), self.extra))

    @classmethod
    def decode(cls, buf: bytes | memoryview) -> ControlMsg:
        view = memoryview(buf)
        if len(view) < HEADER.size:
            raise WireError(f"control message shorter than its header ({len(view)} bytes)")
        (magic, version, kind, seq, data_tag, data_nbytes, status, head_start, head_end,
         n_blocks, n_layers, chunk_layers, req_len, extra_len) = HEADER.unpack_from(view)
        if magic != MAGIC or version != WIRE_VERSION:
            raise WireError(f"bad control header: magic={magic!r} version={version}")
        end = HEADER.size + req_len + 4 * (n_blocks + n_layers) + extra_len
        if end > len(view):
            raise WireError(f"control message claims {end} bytes, buffer holds {len(view)}")
        pos = HEADER.size
        try:
            req_id = bytes(view[pos:pos + req_len]).decode()
        except UnicodeDecodeError as exc:
            raise WireError("req_id is not utf-8") from exc
        pos += req_len
        block_ids = _read_ints(view, pos, n_blocks)
        pos += 4 * n_blocks
        layers = _read_ints(view, pos, n_layers)
        pos += 4 * n_layers
        try:
            msg_kind = MsgKind(kind)
        except ValueError as exc:
            raise WireError(f"unknown control message kind {kind}") from exc
        return cls(kind=msg_kind, seq=seq, req_id=req_id, data_tag=data_tag,
                   data_nbytes=data_nbytes, status=status, head_range=(head_start, head_end),
                   block_ids=block_ids, layers=layers, chunk_layers=chunk_layers,
                   extra=bytes(view[pos:pos + extra_len]))


def _ints(values: tuple[int, ...]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _read_ints(view: memoryview, pos: int, count: int) -> tuple[int, ...]:
    return tuple(np.frombuffer(view, dtype="<i4", count=count, offset=pos).tolist())
