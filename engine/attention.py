"""The engine's paged attention, plugged into transformers models.

transformers calls the registered function once per layer with the layer's query,
key and value (RoPE and any q/k norm already applied). We write the new keys and
values into the paged cache and attend over the cache. Everything the function needs
for this step arrives in the forward call's keyword arguments (`pdserve_forward`),
never through a module-level global, so two engines in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels import write_kv_cache
from pdserve.kernels.metadata import AttentionMetadata

ATTENTION_NAME = "pdserve_paged"
FORWARD_KWARG = "pdserve_forward"


class AttentionBackend(Protocol):
    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


@dataclass(slots=True)
class ForwardContext:
    """What one forward pass of the model needs to read and write the paged cache."""

    metadata: AttentionMetadata
    k_caches: list[torch.Tensor]  # one per layer
    v_caches: list[torch.Tensor]
    backend: AttentionBackend


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx: ForwardContext = kwargs[FORWARD_KWARG]
    layer = module.layer_idx
    # transformers hands [1, heads, num_tokens, head_dim]; kernels take token-major.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    k_cache, v_cache = ctx.k_caches[layer], ctx.v_caches[layer]
    write_kv_cache(k, v, k_cache, v_cache, ctx.metadata.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = ctx.backend(q, k_cache, v_cache, ctx.metadata, scale)  # [num_tokens, heads, head_dim]
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    # The paged kernels derive causality from the metadata; a dense mask would be waste.
    return None


def register_paged_attention() -> str:
    """Register the engine's attention with transformers (idempotent); returns its name.

    Imported here: transformers' attention and masking modules cost ~120 MB of memory, which
    the native model (engine/models/llama.py) never needs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
