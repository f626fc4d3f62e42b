"""Runs one scheduled step on the model: pack the batch, forward, sample.

Owns the KV cache tensors, on the model's device (pdserve/engine/device.py), and the host swap space's
tensors beside them (the same per-block layout, on the host), and makes a step's block copies (pdserve/engine/block_copies.py: copy-on-write and swaps, one
ordered list) before the forward. Packs every scheduled request into one flat batch
(decodes first, then prefill chunks), computes positions and cache slots, runs the
transformers model with the engine's paged attention, takes logits only for the rows
that are sampled — and, for requests that ask for prompt logprobs, the prompt rows their
chunk scores (pdserve/engine/prompt_logprobs.py) — and samples them. A step's tensors are packed on the
host from the scheduler's lists and copied to the device once each (`_pack`); the only copy
back is the sampler's, of the sampled token ids (pdserve/engine/sampler.py, `Sampler.__call__`), and of
the logprobs a request asked for. It never decides what runs;
the scheduler does, and never changes a request: the engine core records what a step made.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import ForwardContext
from pdserve.engine.device import to_device
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.block_copies import BlockCopy, CopyKind, runs
from pdserve.engine.parallel import StepFanout
from pdserve.engine.prompt_logprobs import positions_to_score
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs, log_softmax_rows, token_logprobs
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from pdserve.kernels import copy_blocks, cpu_ext, paged_attention, paged_attention_reference
from pdserve.kernels.metadata import AttentionMetadata

BACKENDS = {"fast": paged_attention, "reference": paged_attention_reference}


@dataclass(slots=True)
class ForkedToken:
    """The first token of a sample forked from the request's row (`Request.pending_forks`)."""

    req_id: str
    sample_index: int
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class SampledToken:
    scheduled: ScheduledRequest
    token_id: int
    logprobs: TokenLogprobs | None
    forks: list[ForkedToken] = field(default_factory=list)


@dataclass(slots=True)
class PromptScores:
    """The prompt tokens one step scored for one request, in position order."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class StepResult:
    sampled: list[SampledToken]
    prompt_scores: list[PromptScores]
    logits: torch.Tensor | None = None  # [num_sampled, vocab]: the rows `sampled` drew from, in order


@dataclass(slots=True)
class ScoredRows:
    """A request's chunk positions that score prompt tokens (position p scores token p+1)."""

    request: Request
    positions: range


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # [num_sampled + num_scored]: rows of the batch whose logits we need, sampled rows first
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]
    scored: list[ScoredRows] = field(default_factory=list)  # after the sampled rows, in this order


def kv_block_bytes(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V, of the KV heads this rank caches."""
    per_layer = loaded.num_local_kv_heads * block_size * loaded.head_dim * dtype.itemsize
    return 2 * loaded.num_layers * per_layer


class RankForward:
    """One rank's KV caches and its forward over a packed batch: what every tensor-parallel rank
    runs for a step (rank 0 inside the `ModelRunner`, the others in pdserve/ranks/tp_worker.py)."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 backend: str, num_swap_blocks: int = 0) -> None:
        self.loaded = loaded
        shape = (num_blocks, loaded.num_local_kv_heads, block_size, loaded.head_dim)
        self.k_caches = [zeroed_cache(shape, dtype, loaded.device) for _ in range(loaded.num_layers)]
        self.v_caches = [zeroed_cache(shape, dtype, loaded.device) for _ in range(loaded.num_layers)]
        # The swap space: host memory (pinned, were the caches on a GPU); pages mapped as blocks fill.
        swap_shape = (num_swap_blocks, *shape[1:])
        self.k_swap = [zeroed_cache(swap_shape, dtype) for _ in range(loaded.num_layers)] if num_swap_blocks else []
        self.v_swap = [zeroed_cache(swap_shape, dtype) for _ in range(loaded.num_layers)] if num_swap_blocks else []
        self.backend = BACKENDS[backend]
        if backend == "fast" and loaded.device.type == "cpu":
            # Build the C++ kernels now (once per machine, up to a minute) rather than
            # inside the first step, where a node's core would stop answering meanwhile.
            cpu_ext.ops()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """A step's block copies, in their order, every layer's K and V; before the step's forward,
        so its writes land in the copies and never in a block a swap-out still has to read."""
        device, host = (*self.k_caches, *self.v_caches), (*self.k_swap, *self.v_swap)
        ends = {CopyKind.COW: (device, device), CopyKind.SWAP_OUT: (device, host), CopyKind.SWAP_IN: (host, device)}
        for kind, pairs in runs(copies):
            copy_blocks(*ends[kind], pairs)

    @torch.inference_mode()
    def __call__(self, batch: PackedBatch) -> torch.Tensor:  # [num_sampled + num_scored, vocab] (rank 0)
        ctx = ForwardContext(batch.metadata, self.k_caches, self.v_caches, self.backend)
        return self.loaded.model(batch.input_ids, batch.positions, ctx, batch.logits_indices)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVCacheManager, num_blocks: int, dtype: torch.dtype, backend: str,
                 fanout: StepFanout | None = None, num_swap_blocks: int = 0) -> None:
        self.loaded = loaded
        self.kv = kv
        self.block_size = kv.block_size
        self.device = loaded.device  # every step tensor is copied here once (`_pack`)
        self.forward = RankForward(loaded, num_blocks, self.block_size, dtype, backend, num_swap_blocks)
        self.k_caches, self.v_caches = self.forward.k_caches, self.forward.v_caches
        self.fanout = fanout  # the node's other tensor-parallel ranks run every step with this one
        self.sampler = Sampler(loaded.eos_token_ids)

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """This rank's block copies of the step, before its forward; a step that runs nothing makes
        them too (a swap-out). The other ranks get the same list with the step's batch (`execute`),
        or alone when the step runs nothing, and make it before their forward."""
        if not out.copies:
            return
        if out.is_empty and self.fanout is not None:
            self.fanout(None, out.copies)
        self.forward.copy_blocks(out.copies)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """The step's forward and sampling; its copies were made (`copy_blocks`)."""
        batch = self._pack(out.scheduled)
        if self.fanout is not None:
            self.fanout(batch, out.copies)
        logits = self.forward(batch)  # [num_sampled + num_scored, vocab]
        num_sampled = len(batch.sampled)
        scores = _score_prompts(batch.scored, logits[num_sampled:])
        if not batch.sampled:
            return StepResult([], scores)
        rows, sources = _sampling_rows(batch.sampled)
        sampled_logits = logits[:num_sampled]  # [num_sampled, vocab]
        if len(rows) > num_sampled:  # forked samples draw from their parent's row
            sampled_logits = sampled_logits[torch.tensor(sources, device=self.device)]  # [len(rows), vocab]
        result = self.sampler(sampled_logits, rows)
        return StepResult(_sampled_tokens(batch.sampled, result.token_ids, result.logprobs), scores,
                          logits[:num_sampled])

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
        scored, scored_rows = _prompt_rows(seqs, starts, query_start_loc)
        logits_indices = _logits_indices(query_start_loc[1:][sampled_pos].long() - 1, scored_rows)
        # Built on the host above (small integer arithmetic on the scheduler's lists); one copy each here.
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, device),
            query_start_loc=to_device(query_start_loc, device),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
            block_tables=to_device(block_tables, device),
            num_decodes=sum(1 for n in query_lens if n == 1),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return PackedBatch(
            input_ids=to_device(torch.tensor(input_ids), device),
            positions=to_device(positions, device),
            metadata=metadata,
            logits_indices=to_device(logits_indices, device),
            sampled=[seqs[i] for i in sampled_pos],
            scored=scored,
        )


def _logits_indices(sampled_rows: torch.Tensor, scored_rows: list[int]) -> torch.Tensor:
    """The rows the lm_head runs on: the sampled ones, then those scoring prompt tokens (if any)."""
    if not scored_rows:
        return sampled_rows
    return torch.cat([sampled_rows, torch.tensor(scored_rows, dtype=torch.long)])


def _prompt_rows(seqs: list[ScheduledRequest], starts: list[int],
                 query_start_loc: torch.Tensor) -> tuple[list[ScoredRows], list[int]]:
    """The chunks' rows that score prompt tokens, for the requests that ask (none: no rows)."""
    scored: list[ScoredRows] = []
    rows: list[int] = []
    for i, s in enumerate(seqs):
        if s.request.prompt_logprobs is None:
            continue
        positions = positions_to_score(s.request, s.num_scheduled_tokens)
        if not positions:
            continue
        scored.append(ScoredRows(s.request, positions))
        first_row = int(query_start_loc[i]) + positions.start - starts[i]
        rows.extend(range(first_row, first_row + len(positions)))
    return scored, rows


def _score_prompts(scored: list[ScoredRows], logits: torch.Tensor) -> list[PromptScores]:
    """logits: [num_scored, vocab], the rows of `scored` in order. Raw logprobs (no penalty or
    temperature), as vLLM scores a prompt."""
    if not scored:
        return []
    token_ids = [r.request.prompt_token_ids[p + 1] for r in scored for p in r.positions]
    num_tops = [r.request.params.prompt_logprobs for r in scored for _ in r.positions]
    assert logits.shape[0] == len(token_ids), f"{logits.shape[0]} scored rows for {len(token_ids)} prompt tokens"
    logprobs = token_logprobs(log_softmax_rows(logits), torch.tensor(token_ids, device=logits.device), num_tops)
    out, begin = [], 0
    for r in scored:
        end = begin + len(r.positions)
        out.append(PromptScores(r.request, token_ids[begin:end], logprobs[begin:end]))
        begin = end
    return out


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """A zero-filled cache tensor. On the host, on anonymous memory pages: the OS maps each page on
    its first write, so a large KV budget takes RAM as blocks fill rather than all at start
    (torch.zeros would write every page now). On a device, torch.zeros there."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _sampling_row(request: Request, sample_index: int | None = None) -> SamplingRow:
    return SamplingRow(
        params=request.params,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        seed=request.seed,
        sample_index=request.sample_index if sample_index is None else sample_index,
        grammar=request.grammar,  # a fork row draws under its parent's matcher: same tokens so far
    )


def _sampling_rows(sampled: list[ScheduledRequest]) -> tuple[list[SamplingRow], list[int]]:
    """One row per sampled request, followed by one per sample it forks this step (same
    logits, its own sample_index); `sources[r]` is the logits row that row r reads."""
    rows: list[SamplingRow] = []
    sources: list[int] = []
    for i, s in enumerate(sampled):
        rows.append(_sampling_row(s.request))
        sources.append(i)
        for fork in s.request.pending_forks:
            rows.append(_sampling_row(s.request, fork.sample_index))
            sources.append(i)
    return rows, sources


def _sampled_tokens(sampled: list[ScheduledRequest], token_ids: list[int],
                    logprobs: list[TokenLogprobs | None]) -> list[SampledToken]:
    """Regroup the sampler's rows (in `_sampling_rows` order) per request."""
    out: list[SampledToken] = []
    r = 0
    for s in sampled:
        token = SampledToken(s, token_ids[r], logprobs[r])
        r += 1
        for fork in s.request.pending_forks:
            token.forks.append(ForkedToken(fork.req_id, fork.sample_index, token_ids[r], logprobs[r]))
            r += 1
        out.append(token)
    assert r == len(token_ids), f"{len(token_ids)} sampled rows, {r} regrouped"
    return out
