"""The per-layer ops of the native Llama-family model, chosen once per step.

Owns the math of: linear layers (x @ weight.T + bias; also with the SiLU-gated input of the
MLP's down projection), RMSNorm (optionally with the residual
add before it) and RoPE with the KV-cache write, in two formulations: the C++ kernels
(pdserve/kernels/csrc/layer_ops.cpp and gemv.cpp, see cpu_ext) when built, else torch ops computing
the same values the way transformers' Llama modules do. `LayerOps.for_step` resolves which
formulation and which GEMM path serve a step once, so the ~10 ops a layer runs cost one call
each and no lookups. It never decides which layers call them; pdserve/engine/models does.

Linear layers: decode steps have few rows and are bound by reading the weights, so they go
through the GEMV kernel, which streams bf16 or float32 weights at close to memory bandwidth
(about 2x torch's bf16 GEMV and 3x its float32 GEMV; pdserve/bench/kernels.py --linear measures it). Many rows
(prefill) are bound by arithmetic, where torch's GEMM wins. Weights may be bf16 under float32
activations ("bf16 storage" on CPUs without native bf16): the kernel converts them in registers,
and large batches multiply a float32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext
from pdserve.kernels.cache_write import write_kv_cache_torch

CPP_DTYPES = (torch.float32, torch.bfloat16)
# Most rows the GEMV kernel takes, by activation dtype (the crossover measured by
# pdserve/bench/kernels.py --linear): against torch's native bf16 GEMM it wins only for the fewest rows,
# against an fp32 GEMM on upcast weights far longer.
GEMV_MAX_ROWS = {torch.bfloat16: 8, torch.float32: 16}


@dataclass(frozen=True, slots=True)
class LayerOps:
    cpp: cpu_ext.CpuOps | None  # None: the torch formulation
    gemv: bool  # linear layers through the GEMV kernel (few rows)

    @classmethod
    def for_step(cls, dtype: torch.dtype, num_rows: int, device: torch.device) -> LayerOps:
        cpp = cpu_ext.ops() if device.type == "cpu" and dtype in CPP_DTYPES else None
        return cls(cpp, cpp is not None and num_rows <= GEMV_MAX_ROWS.get(dtype, 0))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ weight [out, in].T (+ bias [out]) -> [rows, out] in x's dtype."""
        if self.gemv:
            return self.cpp.linear_gemv(x.contiguous(), weight, bias, False)
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.linear(x, weight, bias)

    def gated_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """(silu(gate) * up) @ weight.T for gate_up = [gate | up] ([rows, 2 * in]): the MLP's
        down projection, with the activation inside the GEMV kernel when it serves the step."""
        if self.gemv:
            return self.cpp.linear_gemv(gate_up, weight, None, True)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * RMSNorm(x) over the last dim; x [rows, dim]."""
        if self.cpp is None:
            return rms_norm_torch(x, weight, eps)
        return self.cpp.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then weight * RMSNorm(residual); all [rows, dim] contiguous."""
        if self.cpp is None:
            residual.add_(x)
            return rms_norm_torch(residual, weight, eps)
        return self.cpp.add_rms_norm(x, residual, weight, eps)

    def rope_write_kv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim] float32
        sin: torch.Tensor,
        head_norms: tuple[torch.Tensor, torch.Tensor] | None,  # Qwen3's (q_norm, k_norm) weights
        eps: float,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        num_heads: int,
    ) -> torch.Tensor:  # q: [num_tokens, num_heads, head_dim]
        """Normalise (optionally) and rotate q and k, store k and v at their cache slots, return q.
        qkv is scratch: its q and k parts are overwritten."""
        if self.cpp is None:
            return _rope_write_kv_torch(qkv, cos, sin, head_norms, eps, k_cache, v_cache, slot_mapping, num_heads)
        q_norm, k_norm = head_norms if head_norms is not None else (None, None)
        return self.cpp.rope_write_kv(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping, num_heads)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float32 statistics, normalised value rounded to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim]; cos/sin [num_tokens, head_dim] float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _rope_write_kv_torch(qkv, cos, sin, head_norms, eps, k_cache, v_cache, slot_mapping, num_heads) -> torch.Tensor:
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if head_norms is not None:
        q = rms_norm_torch(q, head_norms[0], eps)
        k = rms_norm_torch(k, head_norms[1], eps)
    q, k = apply_rope_torch(q, cos, sin), apply_rope_torch(k, cos, sin)
    write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)
    return q.contiguous()
