"""Triton top-p (nucleus) threshold without sorting the vocabulary: one program per row.

Semantics are kernels.reference.top_p_threshold; this module must never change them.
Shapes: probs [B, V] float32 (each row a distribution: non-negative, summing to ~1), top_p [B]
float32 in (0, 1]. Output [B] float32: each row's threshold t, the smallest probability the nucleus
keeps. Keeping the tokens with p >= t keeps exactly what sorting the row and keeping each token
whose higher-ranked tokens hold less than top_p would keep, ties at t aside (all of them stay).

How: for non-negative float32 values the order of the bit patterns is the order of the values, so
a bisection over the int32 bit patterns in [0, bits(max p)] finds the largest value x with
mass(p >= x) >= top_p in 31 steps, each a pass over the row (from L2 after the first). That x is
one of the row's probabilities. A sort of a 128k-token vocabulary per row is the alternative.
Sums are fp32 in a different order than a sort's cumulative sum: a row whose mass lands within
rounding of top_p at some token may keep one token more or less than the sort would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpret_requested

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
_STEPS = 31  # bisection steps: bit patterns of [0, 1.0] span fewer than 2**30 values


@triton.jit
def _mass_at_least(row_ptr, vocab, x, BLOCK: tl.constexpr):
    """Sum of the row's probabilities >= x (fp32)."""
    offs = tl.arange(0, BLOCK)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        p = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=0.0)
        mass += tl.where(p >= x, p, 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _top_p_threshold_kernel(Probs, TopP, Out, vocab, stride_b, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = Probs + row.to(tl.int64) * stride_b
    top_p = tl.load(TopP + row)
    offs = tl.arange(0, BLOCK)
    biggest = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        biggest = tl.maximum(biggest, tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=0.0))
    # NOTE: invariant: mass(p >= value(lo)) >= top_p (lo = 0 keeps every token), the answer in [lo, hi]
    lo = tl.zeros([], dtype=tl.int32)
    hi = tl.max(biggest, 0).to(tl.int32, bitcast=True)
    for _ in range(STEPS):
        mid = lo + (hi - lo + 1) // 2
        ok = _mass_at_least(row_ptr, vocab, mid.to(tl.float32, bitcast=True), BLOCK) >= top_p
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    tl.store(Out + row, lo.to(tl.float32, bitcast=True))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """See the module docstring. Raises ValueError on shapes, dtypes or devices that do not fit."""
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be [B, V] float32, got {probs.dtype} {list(probs.shape)}")
    if top_p.shape != (probs.shape[0],) or top_p.dtype != torch.float32 or top_p.device != probs.device:
        raise ValueError(
            f"top_p must be [{probs.shape[0]}] float32 on {probs.device}, got {top_p.dtype} "
            f"{list(top_p.shape)} on {top_p.device}"
        )
    probs = probs if probs.stride(-1) == 1 else probs.contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device)
    if probs.shape[0] == 0 or probs.shape[1] == 0:
        return out.zero_()
    block = 64 if INTERPRETED else 4096
    _top_p_threshold_kernel[(probs.shape[0],)](
        probs, top_p.contiguous(), out, probs.shape[1], probs.stride(0), BLOCK=block, STEPS=_STEPS,
        enable_fp_fusion=True, num_warps=1 if INTERPRETED else 8,
    )  # fmt: skip
    return out
