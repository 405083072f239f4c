"""An fp8 KV pool (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the stores write kernels.reference.to_pool's
values bit for bit (saturated, rounded to nearest even), and every attention path reads the pool's
values widened to q's dtype, as the reference does: decode (each variant), extend (unsplit, prefix
split, packed) and the short extend, with GQA 1/4/8 and NaN-poisoned outputs and unused pool slots."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from tests.kernels import test_decode_attention as decode_cases
from tests.kernels import test_extend_attention as extend_cases
from tests.kernels.test_fused import rope_cache
from tests.kernels.test_sliding_window import REQUESTS
from tests.support import each_value_once

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
GQA = [(8, 8), (8, 2), (8, 1)]  # (Hq, Hkv): groups of 1, 4, 8
GQA_PAIRS = [(gqa,) for gqa in GQA]  # each_value_once's values: one parameter, the pair


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def in_fp8(args: tuple, pool_dtype: torch.dtype, pool_at: tuple[int, int]) -> tuple:
    """``args`` with the pool tensors at indices ``pool_at`` stored as ``pool_dtype`` (NaN stays NaN)."""
    return tuple(reference.to_pool(a, pool_dtype) if i in pool_at else a for i, a in enumerate(args))


def q_dtype(backend) -> torch.dtype:
    return torch.bfloat16 if backend.is_cuda else torch.float32


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
def test_to_pool_is_torchs_rounding_with_saturation_instead_of_overflow(pool_dtype):
    top = torch.finfo(pool_dtype).max
    x = torch.randn(4096) * torch.logspace(-12, 10, 4096, base=2)
    inside = x.abs() <= top
    assert bits(reference.to_pool(x, pool_dtype))[inside].equal(bits(x.to(pool_dtype))[inside])
    big = torch.tensor([1e9, -1e9, top * 1.01, float("inf"), -float("inf")])
    assert reference.to_pool(big, pool_dtype).float().tolist() == [top, -top, top, top, -top]
    assert reference.to_pool(torch.tensor([0.3]), torch.bfloat16).dtype == torch.bfloat16  # others convert


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
def test_store_kv_writes_every_finite_bf16_value_as_the_reference_rounds_it(backend, pool_dtype):
    """All 65,280 finite bf16 values (normals, subnormals of both formats, ties, past the largest finite),
    stored through store_kv and rope_store_kv's value half, land as the reference's bit patterns."""
    fused = backend.module("fused")
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(torch.bfloat16)
    values = values[torch.isfinite(values.float())]
    values = torch.cat([values, values[: 256 - values.numel() % 256]]).view(-1, 2, 128)  # [T, Hkv, D]
    t = values.shape[0]
    k = values.to(backend.device)
    v = -k
    k_cache = torch.full((t + 7, 2, 128), float("nan")).to(pool_dtype).to(backend.device)
    v_cache = k_cache.clone()
    slots = torch.randperm(t + 7)[:t].to(torch.int32).to(backend.device)
    fused.store_kv(k_cache, v_cache, slots, k, v)
    want_k, want_v = (torch.full((t + 7, 2, 128), float("nan")).to(pool_dtype) for _ in range(2))
    reference.store_kv(want_k, want_v, slots.cpu(), k.cpu(), v.cpu())
    assert bits(k_cache.cpu()).equal(bits(want_k)) and bits(v_cache.cpu()).equal(bits(want_v))


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_store_kv_stores_the_rotated_k_it_returns_rounded_into_the_pool(backend, pool_dtype, dtype):
    fused = backend.module("fused")
    g = torch.Generator().manual_seed(7)
    t, hq, hkv, d = 11, 8, 2, 64
    q, k, v = (torch.randn(t, h, d, generator=g).mul(60).to(dtype) for h in (hq, hkv, hkv))  # past 448 too
    positions = torch.randint(0, 64, (t,), generator=g)
    cos_sin = rope_cache(64, d)
    slots = torch.randperm(t + 5, generator=g)[:t].to(torch.int32)
    dev = [x.to(backend.device) for x in (q, k, v, positions, cos_sin)]
    k_cache = torch.full((t + 5, hkv, d), float("nan")).to(pool_dtype).to(backend.device)
    v_cache = k_cache.clone()
    _, k_rot = fused.rope_store_kv(*dev, k_cache, v_cache, slots.to(backend.device))
    _, want_k = reference.apply_rope(q, k, positions, cos_sin)
    assert_close = dict(rtol=0, atol=0) if dtype == torch.float32 and not backend.is_cuda else {}
    torch.testing.assert_close(k_rot.cpu(), want_k, **assert_close)
    stored = k_cache.cpu()[slots.long()]
    assert bits(stored).equal(bits(reference.to_pool(k_rot.cpu(), pool_dtype)))  # the k returned, rounded
    assert bits(v_cache.cpu()[slots.long()]).equal(bits(reference.to_pool(v, pool_dtype)))
    assert stored.float().abs().max() <= torch.finfo(pool_dtype).max
    assert torch.isnan(k_cache.cpu().float()).sum() == 5 * hkv * d  # nothing else written


@pytest.mark.parametrize(
    ("variant", "gqa", "pool_dtype"), each_value_once(decode_cases.VARIANTS, GQA_PAIRS, FP8)
)
def test_decode_over_an_fp8_pool_matches_the_reference(backend, assert_close_rel, variant, gqa, pool_dtype):
    hq, hkv = gqa
    dec = backend.module("decode_attention")
    lens = [1, 2, 17, 50, 130, 33] if not backend.is_cuda else [1, 2, 1700, 5000, 13000, 3300]
    args = in_fp8(decode_cases.make_batch(lens, hq, hkv, 64, q_dtype(backend), backend.device, seed=61), pool_dtype,
                  (1, 2))  # fmt: skip
    cfg = decode_cases.with_variant(dec.default_config(64, args[0].dtype, pool_dtype=pool_dtype), variant)
    out = torch.full_like(args[0], float("nan"))  # poisoned: any head the kernel skips fails
    dec.decode_attention(*args, out=out, config=cfg, num_splits=4)
    assert_close_rel(out.cpu(), reference.decode_attention(*(a.cpu() for a in args)))


@pytest.mark.parametrize(
    ("variant", "gqa", "pool_dtype"), each_value_once(decode_cases.VARIANTS, GQA_PAIRS[1:], FP8)
)
def test_decode_widening_an_fp8_pool_to_fp16_under_a_bf16_query_matches_the_reference(
    backend, assert_close_rel, variant, gqa, pool_dtype
):
    """DecodeConfig.fp8_f16 (kernels.bench's candidate): q in fp16, the tiles widened to fp16, as close to
    the reference as bf16's bound; a q past fp16's range saturates (the output stays finite, where an
    unsaturated conversion would give inf scores and NaN)."""
    hq, hkv = gqa
    dec = backend.module("decode_attention")
    lens = [1, 2, 17, 50, 130, 33] if not backend.is_cuda else [1, 2, 1700, 5000, 13000, 3300]
    args = in_fp8(decode_cases.make_batch(lens, hq, hkv, 64, torch.bfloat16, backend.device, seed=62), pool_dtype,
                  (1, 2))  # fmt: skip
    cfg = dec.default_config(64, torch.bfloat16, pool_dtype=pool_dtype)
    cfg = dataclasses.replace(decode_cases.with_variant(cfg, variant), fp8_f16=True)
    out = torch.full_like(args[0], float("nan"))
    dec.decode_attention(*args, out=out, config=cfg, num_splits=4)
    assert_close_rel(out.cpu(), reference.decode_attention(*(a.cpu() for a in args)))
    args[0][1, 0, 0] = 1e6  # NOTE: a bf16 value fp16 cannot hold
    out.fill_(float("nan"))
    dec.decode_attention(*args, out=out, config=cfg, num_splits=4)
    assert torch.isfinite(out.cpu().float()).all()


@pytest.mark.parametrize(
    ("hq", "hkv", "num_splits", "packed", "pool_dtype"),
    each_value_once([(*gqa, 1, False) for gqa in GQA] + [(8, 2, 4, False), (8, 2, 4, True)], FP8),
)
def test_extend_over_an_fp8_pool_matches_the_reference(
    backend, assert_close_rel, pool_dtype, hq, hkv, num_splits, packed
):
    ext = backend.module("extend_attention")
    requests = REQUESTS if not backend.is_cuda else [(p * 9, n * 9) for p, n in REQUESTS]
    batch = extend_cases.make_batch(requests, hq, hkv, 64, q_dtype(backend), backend.device, seed=71)
    args = in_fp8(batch, pool_dtype, (3, 4))
    cfg = ext.default_config(64, args[0].dtype, pool_dtype=pool_dtype)
    cfg = dataclasses.replace(cfg, split_prefix=num_splits > 1, packed_blocks=packed)
    out = torch.full_like(args[0], float("nan"))
    ext.extend_attention(*args, out=out, config=cfg, num_splits=num_splits)
    assert_close_rel(out.cpu(), reference.extend_attention(*(a.cpu() for a in args)))


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(("hq", "hkv"), GQA)
def test_short_extend_over_an_fp8_pool_matches_the_reference(backend, assert_close_rel, pool_dtype, hq, hkv):
    short = backend.module("extend_short")
    args = short_case(
        [(0, 3), (40, 1), (17, 5), (130, 2)], hq, hkv, 64, q_dtype(backend), backend, pool_dtype, 81
    )
    out = torch.full_like(args[0], float("nan"))
    short.extend_short_attention(*args, max_extend_len=5, out=out, num_splits=4)
    assert_close_rel(out.cpu(), reference.extend_short_attention(*(a.cpu() for a in args)))


def short_case(requests, hq, hkv, head_dim, dtype, backend, pool_dtype, seed) -> tuple:
    """extend_short_attention's (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out_slots) over an
    fp8 pool: the new tokens' K/V stored in free slots first, where the worker stores them before attention."""
    q, k_new, v_new, k_cache, v_cache, qo, kv, prefix = extend_cases.make_batch(
        requests, hq, hkv, head_dim, dtype, backend.device, seed=seed
    )
    k_cache, v_cache = reference.to_pool(k_cache, pool_dtype), reference.to_pool(v_cache, pool_dtype)
    free = sorted(set(range(k_cache.shape[0])) - set(prefix.tolist()))[: q.shape[0]]
    out_slots = torch.tensor(free, dtype=torch.int32, device=backend.device)
    reference.store_kv(k_cache, v_cache, out_slots, k_new, v_new)
    return q, k_cache, v_cache, qo, kv, prefix, out_slots


def test_a_pool_of_mixed_or_unsupported_dtypes_is_refused(backend):
    dec = backend.module("decode_attention")
    fused = backend.module("fused")
    q, k_cache, v_cache, kvp, slots = decode_cases.make_batch([3], 8, 2, 64, torch.float32, backend.device)
    fp8 = reference.to_pool(k_cache, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="the pool may be fp8"):
        dec.decode_attention(q, fp8, v_cache, kvp, slots)  # K fp8, V not
    with pytest.raises(ValueError, match="the pool may be fp8"):
        dec.decode_attention(q, k_cache.to(torch.int8), v_cache.to(torch.int8), kvp, slots)
    k = torch.zeros(2, 2, 64, device=backend.device)
    two = torch.tensor([0, 1], dtype=torch.int32, device=backend.device)
    with pytest.raises(ValueError, match=r"the pool is torch\.int8"):
        fused.store_kv(k_cache.to(torch.int8), v_cache.to(torch.int8), two, k, k)
    with pytest.raises(ValueError, match=r"float8_e4m3fn \(K\) and torch\.float32 \(V\)"):
        fused.store_kv(fp8, v_cache, two, k, k)


# a checkpoint's KV scales (k_scale, v_scale): the pool holds K / k_scale and V / v_scale; K's spread the
# codes past e4m3's 448 for the largest values (they saturate), V's into its subnormals for the smallest.
# One a tensor (a pair of numbers), or one a KV head (compressed-tensors' attn_head; Hkv = 2 here: a float32
# [2, Hkv] tensor, the worker's form, the second head's scales far from the first's)
KV_SCALES = (0.05, 4.0)
HEAD_SCALES = ((0.05, 0.3), (4.0, 0.7))
SCALE_KINDS = ["tensor", "head"]


def kv_scales_of(kind: str, device) -> tuple[object, torch.Tensor]:
    """The scales of ``kind`` as the kernels take them (on ``device``) and as float32 [2, Hkv] on the CPU
    (what the reference and scaled_pool take)."""
    if kind == "tensor":
        return KV_SCALES, torch.tensor(KV_SCALES).repeat_interleave(2).reshape(2, 2)
    table = torch.tensor(HEAD_SCALES)
    return table.to(device), table


def scaled_pool(cache: torch.Tensor, scale, pool_dtype: torch.dtype) -> torch.Tensor:
    """A 16/32-bit pool's rows [S, Hkv, D] as an fp8 pool with ``scale`` (one number, or [Hkv]: one a head)
    stores them (reference.store_kv's rule)."""
    per_head = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1).to(cache.device)
    return reference.to_pool(cache.float() / per_head, pool_dtype)


@pytest.mark.parametrize("pool_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_scaled_stores_write_the_references_bits(backend, pool_dtype, kind):
    """store_kv and rope_store_kv with KV scales: each value over its KV head's scale (division rounded to
    nearest), then the pool's rounding and saturation; rope_store_kv still returns the rotated k unscaled."""
    fused = backend.module("fused")
    scales, table = kv_scales_of(kind, backend.device)
    g = torch.Generator().manual_seed(9)
    t, hq, hkv, d = 13, 8, 2, 64
    q, k, v = (torch.randn(t, h, d, generator=g).mul(8).to(torch.bfloat16) for h in (hq, hkv, hkv))
    positions = torch.randint(0, 64, (t,), generator=g)
    cos_sin = rope_cache(64, d)
    slots = torch.randperm(t + 3, generator=g)[:t].to(torch.int32)
    dev = [x.to(backend.device) for x in (q, k, v, positions, cos_sin)]
    for store in ("store_kv", "rope_store_kv"):
        k_cache = torch.full((t + 3, hkv, d), float("nan")).to(pool_dtype).to(backend.device)
        v_cache = k_cache.clone()
        want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
        if store == "store_kv":
            fused.store_kv(k_cache, v_cache, slots.to(backend.device), dev[1], dev[2], kv_scales=scales)
            reference.store_kv(want_k, want_v, slots, k, v, table)
        else:  # NOTE: the pool gets the k returned (rotated, unscaled) over its scale
            _, k_rot = fused.rope_store_kv(*dev, k_cache, v_cache, slots.to(backend.device), kv_scales=scales)
            torch.testing.assert_close(k_rot.cpu(), reference.apply_rope(q, k, positions, cos_sin)[1])
            k = k_rot.cpu()
            reference.store_kv(want_k, want_v, slots, k, v, table)
        assert bits(k_cache.cpu()).equal(bits(want_k)) and bits(v_cache.cpu()).equal(bits(want_v)), store
        rows = slots.long()
        for head in range(hkv):  # NOTE: the reference's rule, head by head
            for cache, x, row in ((want_k, k, 0), (want_v, v, 1)):
                alone = reference.to_pool(x[:, head].float() / table[row, head].item(), pool_dtype)
                assert bits(cache[rows, head]).equal(bits(alone)), (store, head, row)
    stored = want_k[slots.long()].float()
    if pool_dtype == torch.float8_e4m3fn:  # NOTE: k / 0.05 saturates e4m3's largest values (not e5m2's)
        assert stored.abs().max() == torch.finfo(pool_dtype).max
    unscaled_k, unscaled_v = want_k.clone(), want_v.clone()
    reference.store_kv(unscaled_k, unscaled_v, slots, k, v)
    assert not bits(unscaled_v).equal(bits(want_v))


@pytest.mark.parametrize(
    ("path", "kind", "pool_dtype"),
    each_value_once(["decode", "extend", "extend-split", "extend-packed", "short"], SCALE_KINDS, FP8),
)
def test_attention_over_a_scaled_fp8_pool_matches_the_reference(
    backend, assert_close_rel, path, kind, pool_dtype
):
    """Each attention path with KV scales, one a tensor or one a KV head: the pool's codes stand for code x
    their head's scale (the prefix's in an extend; its new tokens' k, v as given), GQA 4, NaN-poisoned
    outputs; far from the same pool read unscaled, and (one a head) from every head read by the first's."""
    kv, table = kv_scales_of(kind, backend.device)
    if path == "decode":
        dec = backend.module("decode_attention")
        lens = [1, 2, 17, 50, 130, 33] if not backend.is_cuda else [1, 2, 1700, 5000, 13000, 3300]
        q, k_cache, v_cache, kvp, slots = decode_cases.make_batch(lens, 8, 2, 64, q_dtype(backend), backend.device,
                                                                   seed=91)  # fmt: skip
        args = (
            q,
            scaled_pool(k_cache, table[0], pool_dtype),
            scaled_pool(v_cache, table[1], pool_dtype),
            kvp,
            slots,
        )
        out = torch.full_like(q, float("nan"))
        dec.decode_attention(*args, out=out, num_splits=4, kv_scales=kv)

        def on_the_cpu(scales=None):
            return reference.decode_attention(*(a.cpu() for a in args), kv_scales=scales)
    elif path == "short":
        short = backend.module("extend_short")
        q, k_new, v_new, k_cache, v_cache, qo, kvp, prefix = extend_cases.make_batch(
            [(0, 3), (40, 1), (17, 5), (130, 2)], 8, 2, 64, q_dtype(backend), backend.device, seed=93
        )
        k_cache, v_cache = (
            scaled_pool(k_cache, table[0], pool_dtype),
            scaled_pool(v_cache, table[1], pool_dtype),
        )
        free = sorted(set(range(k_cache.shape[0])) - set(prefix.tolist()))[: q.shape[0]]
        out_slots = torch.tensor(free, dtype=torch.int32, device=backend.device)
        reference.store_kv(k_cache, v_cache, out_slots, k_new, v_new, kv)  # NOTE: as the worker stores them
        out = torch.full_like(q, float("nan"))
        short.extend_short_attention(q, k_cache, v_cache, qo, kvp, prefix, out_slots, max_extend_len=5, out=out,
                                     num_splits=4, kv_scales=kv)  # fmt: skip
        cpu = [a.cpu() for a in (q, k_cache, v_cache, qo, kvp, prefix, out_slots)]

        def on_the_cpu(scales=None):
            return reference.extend_short_attention(*cpu, kv_scales=scales)
    else:
        ext = backend.module("extend_attention")
        requests = REQUESTS if not backend.is_cuda else [(p * 9, n * 9) for p, n in REQUESTS]
        batch = list(extend_cases.make_batch(requests, 8, 2, 64, q_dtype(backend), backend.device, seed=95))
        batch[3], batch[4] = (
            scaled_pool(batch[3], table[0], pool_dtype),
            scaled_pool(batch[4], table[1], pool_dtype),
        )
        cfg = ext.default_config(64, batch[0].dtype, pool_dtype=pool_dtype)
        cfg = dataclasses.replace(cfg, split_prefix=path != "extend", packed_blocks=path == "extend-packed")
        out = torch.full_like(batch[0], float("nan"))
        ext.extend_attention(
            *batch, out=out, config=cfg, num_splits=1 if path == "extend" else 4, kv_scales=kv
        )

        def on_the_cpu(scales=None):
            return reference.extend_attention(*(a.cpu() for a in batch), kv_scales=scales)

    want = on_the_cpu(table)
    assert_close_rel(out.cpu(), want)
    others = {"unscaled": None}
    if kind == "head":
        others["the first head's"] = table[:, :1].expand(2, 2).contiguous()
    for name, scales in others.items():
        other = on_the_cpu(scales)
        assert ((other.float() - want.float()).norm() / want.float().norm()).item() > 0.1, name


@pytest.mark.parametrize("kind", SCALE_KINDS)
def test_the_scaled_reference_is_the_reference_over_the_values_the_codes_stand_for(kind):
    """Over codes c with scales s, every path computes what it computes over a float32 pool of c x s."""
    _, table = kv_scales_of(kind, "cpu")
    q, k_cache, v_cache, kvp, slots = decode_cases.make_batch(
        [5, 40], 8, 2, 64, torch.float32, "cpu", seed=97
    )
    k8, v8 = (
        scaled_pool(k_cache, table[0], torch.float8_e4m3fn),
        scaled_pool(v_cache, table[1], torch.float8_e4m3fn),
    )
    values = (k8.float() * table[0][:, None], v8.float() * table[1][:, None])
    torch.testing.assert_close(reference.decode_attention(q, k8, v8, kvp, slots, kv_scales=table),
                               reference.decode_attention(q, *values, kvp, slots), rtol=0, atol=0)  # fmt: skip


def test_kv_scales_are_refused_over_a_16_bit_pool_or_when_not_positive_or_misshapen(backend):
    dec = backend.module("decode_attention")
    fused = backend.module("fused")
    q, k_cache, v_cache, kvp, slots = decode_cases.make_batch([3], 8, 2, 64, torch.float32, backend.device)
    with pytest.raises(ValueError, match=r"KV scales apply to an fp8 pool, not a torch\.float32 one"):
        dec.decode_attention(q, k_cache, v_cache, kvp, slots, kv_scales=KV_SCALES)
    with pytest.raises(ValueError, match="KV scales apply to an fp8 pool"):
        reference.decode_attention(q, k_cache, v_cache, kvp, slots, kv_scales=KV_SCALES)
    k8, v8 = (reference.to_pool(c, torch.float8_e4m3fn) for c in (k_cache, v_cache))
    refusals = [
        ((0.0, 1.0), "positive finite numbers"),
        ((1.0, float("inf")), "positive finite numbers"),
        (((1.0, -1.0), 2.0), "positive finite numbers"),
        ((1.0,), r"a pair \(K's, V's\), got 1 values"),
        (((1.0, 2.0, 3.0), 1.0), r"one a KV head \(2\) each, got 3"),
        (torch.ones(2, 3, device=backend.device), r"float32 \[2, Hkv\] = \[2, 2\]"),
        (torch.ones(2, 2, dtype=torch.float64, device=backend.device), r"float32 \[2, Hkv\]"),
        (torch.ones(2, 4, device=backend.device)[:, ::2], "contiguous in its last dim"),
    ]
    if backend.is_cuda:
        refusals.append((torch.ones(2, 2), "KV scales are on cpu"))
    else:  # NOTE: a CPU tensor's values are read; a device's are not (no check waits on the device)
        refusals.append((torch.tensor([[1.0, 0.0], [1.0, 1.0]]), "positive finite numbers"))
    for bad, message in refusals:
        with pytest.raises(ValueError, match=message):
            fused.store_kv(k8, v8, slots[:1], k_cache[:1], v_cache[:1], kv_scales=bad)


def test_sm90_decode_over_an_fp8_pool_takes_the_tuned_tiles_and_the_short_extend_keeps_its_own(monkeypatch):
    """Compiled for sm_90 (head dims 65-128, a 16-bit q), decode over an fp8 pool takes FP8_TILES below
    MANY_REQUESTS and FP8_MANY_TILES from it, both widening to fp16; the short extend, which does not
    widen, keeps FP8_SHORT_TILES there and decode's batch-1 choice elsewhere; other head dims, dtypes and
    architectures take the 16-bit pools' tiles."""
    from kernels import decode_attention as dec
    from kernels import extend_short

    monkeypatch.setattr(dec, "INTERPRETED", False)  # the compiled choice (the interpreter takes tiny tiles)
    monkeypatch.setattr(extend_short, "INTERPRETED", False)
    bf16, e4m3, many = torch.bfloat16, torch.float8_e4m3fn, dec.MANY_REQUESTS
    assert dec.FP8_TILES.fp8_f16 and dec.FP8_MANY_TILES.fp8_f16 and not dec.FP8_SHORT_TILES.fp8_f16
    for dtype, pool in [(bf16, e4m3), (torch.float16, e4m3), (bf16, torch.float8_e5m2)]:
        for head_dim in (96, 128):
            assert dec.default_config(head_dim, dtype, 90, 1, pool) == dec.FP8_TILES
            assert dec.default_config(head_dim, dtype, 90, many - 1, pool) == dec.FP8_TILES
            assert dec.default_config(head_dim, dtype, 90, many, pool) == dec.FP8_MANY_TILES
            assert extend_short.default_config(head_dim, dtype, 90, pool) == dec.FP8_SHORT_TILES
    for head_dim, dtype, arch in [(64, bf16, 90), (256, bf16, 90), (128, bf16, 89), (128, torch.float32, 90)]:
        for batch in (1, many):
            want = dec.default_config(head_dim, dtype, arch, batch)
            assert dec.default_config(head_dim, dtype, arch, batch, e4m3) == want, (
                head_dim,
                dtype,
                arch,
                batch,
            )
        assert extend_short.default_config(head_dim, dtype, arch, e4m3) == dec.default_config(
            head_dim, dtype, arch
        )
    assert extend_short.default_config(128, bf16, 90) == dec.default_config(128, bf16, 90, 1)


@pytest.mark.parametrize(
    ("kind", "pool_dtype"), each_value_once(["decode", "decode-many", "extend", "extend-split", "short"], FP8)
)
def test_the_sm90_fp8_pool_tiles_match_the_reference_at_head_dim_128(
    backend, assert_close_rel, pool_dtype, kind
):
    """The tiles sm_90 takes over an fp8 pool at head dim 128 (FP8_TILES and FP8_MANY_TILES widening to fp16,
    FP8_PREFIX_TILES unsplit and split, the short extend's FP8_SHORT_TILES), given explicitly so that the
    interpreter runs them too, under a bf16 q with GQA 4, against the reference."""
    dec, ext, short = (backend.module(m) for m in ("decode_attention", "extend_attention", "extend_short"))
    if kind.startswith("decode"):
        lens = [1, 2, 17, 50, 300, 33] if not backend.is_cuda else [1, 2, 1700, 5000, 13000, 3300]
        args = in_fp8(decode_cases.make_batch(lens, 8, 2, 128, torch.bfloat16, backend.device, seed=63), pool_dtype,
                      (1, 2))  # fmt: skip
        cfg = dec.FP8_MANY_TILES if kind == "decode-many" else dec.FP8_TILES
        out = torch.full_like(args[0], float("nan"))
        dec.decode_attention(*args, out=out, config=cfg, num_splits=4)
        assert_close_rel(out.cpu(), reference.decode_attention(*(a.cpu() for a in args)))
        return
    if kind == "short":  # NOTE: few new tokens a request
        args = short_case(
            [(0, 3), (300, 1), (17, 5), (130, 2)], 8, 2, 128, torch.bfloat16, backend, pool_dtype, 82
        )
        out = torch.full_like(args[0], float("nan"))
        short.extend_short_attention(
            *args, max_extend_len=5, out=out, num_splits=4, config=dec.FP8_SHORT_TILES
        )
        assert_close_rel(out.cpu(), reference.extend_short_attention(*(a.cpu() for a in args)))
        return
    requests = [(300, 20), (0, 40), (130, 9), (7, 1)]
    requests = requests if not backend.is_cuda else [(p * 9, n * 9) for p, n in requests]
    batch = extend_cases.make_batch(requests, 8, 2, 128, torch.bfloat16, backend.device, seed=72)
    args = in_fp8(batch, pool_dtype, (3, 4))
    out = torch.full_like(args[0], float("nan"))
    splits = 4 if kind == "extend-split" else 1
    cfg = dataclasses.replace(ext.FP8_PREFIX_TILES, split_prefix=splits > 1)
    ext.extend_attention(*args, out=out, config=cfg, num_splits=splits)
    assert_close_rel(out.cpu(), reference.extend_attention(*(a.cpu() for a in args)))
