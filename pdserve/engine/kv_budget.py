"""How many KV blocks a memory budget holds: pure arithmetic, measured inputs given.

`--kv-cache-memory-fraction F` works as vLLM's `--gpu-memory-utilization` does: the engine may
use F of the memory this process can have, and the KV cache gets what is left of that after
what the process already holds (the weights it loaded, the runtime) and the peak activations of
the largest step it will schedule. On a CPU "the memory this process can have" is what it holds
now plus what is still available to it (pdserve/engine/memory_profile.py measures both), since the OS
counts the loaded weights as used, not available.

Must never: measure anything (pdserve/engine/memory_profile.py does) or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.refusal import Refused

MiB = 1 << 20


class KVBudgetTooSmall(Refused, ValueError):
    """The fraction leaves no room for a single KV block: a node refuses to start (exit 2) with
    this one line, which names the flag; `LLM(...)` raises it."""


@dataclass(frozen=True, slots=True)
class MemoryFacts:
    available_bytes: int  # still available to the process (meminfo, its cgroup's limit)
    held_bytes: int  # resident in the process now: weights, runtime
    weight_bytes: int  # of held_bytes, the model's parameters (for the log line)
    activation_bytes: int  # peak growth over a dummy step of the largest batch


def kv_cache_blocks(fraction: float, facts: MemoryFacts, block_bytes: int) -> int:
    """Blocks of `block_bytes` in F × (held + available) − held − activations."""
    budget = int(fraction * (facts.available_bytes + facts.held_bytes))
    kv_bytes = budget - facts.held_bytes - facts.activation_bytes
    if kv_bytes < block_bytes:
        raise KVBudgetTooSmall(
            f"--kv-cache-memory-fraction {fraction}: {fraction} of {_mib(facts.available_bytes + facts.held_bytes)} "
            f"is {_mib(budget)}, which does not cover what this engine holds ({_mib(facts.held_bytes)}, of which "
            f"weights {_mib(facts.weight_bytes)}) plus a step's activations ({_mib(facts.activation_bytes)}) plus "
            f"one KV block ({_mib(block_bytes)}): raise the fraction, or set --num-blocks or --kv-cache-bytes")
    return kv_bytes // block_bytes


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many requests of the model's full length the cache holds at once."""
    blocks_per_request = -(-max_model_len // block_size)
    return num_blocks / blocks_per_request


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MiB:.0f} MiB"
