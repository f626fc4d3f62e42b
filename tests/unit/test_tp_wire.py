"""The step hand-off of a tensor-parallel node: a packed batch through the shared step buffer
comes out as the same tensors and metadata, and the buffer is sized for the largest step."""

from __future__ import annotations

import torch

from pdserve.engine.model_runner import PackedBatch
from pdserve.kernels.metadata import AttentionMetadata
from pdserve.ranks.tp_wire import StepBuffer, StepLimits


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
