"""Engine configuration: every size and limit of one engine, with its default in one place.

`EngineConfig` is a frozen value validated at construction. Its fields are the engine's
flags on every node kind (pdserve/common/config_flags.py derives them from the metadata here) and
the keyword arguments of `LLM`. It never imports torch, except to ask whether CUDA is there
when `--device cuda` is given (pdserve/engine/device.py): a node's front builds it, and only the
engine core, on the machine that computes, turns `dtype="auto"` and an unset device into real
ones (`resolved()`, pdserve/engine/dtype_choice.py, pdserve/engine/device.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

AUTO_DTYPE = "auto"
DTYPE_NAMES = (AUTO_DTYPE, "bfloat16", "float32")
MODEL_IMPLS = ("auto", "native", "transformers")
ATTENTION_BACKENDS = ("fast", "reference")
CHUNK_SCHEDULES = ("fixed", "staged", "target-step")
PREEMPTION_MODES = ("auto", "swap", "recompute")  # pdserve/engine/preemption.py
DEVICES = ("cpu", "cuda")  # pdserve/engine/device.py
# Both pools of a cluster and the router must agree on it (KV layout, prefix hashing).
DEFAULT_BLOCK_SIZE = 16
# The KV cache's memory when nothing sizes it (--num-blocks, --kv-cache-bytes, --kv-cache-memory-fraction).
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={"help": "model directory (a transformers checkpoint)"})
    dtype: str = field(default=AUTO_DTYPE, metadata={
        "choices": DTYPE_NAMES,
        "help": "auto: bfloat16 where the machine computes it natively (CUDA, AMX, AVX512_BF16), else float32"})
    device: str | None = field(default=None, metadata={
        "choices": DEVICES,
        "help": "where the model, the KV cache and every step's tensors live (default: cuda when torch sees a "
                "CUDA device and the other flags can run there, else cpu)"})
    model_impl: str = field(default="auto", metadata={
        "choices": MODEL_IMPLS,
        "help": "auto: the native forward for llama/mistral/qwen2/qwen3, transformers otherwise"})
    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata={"help": "tokens per KV block"})
    # KV capacity, the most explicit first: a block count, a byte count, a share of the memory.
    num_blocks: int | None = field(default=None, metadata={"help": "KV blocks (default: from --kv-cache-bytes)"})
    kv_cache_bytes: int | None = field(default=None, metadata={
        "help": "KV cache memory, when --num-blocks is not given (default: 1 GiB, or from "
                "--kv-cache-memory-fraction)"})
    kv_cache_memory_fraction: float | None = field(default=None, metadata={
        "help": "size the KV cache at start: this share of the memory the process can have (what it holds "
                "+ what is available, cgroup limits included), minus the weights and the peak activations "
                "of the largest step, measured; --num-blocks and --kv-cache-bytes win over it"})
    max_num_batched_tokens: int = field(default=512, metadata={
        "help": "token budget of one step; a prefill chunk is at most this long"})
    max_num_seqs: int = field(default=64, metadata={"help": "requests in one step"})
    chunk_schedule: str = field(default="fixed", metadata={
        "choices": CHUNK_SCHEDULES,
        "help": "fixed: every step may spend --max-num-batched-tokens; staged: Sarathi-Serve's schedule, the "
                "budget steps down from --high-chunk-size to --low-chunk-size as a long prompt advances; "
                "target-step: the budget a step-time model profiled at start fits in --target-step-ms"})
    high_chunk_size: int | None = field(default=None, metadata={
        "help": "staged: the first stage's step budget, a multiple of 32 (default: --max-num-batched-tokens)"})
    low_chunk_size: int = field(default=128, metadata={"help": "staged: the last stage's step budget, a multiple of 32"})
    chunk_schedule_stages: int = field(default=4, metadata={"help": "staged: stages from high to low"})
    chunk_schedule_max_tokens: int = field(default=4096, metadata={
        "help": "staged: prompt tokens over which the stages are spread (one stage every max-tokens / stages)"})
    target_step_ms: float = field(default=100.0, metadata={
        "help": "target-step: the modelled step time each step's token budget is chosen to hold"})
    watermark: float = field(default=0.01, metadata={
        "help": "share of the KV blocks a new prompt must leave free when admitted while others run, so "
                "admitting it does not force a preemption at once (vLLM's --watermark)"})
    delay_factor: float = field(default=0.0, metadata={
        "help": "while requests run, hold new prompts until the earliest has waited this many times the "
                "latency of the last prompt step, to batch them (vLLM v0's --delay-factor); 0: off"})
    preemption_mode: str = field(default="auto", metadata={
        "choices": PREEMPTION_MODES,
        "help": "what a preempted request gives up: recompute: its KV (computed again later); swap: only its "
                "device blocks, its KV copied to the swap space and back (recomputed, with a warning, when the "
                "swap space is full); auto: swap when the swap space has room, else recompute"})
    swap_space_bytes: int = field(default=0, metadata={
        "help": "host memory for the KV of swapped-out requests (per rank; mapped as it fills); 0: none, so "
                "--preemption-mode auto recomputes"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest sequence (prompt + generated); default: the model's own limit"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV blocks of shared prompt prefixes"})
    attention_backend: str = field(default="fast", metadata={
        "choices": ATTENTION_BACKENDS, "help": "fast: the C++ paged kernel; reference: torch SDPA per request"})
    num_threads: int | None = field(default=None, metadata={
        "aliases": ("--threads",), "help": "torch threads (default: torch's own choice)"})
    seed: int = field(default=0, metadata={"help": "seeds the per-request seeds drawn for requests that bring none"})
    tensor_parallel_size: int = field(default=1, metadata={
        "aliases": ("--tp",),
        "help": "ranks one node runs the model on (processes, each on its share of --cpus), each with its "
                "slice of the heads and MLP; at most the model's KV heads, or a multiple of them (native path)"})

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPE_NAMES, "dtype", f"must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        self._check_device()
        _require(self.model_impl in MODEL_IMPLS, "model_impl", f"must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", f"must be >= 1, got {self.num_blocks}")
        _require(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes",
                 f"must be > 0, got {self.kv_cache_bytes}")
        self._check_memory_fraction()
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"must be >= max_num_seqs ({self.max_num_seqs}) so every running decode fits a step, "
            f"got {self.max_num_batched_tokens}",
        )
        _require(self.chunk_schedule in CHUNK_SCHEDULES, "chunk_schedule",
                 f"must be one of {CHUNK_SCHEDULES}, got {self.chunk_schedule!r}")
        self._check_staged()
        _require(self.target_step_ms > 0, "target_step_ms", f"must be > 0, got {self.target_step_ms}")
        _require(0 <= self.watermark < 1, "watermark", f"must be in [0, 1), got {self.watermark}")
        _require(self.delay_factor >= 0, "delay_factor", f"must be >= 0, got {self.delay_factor}")
        _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
                 f"must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        _require(self.swap_space_bytes >= 0, "swap_space_bytes", f"must be >= 0, got {self.swap_space_bytes}")
        _require(self.preemption_mode != "swap" or self.swap_space_bytes > 0, "swap_space_bytes",
                 "must be > 0 with --preemption-mode swap (the swap space holds the swapped-out KV)")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 f"must be >= 2, got {self.max_model_len}")
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads",
                 f"must be >= 1, got {self.num_threads}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}")

    @property
    def staged_high_chunk_size(self) -> int:
        return self.high_chunk_size or self.max_num_batched_tokens

    @property
    def sizes_kv_by_profiling(self) -> bool:
        """Does the engine measure memory to size its KV cache (no explicit count given)?"""
        return self.kv_cache_memory_fraction is not None and self.num_blocks is None and self.kv_cache_bytes is None

    def _check_device(self) -> None:
        _require(self.device is None or self.device in DEVICES, "device",
                 f"must be one of {DEVICES}, got {self.device!r}")
        if self.device != "cuda":
            return
        from pdserve.engine.device import cuda_refusal  # torch: only when CUDA is asked for

        reason = cuda_refusal(self)
        _require(reason is None, "device", f"cuda (--device cuda) {reason}")

    def _check_memory_fraction(self) -> None:
        fraction = self.kv_cache_memory_fraction
        _require(fraction is None or 0 < fraction <= 1, "kv_cache_memory_fraction", f"must be in (0, 1], got {fraction}")
        # Every rank would measure the one machine's memory as its own and count the others'
        # weights as held by nobody: a rank's share is not measured yet, so say so.
        _require(not (self.sizes_kv_by_profiling and self.tensor_parallel_size > 1), "kv_cache_memory_fraction",
                 "is not supported with tensor_parallel_size > 1 (the ranks share the machine's memory): "
                 "set --num-blocks or --kv-cache-bytes per rank")

    def _check_staged(self) -> None:
        """Sarathi-Serve's own checks on its schedule's sizes, and the step budget they live in."""
        high, low = self.staged_high_chunk_size, self.low_chunk_size
        _require(self.chunk_schedule_stages >= 1, "chunk_schedule_stages", f"must be >= 1, got {self.chunk_schedule_stages}")
        _require(self.chunk_schedule_max_tokens >= 1, "chunk_schedule_max_tokens",
                 f"must be >= 1, got {self.chunk_schedule_max_tokens}")
        if self.chunk_schedule != "staged":
            return
        _require(low >= 32 and low % 32 == 0, "low_chunk_size", f"must be a positive multiple of 32, got {low}")
        _require(high % 32 == 0 and low <= high <= self.max_num_batched_tokens, "high_chunk_size",
                 f"must be a multiple of 32 in [low_chunk_size ({low}), max_num_batched_tokens "
                 f"({self.max_num_batched_tokens})], got {high}")

    def resolved(self) -> EngineConfig:
        """This config with `dtype="auto"` and an unset device replaced by this machine's choice
        (logged once)."""
        if self.dtype != AUTO_DTYPE and self.device is not None:
            return self
        from pdserve.engine.device import default_device  # torch: only where the engine runs
        from pdserve.engine.dtype_choice import resolve_dtype

        device = self.device or default_device(self)
        return replace(self, device=device, dtype=resolve_dtype(self.dtype, device))

    @property
    def torch_device(self):
        """The torch device of a resolved config: every tensor the engine makes lives there."""
        import torch

        _require(self.device is not None, "device", "is still unset: call resolved() first")
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        """The torch dtype of a resolved config."""
        import torch

        _require(self.dtype != AUTO_DTYPE, "dtype", "is still 'auto': call resolved() first")
        return getattr(torch, self.dtype)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
