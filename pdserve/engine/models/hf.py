"""Any transformers causal LM as the engine's model: transformers' own modules, with the
engine's paged attention registered through `transformers.AttentionInterface`."""

from __future__ import annotations

import torch

from pdserve.engine.attention import ATTENTION_NAME, ForwardContext, attach_step_slot

OWN_ATTENTION = "eager"  # transformers' plain attention: every model class that takes one has it


class TransformersCausalLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model  # attention already switched to the paged kernels
        # How each attention layer finds this step's caches (and, in the first steps, the probe).
        self.step_slot = attach_step_slot(model)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:  # [num_sampled, vocab]
        self.step_slot.ctx = ctx
        try:
            return self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=logits_indices,
            ).logits[0]
        finally:
            self.step_slot.ctx = None

    @torch.inference_mode()
    def own_logits(self, token_ids: list[int]) -> torch.Tensor:  # [vocab]
        """The next-token logits of one sequence as the model computes them itself: transformers'
        own attention, the sequence alone and unpacked, no cache. What the paged forward must match."""
        self.model.set_attn_implementation(OWN_ATTENTION)
        try:
            return self.model(input_ids=torch.tensor([token_ids], device=self.model.device)).logits[0, -1]
        finally:
            self.model.set_attn_implementation(ATTENTION_NAME)
