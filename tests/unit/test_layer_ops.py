"""The native model's layer ops: the C++ kernels compute what their torch formulations compute
(transformers' Llama math), in float32 and bfloat16, for the GEMV rows and beyond."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import LayerOps, cpu_ext
from pdserve.kernels.layer_ops import GEMV_MAX_ROWS, rms_norm_torch

DTYPES = [torch.float32, torch.bfloat16]
# float32 agrees to summation order; bfloat16 to one rounding of the output.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def cpp() -> LayerOps:
    ops = cpu_ext.ops()
    if ops is None:
        pytest.skip("C++ CPU kernels unavailable")
    return LayerOps(ops, gemv=True)


TORCH = LayerOps(None, gemv=False)


def rand(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("dtype", "w_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_gemv_matches_torch_linear_with_bias(cpp, dtype, w_dtype, rows):
    x, w, b = rand(rows, 200, dtype=dtype), rand(70, 200, dtype=w_dtype, seed=1), rand(70, dtype=dtype, seed=2)
    got = cpp.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 70)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_gemv_applies_silu_times_up_first(cpp, dtype):
    gate_up, w = rand(2, 2 * 96, dtype=dtype), rand(40, 96, dtype=torch.bfloat16, seed=1)
    expected = TORCH.gated_linear(gate_up, w)
    torch.testing.assert_close(cpp.gated_linear(gate_up, w).float(), expected.float(), **TOLERANCE[dtype])


def test_gemv_serves_only_few_rows():
    cpu, most = torch.device("cpu"), GEMV_MAX_ROWS[torch.bfloat16]
    assert LayerOps.for_step(torch.bfloat16, most, cpu).gemv == cpu_ext.available()
    assert not LayerOps.for_step(torch.bfloat16, most + 1, cpu).gemv


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_and_normalises_it(cpp, dtype):
    x, weight = rand(5, 64, dtype=dtype), rand(64, dtype=dtype, seed=1)
    residual_cpp, residual_torch = rand(5, 64, dtype=dtype, seed=2), rand(5, 64, dtype=dtype, seed=2)
    out = cpp.add_rms_norm(x, residual_cpp, weight, 1e-6)
    expected = TORCH.add_rms_norm(x, residual_torch, weight, 1e-6)
    torch.testing.assert_close(residual_cpp, residual_torch)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(cpp.rms_norm(x, weight, 1e-6).float(), rms_norm_torch(x, weight, 1e-6).float(),
                               **TOLERANCE[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_norms", [False, True])
def test_rope_write_kv_rotates_q_and_k_and_stores_k_and_v(cpp, dtype, head_norms):
    num_tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 16, 4
    qkv = rand(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.arange(num_tokens)[:, None] * torch.rand(head_dim // 2, generator=torch.Generator().manual_seed(3))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms = (rand(head_dim, dtype=dtype, seed=4), rand(head_dim, dtype=dtype, seed=5)) if head_norms else None
    slots = torch.tensor([9, 2, 0, 15, 4, 7])
    caches = {impl: [torch.zeros(5, kv_heads, block_size, head_dim, dtype=dtype) for _ in range(2)] for impl in "ct"}
    q_cpp = cpp.rope_write_kv(qkv.clone(), cos, sin, norms, 1e-6, *caches["c"], slots, heads)
    q_torch = TORCH.rope_write_kv(qkv.clone(), cos, sin, norms, 1e-6, *caches["t"], slots, heads)
    assert q_cpp.shape == (num_tokens, heads, head_dim)
    torch.testing.assert_close(q_cpp.float(), q_torch.float(), **TOLERANCE[dtype])
    for got, expected in zip(caches["c"], caches["t"]):
        torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
    # V is stored as given, exactly.
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(num_tokens, kv_heads, head_dim)
    stored_v = caches["c"][1].view(-1, kv_heads, block_size, head_dim)[slots // block_size, :, slots % block_size]
    assert torch.equal(stored_v, v)
