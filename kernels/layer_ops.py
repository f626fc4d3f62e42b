"""Fused per-layer ops of the native Llama-family model: RMSNorm (with the residual add) and
RoPE with the KV-cache write.

Owns the math of these ops and their two formulations: the C++ kernels (kernels/csrc/
layer_ops.cpp, see cpu_ext) when built and the inputs are float32/bfloat16 on the CPU, else
torch ops computing the same values the way transformers' Llama modules do. It never decides
which layers call them; engine/models does.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext
from pdserve.kernels.cache_write import write_kv_cache_torch

CPP_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim; x [rows, dim]."""
    ops = _ops(x)
    if ops is None:
        return rms_norm_torch(x, weight, eps)
    out = torch.empty_like(x)
    ops.rms_norm(x, weight, out, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then weight * RMSNorm(residual); all [rows, dim] contiguous."""
    ops = _ops(x)
    if ops is None:
        residual.add_(x)
        return rms_norm_torch(residual, weight, eps)
    out = torch.empty_like(x)
    ops.add_rms_norm(x, residual, weight, out, eps)
    return out


def rope_write_kv(
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
    qkv is used as scratch: its q and k parts are overwritten."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[3]
    ops = _ops(qkv)
    if ops is None:
        return _rope_write_kv_torch(qkv, cos, sin, head_norms, eps, k_cache, v_cache, slot_mapping, num_heads)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    q_norm, k_norm = head_norms if head_norms is not None else (None, None)
    ops.rope_write_kv(qkv, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping, q)
    return q


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


def _ops(x: torch.Tensor) -> cpu_ext.CpuOps | None:
    if x.device.type != "cpu" or x.dtype not in CPP_DTYPES:
        return None
    return cpu_ext.ops()
