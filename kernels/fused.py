"""Triton RMSNorm (alone, or after the residual add), SiLU-and-multiply, rotary embedding (NeoX /
HF-Llama halves) and KV-store into the paged pool.

Semantics are kernels.reference.{rms_norm, add_rms_norm, silu_and_mul, apply_rope, store_kv}; this module
must never change them.
Shapes: x, delta [T, H] (or [..., H]); gate_up [T, 2I]; q [T, Hq, D], k [T, Hkv, D]; positions [T];
cos_sin_cache [max_pos, D] with cos in [:, :D/2] and sin in [:, D/2:]; k_cache, v_cache [S, Hkv, D];
slots [T] (pool row per token). All math in fp32, results in the input's (or the pool's) dtype.
weight [H] (any strides), index tensors (int32/int64, any strides) are passed on contiguous; shapes, dtypes
and devices are checked from metadata (ValueError).
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

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()


def _warps_for(elements: int) -> int:
    return 1 if INTERPRETED else min(16, max(1, elements // 512))


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, eps, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(Out + row * stride_o + offs, (x * inv_rms * w).to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., H] -> x / rms(x) * weight [H] over the last dim, in x's dtype; ``out`` (contiguous, x's
    shape and dtype) may be preallocated."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight has shape {list(weight.shape)}, expected [{h}] (x's last dim)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    weight = weight.contiguous()  # NOTE: the kernel reads it as W + offs; free when already contiguous
    if out is not None:
        host_checks.check_out("out", out, x, "x")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = out.view(-1, h)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, x2.stride(0), out.stride(0), eps, H=h, BLOCK=block, num_warps=_warps_for(block)
        )
    return out.reshape(x.shape)


@triton.jit
def _add_rms_norm_kernel(
    X, Delta, W, Sum, Out, stride_x, stride_d, stride_s, stride_o, eps, H: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(Delta + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
    total = (x + d).to(Sum.dtype.element_ty)  # NOTE: the norm reads the sum as stored, as unfused code would
    tl.store(Sum + row * stride_s + offs, total, mask=mask)
    total = total.to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(total * total, 0) / H + eps)
    tl.store(Out + row * stride_o + offs, (total * inv_rms * w).to(Out.dtype.element_ty), mask=mask)


def _contiguous_out(name: str, out: torch.Tensor | None, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """A preallocated output (checked: ``like``'s shape, dtype, device; contiguous), or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    host_checks.check_out(name, out, like, like_name)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, normed): total = x + delta [..., H] in x's dtype (the residual stream after a sublayer),
    normed = rms_norm(total, weight, eps) (the next sublayer's input); one pass over both inputs.
    ``out`` (total, normed) may be preallocated: contiguous, x's shape and dtype."""
    h = x.shape[-1]
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(
            f"delta is {delta.dtype} {list(delta.shape)} on {delta.device}; expected x's {x.dtype} "
            f"{list(x.shape)} on {x.device}"
        )
    if weight.shape != (h,) or weight.device != x.device:
        raise ValueError(f"weight is {list(weight.shape)} on {weight.device}, expected [{h}] on {x.device}")
    x2, d2 = x.reshape(-1, h), delta.reshape(-1, h)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    d2 = d2 if d2.stride(-1) == 1 else d2.contiguous()
    total = _contiguous_out("out[0]", None if out is None else out[0], x, "x")
    normed = _contiguous_out("out[1]", None if out is None else out[1], x, "x")
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(h)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight.contiguous(), total, normed, x2.stride(0), d2.stride(0), h, h, eps,
            H=h, BLOCK=block, num_warps=_warps_for(block),
        )  # fmt: skip
    return total, normed


SILU_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (gate * tl.sigmoid(gate) * up).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], in gate_up's dtype: a gated MLP's
    activation in one kernel instead of two. ``out`` [T, I] may be preallocated (contiguous)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {list(gate_up.shape)}")
    host_checks.check_unit_stride(gate_up=gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _contiguous_out("out", out, gate_up[:, :inter], "silu(gate) * up")
    if t > 0:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            INTER=inter,
            BLOCK=block,
            num_warps=_warps_for(block),
        )
    return out


@triton.jit
def _rotate_heads(
    X, Out, row, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    src = X + row * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = Out + row * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Q_out, K_out, positions, cos_sin_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_sin_cache + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    _rotate_heads(Q, Q_out, row, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(K, K_out, row, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


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
            num_warps=_warps_for(block_hq * block_half),
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _store_kv_kernel(
    K, V, K_cache, V_cache, slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + row).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + row * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + row * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = K_cache + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = V_cache + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(V_cache.dtype.element_ty), mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into pool rows ``slots`` [T] of k_cache, v_cache [S, Hkv, D] (in place).
    NOTE: slots must be distinct within one call (the pool allocator guarantees it)."""
    if k.dim() != 3:
        raise ValueError(f"k must be 3-D [T, Hkv, D], got shape {list(k.shape)}")
    t, hkv, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v has shape {list(v.shape)}, k {list(k.shape)}: expected the same")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 3 or x.shape[1:] != k.shape[1:]:
            raise ValueError(f"{name} has shape {list(x.shape)}, expected [S, {hkv}, {d}] (Hkv, D from k)")
    elsewhere = {
        n: x.device for n, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)) if x.device != k.device
    }
    if elsewhere:
        raise ValueError(f"k is on {k.device} but {elsewhere}")
    slots = host_checks.index_tensor("slots", slots, k.device, numel=t)
    host_checks.check_unit_stride(k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    if t == 0:
        return
    block_h, block_d = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=hkv, HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=_warps_for(block_h * block_d),
    )  # fmt: skip
