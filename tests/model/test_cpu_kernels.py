"""The fused CPU kernels against the torch layers they replace (fp32: equal to rounding; bf16: close)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.layers.basic import RMSNorm, RotaryEmbedding, SiluAndMul


def tol(dtype):
    return {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [7, 64, 1536])
def test_silu_and_mul(kernels, dtype, inter):
    x = (torch.randn(13, 2 * inter, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    act = SiluAndMul()
    expected = act(x)
    act.kernels = kernels
    torch.testing.assert_close(act(x), expected, **tol(dtype))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(expected, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_plain_and_fused_residual(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    residual = torch.randn(9, 96, generator=gen).to(dtype)

    expected = norm(x)
    expected_fused, expected_residual = norm(x, residual.clone())
    norm.kernels = kernels
    torch.testing.assert_close(norm(x), expected, **tol(dtype))
    stream = residual.clone()
    out, new_residual = norm(x, stream)
    assert new_residual.data_ptr() == stream.data_ptr()  # updated in place
    torch.testing.assert_close(new_residual, expected_residual, **tol(dtype))
    torch.testing.assert_close(out, expected_fused, **tol(dtype))
    torch.testing.assert_close(expected_residual, x + residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_inplace_matches_rotate_half(kernels, dtype):
    from transformers import LlamaConfig

    num_heads, num_kv_heads, head_dim = 6, 2, 16
    rotary = RotaryEmbedding(LlamaConfig(rope_theta=10000.0), head_dim, 128, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    tokens = 11
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 128, (tokens,), generator=gen)
    q = qkv[:, :num_heads * head_dim].reshape(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(tokens, num_kv_heads, head_dim)
    expected_q, expected_k = rotary(positions, q, k)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()

    assert not rotary.apply_inplace(positions, qkv, num_heads + num_kv_heads, head_dim)  # no kernels: no-op
    rotary.kernels = kernels
    assert rotary.apply_inplace(positions, qkv, num_heads + num_kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, :num_heads * head_dim].reshape(tokens, num_heads, head_dim), expected_q,
                               **tol(dtype))
    torch.testing.assert_close(
        qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(tokens, num_kv_heads, head_dim),
        expected_k, **tol(dtype))
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # V untouched
