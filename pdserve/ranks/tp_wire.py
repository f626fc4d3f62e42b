"""What rank 0 of a tensor-parallel node says to its worker ranks, and how a step's batch reaches them.

Two channels per worker, both made by pdserve/ranks/tp_group.py:

- a pipe each way carrying typed messages: the dataclasses below, in the internal messages'
  tagged JSON (pdserve/common/codec.py; `Connection.send_bytes`, never pickle), each read back into its
  class, and anything else (an unknown type, a missing or unexpected field) a `PipeError`.
  Rank 0 → worker (`Command`), in the order rank 0 decided them: `Start`, `Step`, `Connect`,
  `Push`, `SendDone`, `Guard`, `Grant`, `Revoke`, `Stop`. Worker → rank 0 (`Event`, each with the
  worker transport's counters once it has one): `Ready`, `Connected`, `Granted`, `Handle`,
  `Done`, `Failed`. One ordered pipe is what makes a revoked write permit safe: a worker revokes
  before it runs any later step or grant that could reuse the blocks (pdserve/ranks/kv_ranks.py).
- `StepBuffer`: a shared-memory file both map, into which rank 0 writes each step's packed
  batch. The `Step` message names only the shapes (`StepShapes`) and carries the step's block
  copies (pdserve/engine/block_copies.py: copy-on-write and swaps, one ordered list), which the worker
  makes before it reads the batch and runs the forward. Rank 0 overwrites the buffer only for
  the next step, after this step's all-reduces, which no worker joins before it has read its inputs.

Must never: pickle, or let a worker read a batch rank 0 is still writing.
"""

from __future__ import annotations

import base64
import math
import mmap
import os
import tempfile
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.common.codec import Codec
from pdserve.engine.block_copies import BlockCopy
from pdserve.engine.model_runner import PackedBatch
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kv_transfer import TransferState, TransferStats

SHM_DIR = "/dev/shm"


class PipeError(ValueError):
    """Bytes on a rank pipe that are not a message of its direction."""


@dataclass(frozen=True, slots=True)
class StepShapes:
    """A packed batch's sizes: how a worker reads the arrays rank 0 wrote into the step buffer."""

    tokens: int
    sampled: int
    seqs: int
    width: int  # block table columns
    decodes: int
    block_size: int


# -- rank 0 -> worker ------------------------------------------------------------------
@dataclass(slots=True)
class Start:
    """Size the caches (and the swap space) to rank 0's block counts, map the step buffer."""

    num_blocks: int
    num_swap_blocks: int
    buffer: str  # the step buffer's path
    nbytes: int


@dataclass(slots=True)
class Step:
    """One step: its block copies, in order, then the forward of the batch in the step buffer
    (None: a step that only copies blocks)."""

    batch: StepShapes | None
    copies: list[BlockCopy] = field(default_factory=list)


@dataclass(slots=True)
class Connect:
    reply_id: int
    descriptor: str  # the peer rank's KVDescriptor JSON


@dataclass(slots=True)
class Push:
    handle_id: int
    req_id: str
    src: list[int]
    dst: list[int]
    heads: tuple[int, int]  # global KV heads [start, end)
    peer: str


@dataclass(slots=True)
class SendDone:
    handle_id: int
    req_id: str
    payload: str  # base64 (`to_text`)
    peer: str


@dataclass(slots=True)
class Guard:
    """Guard the worker's transport's writes with its write permits (a node that receives KV)."""


@dataclass(slots=True)
class Grant:
    reply_id: int
    req_id: str
    block_ids: list[int]


@dataclass(slots=True)
class Revoke:
    req_id: str


@dataclass(slots=True)
class Stop:
    pass


# -- worker -> rank 0 ------------------------------------------------------------------
@dataclass(slots=True)
class _Event:
    # The worker's transport counters as it read them when it sent the event (None before it has one).
    sent: TransferStats | None = field(default=None, kw_only=True)
    received: TransferStats | None = field(default=None, kw_only=True)


@dataclass(slots=True)
class Ready(_Event):
    descriptor: str | None  # its KVDescriptor JSON; None: the node moves no KV


@dataclass(slots=True)
class Connected(_Event):
    """A `Connect`'s answer: the rank-level peer id, or why not."""

    reply_id: int
    peer: str | None = None
    diffs: dict[str, list[Any]] | None = None  # a fingerprint mismatch: field -> [local, remote]
    error: str | None = None


@dataclass(slots=True)
class Granted(_Event):
    reply_id: int


@dataclass(slots=True)
class Handle(_Event):
    """A push or done message ended on the worker's transport."""

    handle_id: int
    state: TransferState
    error: str | None = None


@dataclass(slots=True)
class Done(_Event):
    """A done message arrived on the worker's transport."""

    req_id: str
    payload: str  # base64 (`to_text`)


@dataclass(slots=True)
class Failed(_Event):
    error: str


Command = Start | Step | Connect | Push | SendDone | Guard | Grant | Revoke | Stop
Event = Ready | Connected | Granted | Handle | Done | Failed

_COMMANDS = Codec((Start, Step, Connect, Push, SendDone, Guard, Grant, Revoke, Stop), PipeError, "rank 0 command")
_EVENTS = Codec((Ready, Connected, Granted, Handle, Done, Failed), PipeError, "worker event")


def send_command(conn: Connection, msg: Command) -> None:
    conn.send_bytes(_COMMANDS.encode(msg))


def receive_command(conn: Connection) -> Command:
    """The next command; raises EOFError once rank 0 has gone, PipeError on anything else."""
    return _COMMANDS.decode(conn.recv_bytes())


def send_event(conn: Connection, msg: Event) -> None:
    conn.send_bytes(_EVENTS.encode(msg))


def receive_event(conn: Connection) -> Event:
    """The next event; raises EOFError once the worker has gone, PipeError on anything else."""
    return _EVENTS.decode(conn.recv_bytes())


def to_text(payload: bytes) -> str:
    return base64.b64encode(payload).decode()


def from_text(text: str) -> bytes:
    return base64.b64decode(text)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest batch a step can pack: sizes the shared buffer once."""

    max_tokens: int  # the scheduler's token budget
    max_seqs: int
    max_blocks_per_seq: int

    @property
    def nbytes(self) -> int:
        words = 4 * self.max_tokens + 3 * (self.max_seqs + 1) + self.max_seqs * self.max_blocks_per_seq
        return 8 * words

    @classmethod
    def of(cls, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int) -> StepLimits:
        return cls(max_tokens, max_seqs, math.ceil(max_model_len / block_size) + 1)


class StepBuffer:
    """A step's packed batch as int64 arrays in one shared file: input ids, positions, cache slots,
    sampled rows, query starts, sequence lengths, block tables."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), nbytes)
        self._words = torch.frombuffer(self._map, dtype=torch.int64)

    @classmethod
    def create(cls, limits: StepLimits) -> StepBuffer:
        directory = SHM_DIR if os.path.isdir(SHM_DIR) else None
        fd, path = tempfile.mkstemp(prefix="pdserve-step-", dir=directory)
        os.ftruncate(fd, limits.nbytes)
        os.close(fd)
        return cls(path, limits.nbytes)

    def unlink(self) -> None:
        """Once every rank has mapped it: the file disappears with the last process."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def write(self, batch: PackedBatch) -> StepShapes:
        """Copy the batch in; returns the shapes the `Step` message carries."""
        meta = batch.metadata
        arrays = [batch.input_ids, batch.positions, meta.slot_mapping, batch.logits_indices, meta.query_start_loc,
                  meta.seq_lens, meta.block_tables.reshape(-1)]
        offset = 0
        for array in arrays:
            n = array.numel()
            self._words[offset:offset + n].copy_(array)
            offset += n
        return StepShapes(tokens=batch.input_ids.numel(), sampled=batch.logits_indices.numel(),
                          seqs=meta.seq_lens.numel(), width=meta.block_tables.shape[1], decodes=meta.num_decodes,
                          block_size=meta.block_size)

    def read(self, shapes: StepShapes) -> PackedBatch:
        tokens, seqs = shapes.tokens, shapes.seqs
        sizes = [tokens, tokens, tokens, shapes.sampled, seqs + 1, seqs, seqs * shapes.width]
        arrays, offset = [], 0
        for n in sizes:
            arrays.append(self._words[offset:offset + n].clone())
            offset += n
        input_ids, positions, slots, logits_indices, starts, seq_lens, tables = arrays
        starts, seq_lens = starts.to(torch.int32), seq_lens.to(torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens,
            block_tables=tables.to(torch.int32).view(seqs, shapes.width), num_decodes=shapes.decodes,
            block_size=shapes.block_size, query_lens_cpu=(starts[1:] - starts[:-1]).tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return PackedBatch(input_ids, positions, metadata, logits_indices, sampled=[])

    def close(self) -> None:
        del self._words
        self._map.close()
