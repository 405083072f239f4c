"""Triton RoPE, KV-store and the two fused vs kernels.reference on poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import SERVED_SHAPES, strided

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rope_cache(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_pos, D]: cos | sin halves, the layout kernels.reference.apply_rope documents."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


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


def _rope_inputs(backend, t=6, hq=4, hkv=2, d=64, max_pos=64):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(t, hq, d, generator=g).to(backend.device)
    k = torch.randn(t, hkv, d, generator=g).to(backend.device)
    return q, k, rope_cache(max_pos, d).to(backend.device)


def test_rope_reads_strided_positions_by_value(backend, assert_close_rel):
    fused = backend.module("fused")
    q, k, cache = _rope_inputs(backend)
    positions = strided(torch.tensor([5, 1, 60, 2, 0, 33]).to(backend.device))
    assert not positions.is_contiguous()
    q_ref, k_ref = reference.apply_rope(q.cpu(), k.cpu(), positions.cpu(), cache.cpu())
    q_out, k_out = fused.apply_rope(q, k, positions, cache)
    assert_close_rel(q_out.cpu(), q_ref)
    assert_close_rel(k_out.cpu(), k_ref)


@pytest.mark.parametrize(
    ("change", "match"),
    [("k_head_dim", "k has shape"), ("k_tokens", "k has shape"), ("positions_length", "positions must have 6"),
     ("q_out_shape", "q_out has shape"), ("k_out_shape", "k_out has shape"), ("cache_width", "cos_sin_cache")],
)  # fmt: skip
def test_rope_rejects_inconsistent_shapes(backend, change, match):
    fused = backend.module("fused")
    q, k, cache = _rope_inputs(backend)
    positions = torch.arange(6, device=backend.device)
    kw = {}
    if change == "k_head_dim":  # the kernel would rotate k with q's head_dim, reading past k's rows
        k = k[..., :32]
    elif change == "k_tokens":
        k = k[:4]
    elif change == "positions_length":
        positions = positions[:4]
    elif change == "q_out_shape":
        kw["q_out"] = torch.empty(6, 2, 64, device=backend.device)
    elif change == "k_out_shape":
        kw["k_out"] = torch.empty(2, 2, 64, device=backend.device)
    elif change == "cache_width":
        cache = rope_cache(64, 32).to(backend.device)
    with pytest.raises(ValueError, match=match):
        fused.apply_rope(q, k, positions, cache, **kw)


@pytest.mark.parametrize("positions", [[5, 64, 1000], [3, -1]])
def test_rope_rejects_positions_outside_the_cache_on_cpu(backend, positions):
    """The kernel would rotate by whatever memory lies past the cache (the reference raises an
    IndexError). Checking needs the positions' values, so it runs only on CPU tensors; on CUDA it
    is the caller's contract (module docstring)."""
    if backend.is_cuda:
        pytest.skip("on CUDA positions in range are a documented caller contract (checking would sync)")
    fused = backend.module("fused")
    q, k, cache = _rope_inputs(backend, t=len(positions))
    with pytest.raises(ValueError, match="outside cos_sin_cache's 64 rows"):
        fused.apply_rope(q, k, torch.tensor(positions), cache)


def test_store_kv_reads_strided_slots_by_value(backend):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(7)
    k_cache = torch.full((50, 2, 64), float("nan"), device=backend.device)
    v_cache = torch.full((50, 2, 64), float("nan"), device=backend.device)
    k, v = (torch.randn(4, 2, 64, generator=g).to(backend.device) for _ in range(2))
    slots = torch.tensor([3, 9, 27, 44])
    strided_slots = strided(slots.to(backend.device))
    assert not strided_slots.is_contiguous()
    fused.store_kv(k_cache, v_cache, strided_slots, k, v)
    written = k_cache.cpu().isfinite().all(-1).all(-1).nonzero().flatten()
    assert written.tolist() == slots.tolist()
    assert torch.equal(k_cache[slots].cpu(), k.cpu()) and torch.equal(v_cache[slots].cpu(), v.cpu())


@pytest.mark.parametrize(
    ("change", "match"),
    [("pool_head_dim", "k_cache has shape"), ("v_pool_hkv", "v_cache has shape"), ("v_shape", "v has shape"),
     ("slots_length", "slots must have 4"), ("v_pool_slots", "v_cache has 4 slots, k_cache 50")],
)  # fmt: skip
def test_store_kv_rejects_inconsistent_shapes(backend, change, match):
    fused = backend.module("fused")
    k_cache = torch.zeros(50, 2, 64, device=backend.device)
    v_cache = torch.zeros(50, 2, 64, device=backend.device)
    k = v = torch.randn(4, 2, 64, device=backend.device)
    slots = torch.tensor([3, 9, 27, 44], device=backend.device)
    if change == "pool_head_dim":
        k_cache = k_cache[..., :32]
    elif change == "v_pool_hkv":
        v_cache = v_cache[:, :1]
    elif change == "v_pool_slots":  # a slot past V's rows was written out of bounds (heap corruption)
        v_cache = v_cache[:4]
    elif change == "v_shape":
        v = v[:, :1]
    elif change == "slots_length":
        slots = slots[:3]
    with pytest.raises(ValueError, match=match):
        fused.store_kv(k_cache, v_cache, slots, k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# and the served models' other shapes (head dims 96 and 256, query groups of 7 and 5)
@pytest.mark.parametrize(
    ("head_dim", "hq", "hkv"), [(64, 4, 4), (128, 8, 2), *(shape[1:] for shape in SERVED_SHAPES)]
)
def test_rope_store_kv_rotates_and_stores_exactly_the_given_slots(backend, assert_close_rel, dtype, head_dim,
                                                                   hq, hkv):  # fmt: skip
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(7)
    t, pool = 6, 40
    qkv = torch.randn(t, hq + 2 * hkv, head_dim, generator=g).to(backend.device, dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]  # strided views of one projection
    positions = strided(torch.tensor([0, 9, 3, 63, 1, 17]).to(backend.device))
    slots = torch.tensor([7, 0, 39, 12, 13, 21]).to(backend.device)
    cache = rope_cache(64, head_dim).to(backend.device)
    k_cache = torch.full((pool, hkv, head_dim), float("nan"), dtype=dtype, device=backend.device)
    v_cache = torch.full_like(k_cache, float("nan"))
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    got = fused.rope_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots, q_out=q_out, k_out=k_out)
    assert got[0] is q_out and got[1] is k_out
    k_ref, v_ref = torch.full_like(k_cache.cpu(), float("nan")), torch.full_like(v_cache.cpu(), float("nan"))
    q_want, k_want = reference.rope_store_kv(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), cache.cpu(), k_ref, v_ref,
                                             slots.cpu())  # fmt: skip
    assert_close_rel(q_out.cpu(), q_want)
    assert_close_rel(k_out.cpu(), k_want)
    written = torch.zeros(pool, dtype=torch.bool)
    written[slots.cpu()] = True
    assert torch.equal(k_cache.cpu()[written], k_out.cpu()[torch.argsort(slots.cpu())])  # the rotated k
    assert torch.equal(v_cache.cpu()[written], v.cpu()[torch.argsort(slots.cpu())])  # v as given
    assert_close_rel(k_cache.cpu()[written], k_ref[written])
    assert k_cache.cpu()[~written].isnan().all() and v_cache.cpu()[~written].isnan().all()  # no other slot
