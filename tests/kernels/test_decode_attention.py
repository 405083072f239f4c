"""Triton split-K decode attention vs kernels.reference.decode_attention on paged, GQA batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import SERVED_SHAPES, strided
from tests.support import each_value_once

CASES = [
    (torch.float32, 64, 4, 4),
    (torch.float32, 128, 8, 1),
    (torch.float16, 128, 8, 2),
    (torch.float16, 64, 8, 1),
    (torch.bfloat16, 64, 2, 2),
    (torch.bfloat16, 128, 16, 2),
    *SERVED_SHAPES,
]
KV_LENS = [1, 2, 17, 50, 33]  # tokens per request, the current token's slot included


def make_batch(kv_lens, hq, hkv, d, dtype, device, seed=0):
    """Random inputs; pool slots no request references hold NaN, so a stray read fails."""
    g = torch.Generator().manual_seed(seed)
    used = sum(kv_lens)
    pool = used + 29
    k_cache = torch.full((pool, hkv, d), float("nan"))
    v_cache = torch.full((pool, hkv, d), float("nan"))
    slots = torch.randperm(pool, generator=g)[:used]
    k_cache[slots] = torch.randn(used, hkv, d, generator=g)
    v_cache[slots] = torch.randn(used, hkv, d, generator=g)
    q = torch.randn(len(kv_lens), hq, d, generator=g)
    kvp = torch.tensor([0, *kv_lens]).cumsum(0)
    to = dict(device=device, dtype=dtype)
    ix = dict(device=device, dtype=torch.int32)
    return q.to(**to), k_cache.to(**to), v_cache.to(**to), kvp.to(**ix), slots.to(**ix)


def reference_on_cpu(args, sm_scale=None):
    return reference.decode_attention(*(a.cpu() for a in args), sm_scale=sm_scale)


# the split kernel's variants: its merge in a second kernel or fused into it, the next tile's K/V loaded
# before each tile is computed, the next tile's slots loaded before each tile's K/V are waited on, and those
# on 3-stage tiles (compiled, Triton then buffers the K/V copies twice)
VARIANTS = ("merge_kernel", "fused_merge", "prefetch", "prefetch_slots", "pipelined")


def with_variant(cfg, variant: str):
    """``cfg`` as ``variant`` (VARIANTS) runs it; prefetch as kernels.tune tries it: nothing left for
    Triton to pipeline, tiles of at most 64 tokens (128 with 4 warps spills on sm_90)."""
    if variant == "fused_merge":
        return dataclasses.replace(cfg, fused_merge=True)
    if variant == "prefetch":
        return dataclasses.replace(cfg, prefetch=True, num_stages=1, block_n=min(cfg.block_n, 64))
    if variant == "prefetch_slots":
        return dataclasses.replace(cfg, prefetch_slots=True)
    if variant == "pipelined":
        return dataclasses.replace(cfg, prefetch_slots=True, num_stages=3, block_n=min(cfg.block_n, 64))
    return cfg


def config_of(dec, args, variant: str):
    """The default configuration for ``args`` as ``variant`` runs it."""
    q = args[0]
    return with_variant(dec.default_config(q.shape[-1], q.dtype), variant)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "hq", "hkv", "num_splits", "variant"), each_value_once(CASES, [1, 4], VARIANTS)
)
def test_decode_matches_reference(backend, assert_close_rel, dtype, head_dim, hq, hkv, num_splits, variant):
    dec = backend.module("decode_attention")
    lens = KV_LENS if not backend.is_cuda else [n * 97 for n in KV_LENS]
    args = make_batch(lens, hq, hkv, head_dim, dtype, backend.device)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any head the kernel skips fails
    dec.decode_attention(*args, num_splits=num_splits, out=out, config=config_of(dec, args, variant))
    assert_close_rel(out.cpu(), reference_on_cpu(args))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_default_split_choice_and_sm_scale(backend, assert_close_rel, variant):
    dec = backend.module("decode_attention")
    lens = [3, 64, 40] if not backend.is_cuda else [3, 6400, 40000]
    args = make_batch(lens, 8, 2, 128, torch.float16, backend.device)
    got = dec.decode_attention(*args, sm_scale=0.2, config=config_of(dec, args, variant))
    assert_close_rel(got.cpu(), reference_on_cpu(args, sm_scale=0.2))


def test_fused_merge_leaves_its_counters_at_zero_so_every_call_merges(backend, assert_close_rel):
    """Calls of different batch shapes in a row, as the layers and steps of a worker make them: each
    merges every head (poisoned outputs) because the last split of each resets its counter."""
    dec = backend.module("decode_attention")
    scale = 1 if not backend.is_cuda else 97
    for seed, lens in enumerate([[9, 40, 3], [40, 40], [1, 17, 33, 50, 2]] * 2):
        args = make_batch([n * scale for n in lens], 8, 2, 64, torch.float16, backend.device, seed=seed)
        out = torch.full_like(args[0], float("nan"))
        dec.decode_attention(*args, num_splits=4, out=out, config=config_of(dec, args, "fused_merge"))
        assert_close_rel(out.cpu(), reference_on_cpu(args))
        assert int(dec.merge_counters(args[0].device, 1).count_nonzero()) == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_empty_splits_and_empty_requests(backend, assert_close_rel, variant):
    """With 1-token splits, a 5-token request cut into 4 splits of 2 leaves the last split empty;
    a request with no slots must come out as zeros, like the reference."""
    dec = backend.module("decode_attention")
    cfg = with_variant(dec.DecodeConfig(block_n=16, min_split_len=1, num_warps=4, num_stages=1), variant)
    args = make_batch([5, 0, 9], 4, 1, 64, torch.float32, backend.device)
    out = torch.full_like(args[0], float("nan"))
    dec.decode_attention(*args, num_splits=4, config=cfg, out=out)
    ref = reference_on_cpu(args)
    assert torch.equal(out[1].cpu(), torch.zeros_like(ref[1]))
    assert_close_rel(out.cpu(), ref)


@pytest.mark.parametrize(
    ("batch", "hkv", "sms", "max_len", "expected"),
    [
        (1, 8, 132, None, 33),  # one long request: split until ~2 programs per SM
        (1, 8, 132, 1000, 4),  # ... but never into chunks shorter than 256 tokens
        (256, 8, 132, 32768, 1),  # a big batch fills the GPU without splitting
        (1, 1, 132, None, 64),  # capped at MAX_SPLITS
        (4, 8, 132, 0, 1),
    ],
)
def test_choose_num_splits(backend, batch, hkv, sms, max_len, expected):
    dec = backend.module("decode_attention")
    assert dec.choose_num_splits(batch, hkv, sms, max_len, min_split_len=256) == expected


def test_choose_num_splits_aims_at_the_waves_asked_for(backend):
    dec = backend.module("decode_attention")
    assert [dec.choose_num_splits(1, 8, 132, None, waves=w) for w in (1, 2, 4)] == [17, 33, 64]
    assert dec.choose_num_splits(1, 8, 132, 16384, waves=8) == 64  # MAX_SPLITS, then the length's 64
    assert dec.choose_num_splits(2, 8, 132, 2048, waves=8) == 8  # 2048 tokens: 8 splits of 256


@pytest.mark.parametrize("index", [3, 4], ids=["kv_indptr", "kv_indices"])
def test_decode_reads_strided_index_tensors_by_value(backend, assert_close_rel, index):
    dec = backend.module("decode_attention")
    args = list(make_batch([5, 17, 31], 4, 2, 64, torch.float32, backend.device, seed=3))
    args[index] = strided(args[index])
    assert not args[index].is_contiguous()
    out = torch.full_like(args[0], float("nan"))
    dec.decode_attention(*args, num_splits=2, out=out)
    assert_close_rel(out.cpu(), reference_on_cpu(args))


def _mismatched(name):
    """make_batch's arguments with one made inconsistent, and the error message it must raise."""
    q, k_cache, v_cache, kvp, idx = make_batch([5, 17, 31], 4, 2, 64, torch.float16, "cpu")
    kw = {}
    if name == "head_dim":  # q 64, the pool 32
        k_cache, v_cache, match = k_cache[..., :32], v_cache[..., :32], "k_cache has shape"
    elif name == "v_pool_hkv":
        v_cache, match = v_cache[:, :1], "v_cache has shape"
    elif name == "v_pool_slots":  # a slot past V's rows was read out of bounds (a segfault)
        v_cache, match = v_cache[:4], "v_cache has 4 slots"
    elif name == "hq_not_multiple":
        q, match = q[:, :3], "Hq=3 is not a multiple of Hkv=2"
    elif name == "small_out":  # the merge kernel would write past its end
        kw["out"], match = torch.empty(1, 4, 64, dtype=torch.float16), "out has shape"
    elif name == "bf16_pool":
        k_cache, v_cache, match = k_cache.bfloat16(), v_cache.bfloat16(), "share one dtype"
    elif name == "q_2d":
        q, match = q[:, 0], "q must be 3-D"
    elif name == "kv_indptr_length":  # the kernels would read kv_indptr[3] past its end
        kvp, match = kvp[:-1], "kv_indptr must have 4 entries"
    return (q, k_cache, v_cache, kvp, idx), kw, match


@pytest.mark.parametrize(
    "name",
    [
        "head_dim",
        "v_pool_hkv",
        "v_pool_slots",
        "hq_not_multiple",
        "small_out",
        "bf16_pool",
        "q_2d",
        "kv_indptr_length",
    ],
)
def test_decode_rejects_inconsistent_arguments_before_launch(backend, name):
    dec = backend.module("decode_attention")
    args, kw, match = _mismatched(name)
    args = [a.to(backend.device) for a in args]
    kw = {k: v.to(backend.device) for k, v in kw.items()}
    with pytest.raises(ValueError, match=match):
        dec.decode_attention(*args, num_splits=2, **kw)


def test_pdl_is_used_only_compiled_on_hopper_or_later(monkeypatch):
    from kernels import pdl

    monkeypatch.setattr(pdl, "INTERPRETED", False)
    monkeypatch.setattr(pdl, "TRITON_HAS_PDL", True)
    assert [pdl.pdl_active(True, arch) for arch in (80, 89, 90, 100)] == [False, False, True, True]
    assert not pdl.pdl_active(False, 90)
    monkeypatch.setattr(pdl, "TRITON_HAS_PDL", False)  # a Triton without grid dependency control
    assert not pdl.pdl_active(True, 90)
    monkeypatch.setattr(pdl, "TRITON_HAS_PDL", True)
    monkeypatch.setattr(pdl, "INTERPRETED", True)  # the interpreter has no grid dependencies
    assert not pdl.pdl_active(True, 90)
    assert pdl.pdl_launch(True) == {"launch_pdl": True} and pdl.pdl_launch(False) == {}


def test_pdl_launches_match_the_reference_eager_and_replayed_in_one_graph(backend, assert_close_rel):
    """Decode and a short extend launched as programmatic dependents, eagerly and then captured together
    in one CUDA graph (the short extend's split kernel depends on decode's merge) and replayed over new
    queries and keys written in place: each kernel must wait for the one before."""
    if not backend.is_cuda:
        pytest.skip("the interpreter has no grid dependencies (pdl_active is False there)")
    from tests.kernels.test_extend_short import make_batch as short_batch
    from tests.kernels.test_extend_short import want as short_want

    dec, short = backend.module("decode_attention"), backend.module("extend_short")
    cfg = dataclasses.replace(
        dec.default_config(128, torch.bfloat16, dec.device_arch(backend.device)), pdl=True
    )
    d_args = make_batch([n * 97 for n in KV_LENS], 32, 8, 128, torch.bfloat16, backend.device)
    s_args = short_batch([n * 53 for n in [0, 1, 37, 70]], [3, 1, 5, 9], 32, 8, 128, torch.bfloat16,
                         backend.device)  # fmt: skip
    d_out, s_out = torch.empty_like(d_args[0]), torch.empty_like(s_args[0])

    def step() -> None:
        dec.decode_attention(*d_args, num_splits=8, out=d_out, config=cfg)
        short.extend_short_attention(*s_args, max_extend_len=9, num_splits=8, out=s_out, config=cfg)

    def check() -> None:
        assert_close_rel(d_out.cpu(), reference_on_cpu(d_args))
        assert_close_rel(s_out.cpu(), short_want(s_args))

    d_out.fill_(float("nan"))
    s_out.fill_(float("nan"))
    step()
    check()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(7)
    for args in (d_args, s_args):
        args[0].copy_(torch.randn(args[0].shape, generator=g))
        used = args[-1] if args is d_args else torch.cat([args[-2].long(), args[-1]])
        args[1][used.long()] = torch.randn(used.numel(), *args[1].shape[1:], generator=g).to(args[1])
    d_out.fill_(float("nan"))
    s_out.fill_(float("nan"))
    graph.replay()
    check()
