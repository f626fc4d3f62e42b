"""The step hand-off of a tensor-parallel node: a packed batch through the shared step buffer
comes out as the same tensors and metadata, and the buffer is sized for the largest step; every
message of the rank pipes comes back as its own class, and anything else is a PipeError."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from pdserve.engine.block_copies import BlockCopy, CopyKind
from pdserve.engine.model_runner import PackedBatch
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.kv_transfer import TransferState, TransferStats
from pdserve.ranks.tp_wire import (Connect, Connected, Done, Failed, Grant, Granted, Guard, Handle, PipeError, Push,
                                   Ready, Revoke, SendDone, Start, Step, StepBuffer, StepLimits, StepShapes, Stop,
                                   receive_command, receive_event, send_command, send_event, to_text)


def batch(query_lens: list[int], starts: list[int], width: int) -> PackedBatch:
    loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens), 0, out=loc[1:])
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    tokens = sum(query_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(tokens) * 3, query_start_loc=loc, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(len(query_lens) * width, dtype=torch.int32).view(len(query_lens), width),
        num_decodes=sum(1 for n in query_lens if n == 1), block_size=16, query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)
    return PackedBatch(torch.arange(100, 100 + tokens), torch.arange(tokens) + 7, metadata,
                       loc[1:].long() - 1, sampled=[])


def test_a_batch_read_back_from_the_buffer_equals_the_one_written():
    limits = StepLimits.of(max_tokens=64, max_seqs=4, max_model_len=128, block_size=16)
    writer = StepBuffer.create(limits)
    reader = StepBuffer(writer.path, limits.nbytes)  # what a worker maps
    writer.unlink()
    for sent in (batch([1, 1, 30], [40, 9, 0], 3), batch([1], [127], limits.max_blocks_per_seq)):
        got = reader.read(writer.write(sent))
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(sent, name)) and getattr(got, name).dtype == torch.int64
        a, b = got.metadata, sent.metadata
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert torch.equal(getattr(a, name), getattr(b, name)) and getattr(a, name).dtype == getattr(b, name).dtype
        assert (a.num_decodes, a.block_size, a.query_lens_cpu, a.seq_lens_cpu) == (
            b.num_decodes, b.block_size, b.query_lens_cpu, b.seq_lens_cpu)
    reader.close()
    writer.close()


COPIES = [BlockCopy(CopyKind.SWAP_OUT, 4, 0), BlockCopy(CopyKind.SWAP_OUT, 5, 1), BlockCopy(CopyKind.COW, 2, 3)]
COMMANDS = [
    Start(96, 8, "/dev/shm/pdserve-step-x", 4096),
    Step(StepShapes(tokens=33, sampled=3, seqs=3, width=4, decodes=2, block_size=16), COPIES),
    Step(None, [BlockCopy(CopyKind.SWAP_IN, 0, 7)]),  # a step that only copies
    Step(StepShapes(1, 1, 1, 1, 1, 8), []),
    Connect(3, '{"address": "127.0.0.1"}'),
    Push(4, "r1", [1, 2], [7, 8], (2, 4), "peer-1"),
    SendDone(5, "r1", to_text(b"\x00done"), "peer-1"),
    Guard(),
    Grant(6, "r2", [9, 10]),
    Revoke("r2"),
    Stop(),
]
EVENTS = [
    Ready('{"ranks": []}'),
    Ready(None, sent=TransferStats(), received=TransferStats(10, 1, 1, 0, 0.5)),
    Connected(3, peer="peer-1"),
    Connected(3, diffs={"dtype": ["float32", "bfloat16"]}),
    Connected(3, error="TimeoutError: no answer"),
    Granted(6),
    Handle(4, TransferState.SUCCESS, sent=TransferStats(4096, 2, 1, 0, 0.01)),
    Handle(5, TransferState.FAILED, "rank 1: gone"),
    Done("r1", to_text(b"{}")),
    Failed("RuntimeError: boom"),
]


@pytest.fixture
def pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    yield reader, writer
    reader.close()
    writer.close()


@pytest.mark.parametrize("msg", COMMANDS, ids=lambda m: type(m).__name__)
def test_every_command_reaches_the_worker_as_its_class(pipe, msg):
    reader, writer = pipe
    send_command(writer, msg)
    assert reader.poll(0) and reader.recv_bytes().startswith(b"{")  # JSON, never pickle
    send_command(writer, msg)
    assert receive_command(reader) == msg


@pytest.mark.parametrize("msg", EVENTS, ids=lambda m: type(m).__name__)
def test_every_event_reaches_rank_0_as_its_class(pipe, msg):
    reader, writer = pipe
    send_event(writer, msg)
    assert receive_event(reader) == msg


@pytest.mark.parametrize("raw", [
    b"", b"[]", b'{"op": "step", "shapes": {}, "block_copies": []}',  # the old op-dicts are not messages
    b'{"type": "Nope", "body": {}}', b'{"type": "Revoke", "body": {}}',
    b'{"type": "Revoke", "body": {"req_id": "a", "extra": 1}}',
    b'{"type": "Step", "body": {"batch": null, "copies": [{"kind": "teleport", "src": 1, "dst": 2}]}}',
    b'{"type": "Step", "body": {"batch": {"tokens": 1}, "copies": []}}',
    b'{"type": "Ready", "body": {"descriptor": null}}',  # an event is not a command
])
def test_anything_else_on_the_command_pipe_is_a_pipe_error(pipe, raw):
    reader, writer = pipe
    writer.send_bytes(raw)
    with pytest.raises(PipeError):
        receive_command(reader)


def test_a_command_is_not_an_event_and_is_never_sent_as_one(pipe):
    reader, writer = pipe
    with pytest.raises(PipeError, match="Stop is not a worker event"):
        send_event(writer, Stop())
    send_command(writer, Stop())
    with pytest.raises(PipeError, match="not a worker event"):
        receive_event(reader)
