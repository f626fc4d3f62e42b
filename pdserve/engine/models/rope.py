"""RoPE angles for the native model, computed as transformers' rotary embeddings compute them.

Owns the inverse frequencies and attention scaling of a config (the default formula, or
transformers' own `ROPE_INIT_FUNCTIONS` for scaled types) and the per-step cos/sin. Only types
whose angles depend on the position alone are served natively; "dynamic" and "longrope" also
depend on the sequence length seen so far, so those models run on transformers.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pdserve.engine.model_facts import head_dim, optional

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(text: PretrainedConfig) -> str:
    return (optional(text, "rope_parameters") or {}).get("rope_type", "default")


class RotaryAngles:
    def __init__(self, text: PretrainedConfig, device: torch.device = torch.device("cpu")) -> None:
        kind = rope_type(text)
        if kind not in STATIC_ROPE_TYPES:
            raise ValueError(f"RoPE type {kind!r} is not one of {STATIC_ROPE_TYPES}")
        if kind == "default":
            dim = head_dim(text)
            theta = text.rope_parameters["rope_theta"]
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[kind](text)
        self.inv_freq = self.inv_freq.to(device)  # beside the positions each step brings
    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin, [num_tokens, head_dim] each (transformers' formula and order)."""
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.scaling, angles.sin() * self.scaling
