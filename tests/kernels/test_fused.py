"""Triton RMSNorm, RoPE and KV-store vs kernels.reference on poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rope_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, D]: cos | sin halves, the layout kernels.reference.apply_rope documents."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 2, 64)])  # non-power-of-two width; a [..., H] input
def test_rms_norm_matches_reference(backend, assert_close_rel, dtype, shape):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(backend.device, dtype)
    w = torch.randn(shape[-1], generator=g).to(backend.device, dtype)
    out = torch.full_like(x, float("nan"))
    fused.rms_norm(x, w, 1e-6, out=out)
    ref = reference.rms_norm(x.cpu().reshape(-1, shape[-1]), w.cpu(), 1e-6).reshape(shape)
    assert_close_rel(out.cpu(), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "hq", "hkv"), [(64, 4, 4), (128, 8, 2)])
def test_rope_matches_reference(backend, assert_close_rel, dtype, head_dim, hq, hkv):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(2)
    t = 7
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(backend.device, dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]  # strided views, as split from a fused QKV projection
    positions = torch.tensor([0, 1, 5, 300, 2, 4095, 17]).to(backend.device)
    cache = rope_cache(4096, head_dim).to(backend.device)
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    fused.apply_rope(q, k, positions, cache, q_out=q_out, k_out=k_out)
    q_ref, k_ref = reference.apply_rope(q.cpu(), k.cpu(), positions.cpu(), cache.cpu())
    assert_close_rel(q_out.cpu(), q_ref)
    assert_close_rel(k_out.cpu(), k_ref)
    assert torch.equal(q_out[0].cpu(), q[0].cpu())  # position 0 is the identity rotation


def test_rope_in_place(backend, assert_close_rel):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 64, generator=g).to(backend.device)
    k = torch.randn(4, 1, 64, generator=g).to(backend.device)
    positions = torch.tensor([3, 9, 1, 0]).to(backend.device)
    cache = rope_cache(16, 64).to(backend.device)
    q_ref, k_ref = reference.apply_rope(q.cpu(), k.cpu(), positions.cpu(), cache.cpu())
    fused.apply_rope(q, k, positions, cache, q_out=q, k_out=k)
    assert_close_rel(q.cpu(), q_ref)
    assert_close_rel(k.cpu(), k_ref)


@pytest.mark.parametrize(
    ("src_dtype", "pool_dtype"), [(torch.float16, torch.float16), (torch.float32, torch.bfloat16)]
)
def test_store_kv_writes_exactly_the_given_slots(backend, src_dtype, pool_dtype):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(4)
    pool, t, hkv, d = 40, 6, 2, 64
    k_cache = torch.full((pool, hkv, d), float("nan"), dtype=pool_dtype, device=backend.device)
    v_cache = torch.full((pool, hkv, d), float("nan"), dtype=pool_dtype, device=backend.device)
    kv = torch.randn(t, 2 * hkv, d, generator=g).to(backend.device, src_dtype)
    k, v = kv[:, :hkv], kv[:, hkv:]  # strided views
    slots = torch.tensor([7, 0, 39, 12, 13, 21]).to(backend.device)
    fused.store_kv(k_cache, v_cache, slots, k, v)
    k_ref = torch.full((pool, hkv, d), float("nan"), dtype=pool_dtype)
    v_ref = torch.full((pool, hkv, d), float("nan"), dtype=pool_dtype)
    reference.store_kv(k_ref, v_ref, slots.cpu(), k.cpu(), v.cpu())
    written = torch.zeros(pool, dtype=torch.bool)
    written[slots.cpu()] = True
    # NOTE: Triton's interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even, as
    # torch does), so a converting store is exact on CUDA and within one bf16 step when interpreted.
    exact = backend.is_cuda or src_dtype == pool_dtype
    for got, want in ((k_cache.cpu(), k_ref), (v_cache.cpu(), v_ref)):
        if exact:
            assert torch.equal(got[written], want[written])
        else:
            torch.testing.assert_close(got[written], want[written], rtol=2**-7, atol=0)
        assert got[~written].isnan().all()  # no other slot touched
