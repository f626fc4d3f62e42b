"""The engine's paged attention, plugged into transformers models.

transformers calls the registered function once per layer with the layer's query,
key and value (RoPE and any q/k norm already applied). We write the new keys and
values into the paged cache and attend over the cache. Everything the function needs
for this step is the model's `StepSlot`, which every attention module holds
(`module.pdserve_step`): not a keyword argument of the forward call, because some
decoder layers (StableLM's, Nemotron's) do not pass their keyword arguments down to
attention; and not a module-level global, so two engines in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels import write_kv_cache
from pdserve.kernels.metadata import AttentionMetadata

ATTENTION_NAME = "pdserve_paged"


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


class AttentionProbe:
    """What the attention layers of a transformers model asked for, recorded while the engine's
    first steps run (pdserve/engine/first_steps.py): which layers called, and anything they asked of
    attention that the paged kernels do not do (they attend causally over the cache, nothing else)."""

    def __init__(self) -> None:
        self.layer_calls: list[int] = []
        self.unsupported: set[str] = set()

    def record(self, module: torch.nn.Module, attention_mask: torch.Tensor | None, kwargs: dict) -> None:
        self.layer_calls.append(module.layer_idx)
        # An encoder's layers (BERT's, with is_decoder unset) say so on the module or the call.
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            self.unsupported.add("attention both ways (not causal)")
        if attention_mask is not None:
            self.unsupported.add("an attention mask or bias of its own")
        for key, what in UNSUPPORTED_ATTENTION_KWARGS.items():
            if kwargs.get(key) is not None:
                self.unsupported.add(what)


# Keyword arguments transformers passes to an attention function that change what it computes.
UNSUPPORTED_ATTENTION_KWARGS = {"sliding_window": "a sliding window", "softcap": "logit soft-capping",
                                "s_aux": "attention sinks", "sinks": "attention sinks"}


class StepSlot:
    """The forward context of the step a transformers model is running, or None between steps.
    One per model, set around each forward (pdserve/engine/models/hf.py), read by every layer; `probe`
    is set only during the engine's first steps."""

    __slots__ = ("ctx", "probe")

    def __init__(self) -> None:
        self.ctx: ForwardContext | None = None
        self.probe: AttentionProbe | None = None


def attach_step_slot(model: torch.nn.Module) -> StepSlot:
    """A new slot, held by every module of `model` that knows its layer (`layer_idx`): the
    attention modules, whatever path the decoder layers call them by."""
    slot = StepSlot()
    for module in model.modules():
        if getattr(module, "layer_idx", None) is not None:
            module.pdserve_step = slot
    return slot


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    slot: StepSlot = module.pdserve_step
    layer = module.layer_idx
    if slot.probe is not None:
        slot.probe.record(module, attention_mask, kwargs)
    ctx = slot.ctx
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
    the native model (pdserve/engine/models/llama.py) never needs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
