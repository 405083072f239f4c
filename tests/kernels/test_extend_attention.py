"""Triton extend attention vs kernels.reference.extend_attention on ragged, paged, GQA batches."""

from __future__ import annotations

import pytest
import torch

from kernels import reference

# (dtype, head_dim, Hq, Hkv): GQA ratios 1 / 4 / 8 spread over both head dims and all three dtypes.
CASES = [
    (torch.float32, 64, 2, 2),
    (torch.float32, 128, 8, 2),
    (torch.float16, 64, 8, 1),
    (torch.float16, 128, 4, 4),
    (torch.bfloat16, 128, 8, 1),
    (torch.bfloat16, 64, 4, 1),
]
# (prefix, new) tokens per request: empty prefix, one new token, no new tokens, tile-crossing lengths.
REQUESTS = [(0, 19), (1, 1), (7, 0), (33, 17), (16, 32)]


def make_batch(requests, hq, hkv, d, dtype, device, seed=0, index_dtype=torch.int32):
    """Random inputs; pool slots not referenced by any request hold NaN, so a stray read fails."""
    g = torch.Generator().manual_seed(seed)
    total_prefix = sum(p for p, _ in requests)
    pool = total_prefix + 23
    k_cache = torch.full((pool, hkv, d), float("nan"))
    v_cache = torch.full((pool, hkv, d), float("nan"))
    slots = torch.randperm(pool, generator=g)[:total_prefix]
    k_cache[slots] = torch.randn(total_prefix, hkv, d, generator=g)
    v_cache[slots] = torch.randn(total_prefix, hkv, d, generator=g)
    t = sum(n for _, n in requests)
    q, k_new, v_new = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    qo = torch.tensor([0] + [n for _, n in requests]).cumsum(0)
    kvp = torch.tensor([0] + [p for p, _ in requests]).cumsum(0)
    to = dict(device=device, dtype=dtype)
    ix = dict(device=device, dtype=index_dtype)
    return (q.to(**to), k_new.to(**to), v_new.to(**to), k_cache.to(**to), v_cache.to(**to),
            qo.to(**ix), kvp.to(**ix), slots.to(**ix))  # fmt: skip


def reference_on_cpu(args, sm_scale=None):
    return reference.extend_attention(*(a.cpu() for a in args), sm_scale=sm_scale)


@pytest.mark.parametrize(("dtype", "head_dim", "hq", "hkv"), CASES)
def test_extend_matches_reference_on_ragged_paged_batch(backend, assert_close_rel, dtype, head_dim, hq, hkv):
    ext = backend.module("extend_attention")
    requests = REQUESTS if not backend.is_cuda else [(p * 9, n * 9) for p, n in REQUESTS]
    args = make_batch(requests, hq, hkv, head_dim, dtype, backend.device)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any row the kernel skips fails
    ext.extend_attention(*args, out=out)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


@pytest.mark.parametrize(("block_m", "block_n"), [(32, 16), (16, 32), (64, 32), (32, 64)])
def test_extend_is_exact_for_any_tile_shape(backend, assert_close_rel, block_m, block_n):
    """Unmasked whole tiles (prefix and left of the diagonal) and masked edge tiles meet correctly
    whether query blocks are larger or smaller than key tiles (the shapes kernels.tune tries)."""
    ext = backend.module("extend_attention")
    cfg = ext.ExtendConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    # prefixes: none, under one tile, exactly tiles, tiles + a tail; new: 1 up to three query blocks
    requests = [(0, 1), (5, 70), (64, 33), (96, 64), (100, 129)]
    args = make_batch(requests, 4, 2, 64, torch.float32, backend.device, seed=block_m + block_n)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, config=cfg)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


def test_extend_honours_sm_scale_int64_indices_and_computes_its_own_grid(backend, assert_close_rel):
    ext = backend.module("extend_attention")
    args = make_batch([(5, 3), (20, 18)], 4, 2, 64, torch.float16, backend.device, index_dtype=torch.int64)
    out = ext.extend_attention(*args, sm_scale=0.3)  # max_extend_len read from qo_indptr
    assert_close_rel(out.cpu(), reference_on_cpu(args, sm_scale=0.3))


def test_extend_prefix_changes_the_output(backend):
    """Guards against a kernel that ignores the cached prefix (the reference would catch it too,
    but this states the behaviour: a request's answer depends on its cached context)."""
    ext = backend.module("extend_attention")
    with_prefix = make_batch([(24, 8)], 2, 2, 64, torch.float32, backend.device)
    no_prefix = list(with_prefix)
    no_prefix[6] = torch.zeros_like(with_prefix[6])  # kv_indptr all zero: empty prefix
    a = ext.extend_attention(*with_prefix)
    b = ext.extend_attention(*no_prefix)
    assert not torch.allclose(a, b, atol=1e-3)
    assert torch.allclose(b.cpu(), reference_on_cpu(no_prefix), atol=1e-5)


def test_extend_with_no_new_tokens_returns_empty(backend):
    ext = backend.module("extend_attention")
    args = make_batch([(4, 0), (9, 0)], 2, 1, 64, torch.float32, backend.device)
    assert ext.extend_attention(*args).shape == (0, 2, 64)
