"""The device an engine computes on: the one place that decides it and says what it cannot do.

`--device` (EngineConfig.device) names it; unset, it is cuda when torch sees a CUDA device and
the rest of the config can run there, cpu otherwise (`default_device`, applied by
`EngineConfig.resolved`). Everything the engine
makes lives there: the weights (pdserve/engine/model_loader.py), the KV cache (pdserve/engine/model_runner.py's
`zeroed_cache`), every step's input ids, positions, slot mapping and block tables (`to_device`)
and the sampler's tensors, which follow the logits. The host swap space stays on the host.

The C++ kernels (pdserve/kernels/) are CPU-only; on cuda each kernel's torch formulation runs
instead (each kernel module picks it from the tensors' device). What has no device path yet is
refused here, by name, before anything loads (`cuda_refusal`).

It never allocates KV blocks or decides what runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig

log = logging.getLogger(__name__)


def default_device(config: EngineConfig) -> str:
    """cuda where torch sees a CUDA device and nothing else in `config` rules it out, else cpu."""
    reason = cuda_refusal(config)
    if reason is None:
        return "cuda"
    if torch.cuda.is_available():
        log.info("device: cpu, though torch sees a CUDA device: cuda %s", reason)
    return "cpu"


def cuda_refusal(config: EngineConfig) -> str | None:
    """Why `config` cannot run on cuda here, or None when it can (whatever its own device says)."""
    if not torch.cuda.is_available():
        return "was asked for, but torch sees no CUDA device on this machine (torch.cuda.is_available() is false)"
    if config.tensor_parallel_size > 1:
        # The ranks hand each other their steps and partial sums as host tensors over gloo.
        return "does not run with tensor_parallel_size > 1 yet (its ranks exchange host tensors over gloo)"
    if config.kv_cache_memory_fraction is not None and config.num_blocks is None and config.kv_cache_bytes is None:
        # pdserve/engine/memory_profile.py measures the process's host memory, not the device's.
        return "does not size the KV cache by --kv-cache-memory-fraction yet: set --num-blocks or --kv-cache-bytes"
    return None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built step tensor on the engine's device: one copy, not waited on when the host
    memory allows it (the forward queued after it on the same stream reads it in order)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)
