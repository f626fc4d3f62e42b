"""Any transformers causal LM as the engine's model: transformers' own modules, with the
engine's paged attention registered through `transformers.AttentionInterface`."""

from __future__ import annotations

import torch

from pdserve.engine.attention import FORWARD_KWARG, ForwardContext


class TransformersCausalLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model  # attention already switched to the paged kernels

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:  # [num_sampled, vocab]
        return self.model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            logits_to_keep=logits_indices,
            **{FORWARD_KWARG: ctx},
        ).logits[0]
