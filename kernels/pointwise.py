"""Triton row-wise kernels of the dense layers: RMSNorm (alone, or with the residual add before it) and
the gated MLP's SiLU-and-multiply. One program per token row (and column block).

Semantics are kernels.reference.{rms_norm, add_rms_norm, silu_and_mul, gelu_tanh_and_mul,
clamped_swiglu_and_mul}; this module must never change them.
Shapes: x, delta [T, H] (or [..., H]); weight [H] (any strides, passed on contiguous); gate_up [T, 2I].
All math in fp32, results in the input's dtype; shapes, dtypes and devices are checked from metadata
(ValueError).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested, reference

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()


def warps_for(elements: int) -> int:
    """Warps for a program that touches ``elements`` values (one in the interpreter)."""
    return 1 if INTERPRETED else min(16, max(1, elements // 512))


@triton.jit
def _store_rms_normed(Out, row, stride_o, x, W, offs, mask, eps, H: tl.constexpr):
    """Row ``row`` of Out := x / rms(x) * W (x: the row in fp32)."""
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(Out + row * stride_o + offs, (x * inv_rms * w).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, eps, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _store_rms_normed(Out, row, stride_o, x, W, offs, mask, eps, H)


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
    _store_rms_normed(Out, row, stride_o, total.to(tl.float32), W, offs, mask, eps, H)


def _contiguous_out(name: str, out: torch.Tensor | None, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """A preallocated output (checked: ``like``'s shape, dtype, device; contiguous), or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    host_checks.check_out(name, out, like, like_name)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return out


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] as [rows, H] with unit stride along H, after checking that the norm's weight is [H]
    on x's device (callers pass it on contiguous: the kernels read it as W + offs)."""
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight has shape {list(weight.shape)}, expected [{h}] (x's last dim)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    x2 = x.reshape(-1, h)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., H] -> x / rms(x) * weight [H] over the last dim, in x's dtype; ``out`` (contiguous, x's
    shape and dtype) may be preallocated."""
    h = x.shape[-1]
    x2 = _rows(x, weight)
    out = _contiguous_out("out", out, x, "x")
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out, x2.stride(0), h, eps,
            H=h, BLOCK=block, enable_fp_fusion=True, num_warps=warps_for(block),
        )  # fmt: skip
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
    if delta.shape != x.shape or delta.dtype != x.dtype or delta.device != x.device:
        raise ValueError(
            f"delta is {delta.dtype} {list(delta.shape)} on {delta.device}; expected x's {x.dtype} "
            f"{list(x.shape)} on {x.device}"
        )
    h = x.shape[-1]
    x2, d2 = _rows(x, weight), _rows(delta, weight)
    total = _contiguous_out("out[0]", None if out is None else out[0], x, "x")
    normed = _contiguous_out("out[1]", None if out is None else out[1], x, "x")
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(h)
        _add_rms_norm_kernel[(x2.shape[0],)](
            x2, d2, weight.contiguous(), total, normed, x2.stride(0), d2.stride(0), h, h, eps,
            H=h, BLOCK=block, enable_fp_fusion=True, num_warps=warps_for(block),
        )  # fmt: skip
    return total, normed


SILU_BLOCK = 1024  # columns per program


@triton.jit
def _gate_and_up(X, stride_x, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """This program's row, column offsets and mask, and its gate and up values (fp32)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    return row, offs, mask, gate, up


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row, offs, mask, gate, up = _gate_and_up(X, stride_x, INTER, BLOCK)
    tl.store(Out + row * stride_o + offs, (gate * tl.sigmoid(gate) * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_and_mul_kernel(X, Out, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr):
    row, offs, mask, gate, up = _gate_and_up(X, stride_x, INTER, BLOCK)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (x + 0.044715 x^3)
    gelu = 0.5 * gate * (2.0 * tl.sigmoid(2.0 * inner))  # NOTE: 1 + tanh(x) = 2 sigmoid(2x)
    tl.store(Out + row * stride_o + offs, (gelu * up).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_and_mul_kernel(
    X, Out, stride_x, stride_o, alpha, limit, INTER: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row, offs, mask, gate, up = _gate_and_up(X, stride_x, INTER, BLOCK)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], in gate_up's dtype: a gated MLP's
    activation in one kernel instead of two. ``out`` [T, I] may be preallocated (contiguous)."""
    return _gated(gate_up, out, _silu_and_mul_kernel, "silu(gate) * up")


def gelu_tanh_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU), as silu_and_mul."""
    return _gated(gate_up, out, _gelu_tanh_and_mul_kernel, "gelu(gate) * up")


def clamped_swiglu_and_mul(
    gate_up: torch.Tensor, alpha: float, limit: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """gate_up [T, 2I] -> gpt-oss's clamped SwiGLU [T, I] (kernels.reference.clamped_swiglu_and_mul), as
    silu_and_mul."""
    return _gated(gate_up, out, _clamped_swiglu_and_mul_kernel, "clamped swiglu", float(alpha), float(limit))


def gated_activation(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """kernels.reference.gated_activation's choice, on these kernels."""
    return reference.gated_activation(gate_up, activation, alpha, limit, impl=sys.modules[__name__])


def _gated(
    gate_up: torch.Tensor, out: torch.Tensor | None, kernel: object, what: str, *scalars: float
) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {list(gate_up.shape)}")
    host_checks.check_unit_stride(gate_up=gate_up)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = _contiguous_out("out", out, gate_up[:, :inter], what)
    if t > 0:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        kernel[(t, triton.cdiv(inter, block))](  # type: ignore[index]
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            *scalars,
            INTER=inter,
            BLOCK=block,
            enable_fp_fusion=True,
            num_warps=warps_for(block),
        )
    return out
