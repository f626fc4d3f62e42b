"""`dtype="auto"`: the compute dtype this machine runs fastest, decided from what it really has.

Owns the rule and its evidence. bfloat16 only where the hardware computes it natively: CUDA
devices, and CPUs with AMX (amx_bf16) or AVX512_BF16, where torch's bf16 GEMMs run 2-3x faster
than float32. Everywhere else (AVX2-only, AVX-512 without BF16, Arm without bf16 dot products)
torch's bf16 GEMMs are emulated and 5-50x slower than float32, so auto means float32. The
choice is logged with the CPU capability and flags it was made from.

It never loads a model or reads a config file; callers pass the name they were given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.config import AUTO_DTYPE, DTYPE_NAMES
from pdserve.kernels.cpu_ext import cpu_flags

log = logging.getLogger(__name__)

# /proc/cpuinfo flags (x86) or Features (Arm) that mean native bf16 matrix arithmetic.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: str  # "bfloat16" or "float32"
    reason: str  # the evidence, for the log and the bench report


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """The concrete dtype name for `name` ("auto" resolved for this machine's `device`, others as given)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {name!r}")
    if name != AUTO_DTYPE:
        return name
    choice = auto_dtype(device)
    log.info("dtype auto -> %s (%s)", choice.dtype, choice.reason)
    return choice.dtype


def auto_dtype(device: str = "cpu") -> DtypeChoice:
    if device == "cuda":
        return DtypeChoice("bfloat16", f"CUDA device {torch.cuda.get_device_name()}")
    capability = torch.backends.cpu.get_cpu_capability()
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags())
    if native:
        return DtypeChoice("bfloat16", f"CPU capability {capability}, native bf16: {', '.join(native)}")
    return DtypeChoice("float32", f"CPU capability {capability}, no native bf16 (bf16 GEMMs would be emulated)")

