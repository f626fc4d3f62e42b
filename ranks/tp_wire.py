"""What rank 0 of a tensor-parallel node says to its worker ranks, and how a step's batch reaches them.

Two channels per worker, both made by ranks/tp_group.py:

- a pipe each way carrying JSON messages (`send` / `receive`: `Connection.send_bytes`, never
  pickle). Rank 0 → worker, in the order rank 0 decided them: `swap`, `step`, `connect`, `push`,
  `send_done`, `grant`, `revoke`, `stop`. Worker → rank 0: `ready`, `connected`, `handle`,
  `done`, `failed`. One ordered pipe is what makes a revoked write permit safe: a worker revokes
  before it runs any later step or grant that could reuse the blocks (ranks/kv_ranks.py).
- `StepBuffer`: a shared-memory file both map, into which rank 0 writes each step's packed
  batch. The `step` message names only the shapes; the worker reads the arrays in place. Rank 0
  overwrites the buffer only for the next step, after this step's all-reduces, which no worker
  joins before it has read its inputs.

Must never: pickle, or let a worker read a batch rank 0 is still writing.
"""

from __future__ import annotations

import base64
import json
import math
import mmap
import os
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.engine.model_runner import PackedBatch
from pdserve.kernels.metadata import AttentionMetadata

SHM_DIR = "/dev/shm"


def send(conn: Connection, op: str, **fields: Any) -> None:
    conn.send_bytes(json.dumps({"op": op, **fields}, separators=(",", ":")).encode())


def receive(conn: Connection) -> dict[str, Any]:
    """The next message; raises EOFError once the other side has gone."""
    return json.loads(conn.recv_bytes())


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

    def write(self, batch: PackedBatch) -> dict[str, int]:
        """Copy the batch in; returns the shapes the `step` message carries."""
        meta = batch.metadata
        arrays = [batch.input_ids, batch.positions, meta.slot_mapping, batch.logits_indices, meta.query_start_loc,
                  meta.seq_lens, meta.block_tables.reshape(-1)]
        offset = 0
        for array in arrays:
            n = array.numel()
            self._words[offset:offset + n].copy_(array)
            offset += n
        return {"tokens": batch.input_ids.numel(), "sampled": batch.logits_indices.numel(),
                "seqs": meta.seq_lens.numel(), "width": meta.block_tables.shape[1], "decodes": meta.num_decodes,
                "block_size": meta.block_size}

    def read(self, shapes: dict[str, int]) -> PackedBatch:
        tokens, seqs = shapes["tokens"], shapes["seqs"]
        sizes = [tokens, tokens, tokens, shapes["sampled"], seqs + 1, seqs, seqs * shapes["width"]]
        arrays, offset = [], 0
        for n in sizes:
            arrays.append(self._words[offset:offset + n].clone())
            offset += n
        input_ids, positions, slots, logits_indices, starts, seq_lens, tables = arrays
        starts, seq_lens = starts.to(torch.int32), seq_lens.to(torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=slots, query_start_loc=starts, seq_lens=seq_lens,
            block_tables=tables.to(torch.int32).view(seqs, shapes["width"]), num_decodes=shapes["decodes"],
            block_size=shapes["block_size"], query_lens_cpu=(starts[1:] - starts[:-1]).tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return PackedBatch(input_ids, positions, metadata, logits_indices, sampled=[])

    def close(self) -> None:
        del self._words
        self._map.close()
