"""Model implementations the engine runs, behind one call: packed tokens in, sampled logits out.

`native` (pdserve/engine/models/llama.py) is the engine's own forward for the Llama family; `transformers`
(pdserve/engine/models/hf.py) runs any causal LM through transformers with the engine's paged attention.
Both read the checkpoint from the same local directory and write the same paged KV cache.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.engine.attention import ForwardContext


class CausalLM(Protocol):
    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        ctx: ForwardContext,
        logits_indices: torch.Tensor,  # [num_sampled]: rows whose logits are wanted
    ) -> torch.Tensor:  # [num_sampled, vocab]
        ...
