"""Engine configuration: every size and limit of one engine, with its default in one place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.dtype_choice import DTYPE_NAMES, resolve_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_IMPLS = ("auto", "native", "transformers")
ATTENTION_BACKENDS = ("fast", "reference")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto" becomes the machine's fastest native dtype at construction (see dtype_choice).
    dtype: str = "auto"
    # "auto": the native forward for the Llama family, transformers for every other model.
    model_impl: str = "auto"
    block_size: int = 16
    # KV capacity: an explicit block count wins over the memory budget.
    num_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    # Token budget of one step; a prefill chunk is at most this long.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    # None: the model's own limit.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "fast"
    # None: leave torch's thread count alone.
    num_threads: int | None = None
    # Seeds the per-request seeds drawn for requests that bring none.
    seed: int = 0

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        # Resolved once, here, so every reader (KV cache, fingerprint, logs) sees the same dtype.
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        _require(self.model_impl in MODEL_IMPLS, "model_impl", f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1, got {self.num_blocks}")
        _require(self.kv_cache_bytes > 0, "kv_cache_bytes", f"must be > 0, got {self.kv_cache_bytes}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be >= max_num_seqs ({self.max_num_seqs}) so every running decode fits a step, "
            f"got {self.max_num_batched_tokens}",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
