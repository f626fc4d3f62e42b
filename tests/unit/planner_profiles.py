"""Synthetic profiles for the planner's tests: step times set by hand, nothing measured."""

from __future__ import annotations

from pdserve.planner.profile import (
    ClientCost, FrontCost, NodeSetup, Profile, RouterCost, TransferCost, stack_keys,
)
from pdserve.planner.step_cost import StepCost

BLOCK_BYTES = 1024


def synthetic_profile(base_s: float = 0.0, per_token_s: float = 0.0, per_seq_s: float = 0.0,
                      per_attended_s: float = 0.0, per_decode_context_s: float = 0.0, threads: int = 1,
                      transfer: TransferCost = TransferCost(0.0, 0.0, "none")) -> Profile:
    return Profile(model="synthetic", model_hash="0", machine={"cpu": "none", "flags": [], "cores": 2},
                   setup=NodeSetup(threads, "float32", 16),
                   step=StepCost(base_s, per_token_s, per_seq_s, per_attended_s, per_decode_context_s),
                   fit_error={}, samples=(), kv_block_bytes=BLOCK_BYTES, transfer=transfer, max_model_len=4096,
                   vocab_size=1000)


def store_synthetic_costs(cache, model_digest: str, machine: dict, stream_interval: int = 1,
                          router_per_token_s: float = 1e-5) -> None:
    """Small serving-stack costs in `cache` (the router's per token as given), at the router's
    `stream_interval`, so that a plan measures none."""
    router_at, front_at, client_at = stack_keys(model_digest, machine, stream_interval)
    cache.store(router_at, RouterCost(1e-4, router_per_token_s, "synthetic"))
    cache.store(front_at, FrontCost(1e-4, 1e-5, "synthetic"))
    cache.store(client_at, ClientCost(1e-4, 1e-5, "synthetic"))
