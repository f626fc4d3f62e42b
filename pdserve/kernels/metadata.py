"""Per-step attention metadata: the contract between the model runner and the kernels.

The runner packs one flat batch per step. Sequences with a single query token
(decodes) come first, then sequences with several (prefill chunks), so a fast path
can batch all decodes into one call. Every tensor here lives on the cache's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot of each token, block_id * block_size + offset.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: cumulative query lengths; sequence i owns tokens
    # query_start_loc[i]:query_start_loc[i+1] of the packed batch.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step
    # (tokens already in the cache + tokens scheduled now).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32, right-padded with 0.
    block_tables: torch.Tensor
    # The first num_decodes sequences have exactly one query token.
    num_decodes: int
    block_size: int
    # Host copies of the lengths, so kernels can slice without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])
