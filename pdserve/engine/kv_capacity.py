"""How many KV blocks an engine's cache gets: an explicit `--num-blocks`, else what
`--kv-cache-bytes` holds, else what `--kv-cache-memory-fraction` leaves once the weights and
the largest step's activations are measured (pdserve/engine/memory_profile.py, pdserve/engine/kv_budget.py).

Every rank of a node computes the same count from its own share of the KV heads, as each GPU
of a tensor-parallel group would from its own memory.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from pdserve.engine.kv_budget import kv_cache_blocks
from pdserve.engine.memory_profile import profile_memory
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.model_runner import kv_block_bytes

logger = logging.getLogger(__name__)


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> int:
    """The cache's blocks: `num_blocks`, else what `kv_cache_bytes` holds of this rank's KV heads
    (a rank's memory, as a GPU's is: every rank of a node computes the same count), else what
    `kv_cache_memory_fraction` leaves once weights and a step's activations are measured."""
    block_bytes = kv_block_bytes(loaded, config.block_size, config.torch_dtype)
    if config.num_blocks:
        return config.num_blocks
    if not config.sizes_kv_by_profiling:
        return max(1, (config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // block_bytes)
    facts = profile_memory(config, loaded, max_model_len, weight_bytes(loaded.model))
    num_blocks = kv_cache_blocks(config.kv_cache_memory_fraction, facts, block_bytes)
    logger.info("KV cache from --kv-cache-memory-fraction %s: %d MiB available, %d MiB held (weights %d MiB), "
                "activations %d MiB", config.kv_cache_memory_fraction, facts.available_bytes >> 20,
                facts.held_bytes >> 20, facts.weight_bytes >> 20, facts.activation_bytes >> 20)
    return num_blocks


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tied tensor once."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
