"""Triton rotary embedding (NeoX / HF-Llama halves), KV-store into the paged pool, and the two fused
(RoPE, then the store of the rotated k and v: one kernel per layer).

Semantics are kernels.reference.{apply_rope, store_kv, rope_store_kv}; this module must never change them.
Shapes: q [T, Hq, D], k, v [T, Hkv, D]; positions [T] (token positions);
cos_sin_cache [max_pos, D] with cos in [:, :D/2] and sin in [:, D/2:]; k_cache, v_cache [S, Hkv, D];
slots [T] (pool row per token). All math in fp32, results in the input's (or the pool's) dtype; an fp8
pool (float8_e4m3fn, float8_e5m2) stores kernels.reference.to_pool's values: saturated, rounded to
nearest even, the rotated k rounded to k's dtype first (as the k it returns).
Index tensors (int32/int64, any strides) are passed on contiguous; shapes, dtypes and devices are checked
from metadata (ValueError).
CALLER CONTRACTS, NOT CHECKED ON CUDA (checking needs the index data: a device-to-host sync):
  - every position is in [0, max_pos) of cos_sin_cache; a position past the cache rotates by whatever
    memory lies beyond it, silently (checked, ValueError, only when positions are on the CPU: the
    interpreter and tests).
  - every slot is in [0, S) and slots are distinct within one store_kv call; otherwise it writes out of
    bounds or races.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested
from kernels.pointwise import warps_for

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()


@triton.jit
def _rotated(
    X, row, stride_xt, stride_xh, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Row ``row`` of X [T, H, D] rotated: (first halves, second halves) in fp32, and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    src = X + row * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def _fp8_grid(
    x, MANTISSA: tl.constexpr, SUBNORMAL_STEP: tl.constexpr, MIN_NORMAL: tl.constexpr, TOP: tl.constexpr
):
    """fp32 ``x`` saturated at +-TOP and rounded to nearest even onto an fp8 format's values (MANTISSA
    bits, normals from MIN_NORMAL, subnormals SUBNORMAL_STEP apart), still fp32.
    NOTE: rounded here with integer and fp32 arithmetic, so the conversion after it is exact on every
    backend (the interpreter's fp32 -> fp8 rounding loses a binade where a mantissa rounds up)."""
    x = tl.clamp(x, -TOP, TOP)
    bits = x.to(tl.int32, bitcast=True)
    drop: tl.constexpr = 23 - MANTISSA
    keep = (bits >> drop) & 1  # NOTE: ties go to the even neighbour
    normal = ((bits + ((1 << (drop - 1)) - 1) + keep) & ~((1 << drop) - 1)).to(tl.float32, bitcast=True)
    # NOTE: below MIN_NORMAL the values are multiples of SUBNORMAL_STEP: an fp32 add at 2**23 steps
    # rounds to the nearest one, ties to even, and the subtraction is exact
    magic = SUBNORMAL_STEP * 8388608.0
    small = (tl.abs(x) + magic) - magic
    # NOTE: the sign by a product, so -0 stays -0 (Triton 3.6 compiles a float's unary minus as 0 - x: +0)
    return tl.where(tl.abs(x) < MIN_NORMAL, small * tl.where(bits < 0, -1.0, 1.0), normal)


@triton.jit
def to_pool(x, DTYPE: tl.constexpr):
    """``x`` converted to a pool's dtype; fp8 saturates at its largest finite value (448 for e4m3fn,
    57344 for e5m2) and rounds to nearest even (kernels.reference.to_pool)."""
    if tl.float8e4nv == DTYPE:
        x = _fp8_grid(x.to(tl.float32), 3, 2.0**-9, 2.0**-6, 448.0).to(DTYPE)
    elif tl.float8e5 == DTYPE:
        x = _fp8_grid(x.to(tl.float32), 2, 2.0**-16, 2.0**-14, 57344.0).to(DTYPE)
    else:
        x = x.to(DTYPE)
    return x


@triton.jit
def scaled_down(x, Scales, offs_h, NUM_HEADS: tl.constexpr, SCALED: tl.constexpr):
    """x [heads, dim] as an fp8 pool with KV scales stores it before rounding: head h's row over its scale
    (Scales [NUM_HEADS] float32, offs_h the rows' heads) in float32, division rounded to nearest as the
    reference's; x itself without (SCALED False)."""
    if SCALED:
        scale = tl.load(Scales + offs_h, mask=offs_h < NUM_HEADS, other=1.0)
        x = tl.math.div_rn(x.to(tl.float32), scale[:, None])
    return x


@triton.jit
def _store_halves(
    Out, row, stride_ot, stride_oh, first, second, mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, Scales=None, NUM_HEADS: tl.constexpr = 0, SCALED: tl.constexpr = False,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    dst = Out + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    first = scaled_down(first, Scales, offs_h, NUM_HEADS, SCALED)
    second = scaled_down(second, Scales, offs_h, NUM_HEADS, SCALED)
    tl.store(dst, to_pool(first, Out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, to_pool(second, Out.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    X, Out, row, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    first, second, mask = _rotated(
        X, row, stride_xt, stride_xh, cos, sin, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF
    )
    _store_halves(Out, row, stride_ot, stride_oh, first, second, mask, HALF, BLOCK_H, BLOCK_HALF)


@triton.jit
def _cos_sin(cos_sin_cache, pos, stride_cs, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Position ``pos``'s cos and sin halves, fp32, as [1, BLOCK_HALF] rows."""
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    return cos[None, :], sin[None, :]


@triton.jit
def _rope_kernel(
    Q, K, Q_out, K_out, positions, cos_sin_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_cache, pos, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(Q, Q_out, row, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(K, K_out, row, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def _rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_out: torch.Tensor | None,
    k_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE's argument checks (ValueError); (positions contiguous, q_out, k_out: given or new)."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be 3-D [T, H, D], got shapes {list(q.shape)} and {list(k.shape)}")
    t, hq, d = q.shape
    hk = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k has shape {list(k.shape)}, expected [{t}, Hkv, {d}] (T and D from q)")
    if d % 2 != 0 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != d:
        raise ValueError(
            f"head_dim {d} must be even and cos_sin_cache [max_pos, {d}], got {list(cos_sin_cache.shape)}"
        )
    if k.device != q.device or cos_sin_cache.device != q.device:
        raise ValueError(f"q is on {q.device}, k on {k.device}, cos_sin_cache on {cos_sin_cache.device}")
    positions = host_checks.index_tensor("positions", positions, q.device, numel=t)
    host_checks.check_unit_stride(q=q, k=k, cos_sin_cache=cos_sin_cache)
    if positions.device.type == "cpu" and t > 0:  # NOTE: free on CPU (interpreter, tests); a sync on CUDA
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"positions span [{lo}, {hi}], outside cos_sin_cache's {cos_sin_cache.shape[0]} rows"
            )
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device) if k_out is None else k_out
    host_checks.check_out("q_out", q_out, q, "q")
    host_checks.check_out("k_out", k_out, k, "k")
    host_checks.check_unit_stride(q_out=q_out, k_out=k_out)
    return positions, q_out, k_out


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq, D] and k [T, Hkv, D] at ``positions`` [T]; returns new (q, k).
    ``q_out``/``k_out`` may be preallocated (same shapes); passing q and k themselves rotates in place."""
    positions, q_out, k_out = _rope_args(q, k, positions, cos_sin_cache, q_out, k_out)
    t, hq, d = q.shape
    hk = k.shape[1]
    if t > 0:
        half = d // 2
        block_half = triton.next_power_of_2(half)
        block_hq = triton.next_power_of_2(hq)
        _rope_kernel[(t,)](
            q, k, q_out, k_out, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half,
            BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=block_half,
            enable_fp_fusion=True, num_warps=warps_for(block_hq * block_half),
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _copy_heads(
    Src, row, stride_st, stride_sh, Dst, dst_row, stride_dt, stride_dh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    Scales=None, SCALED: tl.constexpr = False,
):  # fmt: skip
    """Dst[dst_row] := Src[row] ([heads, dim] each), converted to Dst's dtype (each head over its Scales
    first when SCALED)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(Src + row * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :], mask=mask)
    dst = Dst + dst_row * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, to_pool(scaled_down(x, Scales, offs_h, NUM_HEADS, SCALED), Dst.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KScales=None, VScales=None, KV_SCALED: tl.constexpr = False,  # [Hkv]: the pool stores K / k_scale, V / v_scale
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    _copy_heads(K, row, stride_kt, stride_kh, K_cache, slot, stride_kcs, stride_kch,
                NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, KScales, KV_SCALED)  # fmt: skip
    _copy_heads(V, row, stride_vt, stride_vh, V_cache, slot, stride_vcs, stride_vch,
                NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, VScales, KV_SCALED)  # fmt: skip


def _store_kv_args(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The KV store's argument checks (ValueError); slots, contiguous."""
    if k.dim() != 3:
        raise ValueError(f"k must be 3-D [T, Hkv, D], got shape {list(k.shape)}")
    t, hkv, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v has shape {list(v.shape)}, k {list(k.shape)}: expected the same")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 3 or x.shape[1:] != k.shape[1:]:
            raise ValueError(f"{name} has shape {list(x.shape)}, expected [S, {hkv}, {d}] (Hkv, D from k)")
    host_checks.check_pool_slots(k_cache, v_cache)
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in host_checks.POOL_DTYPES:
        raise ValueError(f"the pool is {k_cache.dtype} (K) and {v_cache.dtype} (V): expected one of "
                         f"{', '.join(map(str, host_checks.POOL_DTYPES))}")  # fmt: skip
    elsewhere = {
        n: x.device for n, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)) if x.device != k.device
    }
    if elsewhere:
        raise ValueError(f"k is on {k.device} but {elsewhere}")
    slots = host_checks.index_tensor("slots", slots, k.device, numel=t)
    host_checks.check_unit_stride(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    return slots


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kv_scales: host_checks.KVScales | None = None,
) -> None:  # fmt: skip
    """Write k, v [T, Hkv, D] into pool rows ``slots`` [T] of k_cache, v_cache [S, Hkv, D] (in place); an
    fp8 pool's ``kv_scales`` (K's, V's; host_checks.kv_scales): each value over its KV head's scale first
    (kernels.reference.store_kv).
    NOTE: slots must be distinct within one call (the pool allocator guarantees it)."""
    slots = _store_kv_args(k_cache, v_cache, slots, k, v)
    scaled = host_checks.kv_scale_args(kv_scales, k_cache)
    t, hkv, d = k.shape
    if t == 0:
        return
    block_h, block_d = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d, **scaled,
        enable_fp_fusion=True, num_warps=warps_for(block_h * block_d),
    )  # fmt: skip


@triton.jit
def _rope_store_kv_kernel(
    Q, K, V, Q_out, K_out, K_cache, V_cache, positions, slots, cos_sin_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_kot,
    stride_koh, stride_kcs, stride_kch, stride_vcs, stride_vch, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    KScales=None, VScales=None, KV_SCALED: tl.constexpr = False,  # [Hkv]: the pool stores K / k_scale, V / v_scale
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    cos, sin = _cos_sin(cos_sin_cache, pos, stride_cs, HALF, BLOCK_HALF)
    _rotate_heads(Q, Q_out, row, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    first, second, mask = _rotated(
        K, row, stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF
    )
    # NOTE: the pool gets the k returned, rounded to its dtype (once more, for an fp8 pool)
    first, second = first.to(K_out.dtype.element_ty), second.to(K_out.dtype.element_ty)
    _store_halves(K_out, row, stride_kot, stride_koh, first, second, mask, HALF, BLOCK_HK, BLOCK_HALF)
    _store_halves(K_cache, slot, stride_kcs, stride_kch, first, second, mask, HALF, BLOCK_HK, BLOCK_HALF,
                  KScales, NUM_K_HEADS, KV_SCALED)  # fmt: skip
    _copy_heads(V, row, stride_vt, stride_vh, V_cache, slot, stride_vcs, stride_vch,
                NUM_K_HEADS, HEAD_DIM, BLOCK_HK, BLOCK_D, VScales, KV_SCALED)  # fmt: skip


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope then store_kv of the rotated k and v, in one kernel: returns the rotated (q, k) and
    writes the rotated k and v into pool rows ``slots`` (``kv_scales``: store_kv's; the k returned is
    never scaled). Same checks and contracts as the two."""
    positions, q_out, k_out = _rope_args(q, k, positions, cos_sin_cache, q_out, k_out)
    slots = _store_kv_args(k_cache, v_cache, slots, k, v)
    scaled = host_checks.kv_scale_args(kv_scales, k_cache)
    t, hq, d = q.shape
    hk = k.shape[1]
    if t > 0:
        half, block_hq = d // 2, triton.next_power_of_2(hq)
        _rope_store_kv_kernel[(t,)](
            q, k, v, q_out, k_out, k_cache, v_cache, positions, slots, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half, HEAD_DIM=d, BLOCK_HQ=block_hq,
            BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(d), **scaled,
            enable_fp_fusion=True, num_warps=warps_for(block_hq * triton.next_power_of_2(half)),
        )  # fmt: skip
    return q_out, k_out
