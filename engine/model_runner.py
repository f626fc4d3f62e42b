"""Runs one scheduled step on the model: pack the batch, forward, sample.

Owns the KV cache tensors. Packs every scheduled request into one flat batch
(decodes first, then prefill chunks), computes positions and cache slots, runs the
transformers model with the engine's paged attention, takes logits only for the rows
that are sampled, and samples them. It never decides what runs; the scheduler does.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from pdserve.engine.attention import ForwardContext
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.parallel import StepFanout
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.kernels import cpu_ext, paged_attention, paged_attention_reference
from pdserve.kernels.metadata import AttentionMetadata

BACKENDS = {"fast": paged_attention, "reference": paged_attention_reference}


@dataclass(slots=True)
class SampledToken:
    scheduled: ScheduledRequest
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: rows of the batch whose logits we need
    sampled: list[ScheduledRequest]


def kv_block_bytes(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V, of the KV heads this rank caches."""
    per_layer = loaded.num_local_kv_heads * block_size * loaded.head_dim * dtype.itemsize
    return 2 * loaded.num_layers * per_layer


class RankForward:
    """One rank's KV caches and its forward over a packed batch: what every tensor-parallel rank
    runs for a step (rank 0 inside the `ModelRunner`, the others in node/tp_worker.py)."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 backend: str) -> None:
        self.loaded = loaded
        shape = (num_blocks, loaded.num_local_kv_heads, block_size, loaded.head_dim)
        self.k_caches = [zeroed_cache(shape, dtype) for _ in range(loaded.num_layers)]
        self.v_caches = [zeroed_cache(shape, dtype) for _ in range(loaded.num_layers)]
        self.backend = BACKENDS[backend]
        if backend == "fast":
            # Build the C++ kernels now (once per machine, up to a minute) rather than
            # inside the first step, where a node's core would stop answering meanwhile.
            cpu_ext.ops()

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:  # [num_sampled, vocab] (rank 0)
        ctx = ForwardContext(batch.metadata, self.k_caches, self.v_caches, self.backend)
        return self.loaded.model(batch.input_ids, batch.positions, ctx, batch.logits_indices)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager, num_blocks: int, dtype: torch.dtype, backend: str,
                 fanout: StepFanout | None = None) -> None:
        self.loaded = loaded
        self.kv = kv
        self.block_size = kv.block_size
        self.forward = RankForward(loaded, num_blocks, self.block_size, dtype, backend)
        self.k_caches, self.v_caches = self.forward.k_caches, self.forward.v_caches
        self.fanout = fanout  # the node's other tensor-parallel ranks run every step with this one
        self.sampler = Sampler(loaded.eos_token_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        batch = self._pack(out.scheduled)
        if self.fanout is not None:
            self.fanout(batch)
        logits = self.forward(batch)  # [num_sampled, vocab]
        if not batch.sampled:
            return []
        rows = [_sampling_row(s.request) for s in batch.sampled]
        result = self.sampler(logits, rows)
        return [
            SampledToken(s, token, lp) for s, token, lp in zip(batch.sampled, result.token_ids, result.logprobs)
        ]

    def _pack(self, scheduled: list[ScheduledRequest]) -> PackedBatch:
        # Decodes first (stable sort) so the kernels can batch them in one call.
        seqs = sorted(scheduled, key=lambda s: s.num_scheduled_tokens != 1)
        query_lens = [s.num_scheduled_tokens for s in seqs]
        starts = [s.request.num_computed_tokens for s in seqs]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        input_ids: list[int] = []
        for s, start, n in zip(seqs, starts, query_lens):
            input_ids.extend(s.request.token_ids[start : start + n])
        tables = [self.kv.block_ids(s.request.req_id) for s in seqs]
        block_tables = _pad_tables(tables)  # [num_seqs, max_blocks]

        query_lens_t = torch.tensor(query_lens)
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), query_lens_t)  # [num_tokens]
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        offsets = torch.arange(len(input_ids)) - query_start_loc[:-1].long()[seq_index]
        positions = torch.tensor(starts)[seq_index] + offsets
        block_ids = block_tables[seq_index, positions // self.block_size].long()
        slot_mapping = block_ids * self.block_size + positions % self.block_size

        sampled_pos = [i for i, s in enumerate(seqs) if s.samples]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            num_decodes=sum(1 for n in query_lens if n == 1),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return PackedBatch(
            input_ids=torch.tensor(input_ids),
            positions=positions,
            metadata=metadata,
            logits_indices=query_start_loc[1:][sampled_pos].long() - 1,
            sampled=[seqs[i] for i in sampled_pos],
        )


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled cache tensor on anonymous memory pages: the OS maps each page on its first
    write, so a large KV budget takes RAM as blocks fill rather than all at start (torch.zeros
    would write every page now)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _sampling_row(request) -> SamplingRow:
    return SamplingRow(
        params=request.params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        seed=request.seed,
        sample_index=request.sample_index,
    )
