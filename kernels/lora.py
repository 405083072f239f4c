"""Triton LoRA deltas for a batch that mixes adapters: every adapter's rows in two launches.

Semantics are kernels.reference.lora_add; this module must never change them.
Shapes (T = rows of the batch, n = segments: the worker's are reference.lora_segments'; S = adapter slots;
R = the stack's rank):
  x [T, K]; out [T, N] (the base projection of x, updated in place); a [S, R, K]; b [S, N, R];
  seg_indptr [n+1]: segment i owns rows seg_indptr[i]:seg_indptr[i+1];
  seg_slots [n]: segment i's slot in a / b, or -1 for rows the delta leaves alone (the base model's).
Segment i's rows gain (x @ a[s]^T) @ b[s]^T. Math in fp32; the [rows, R] product is rounded to x's dtype
between the two launches (as two matmuls in x's dtype would round it), out keeps its dtype.

The first launch ("shrink", grid: segment x row block x K split; K is split only when there are few
rows, as in a decode step) writes each K split's partial x @ a[s]^T in fp32; the second ("expand", grid: segment x row block x N block) sums the splits and adds
the product with b[s] to out. Two launches whatever the number of adapters in the batch, and the grid
depends on the batch's shape only (n, ``max_rows``), not on which adapters it holds: a decode step of
one row per request replays in a CUDA graph with new slots written into the same buffers.
LoraConfig.pdl (sm_90's default) launches both as programmatic dependents (kernels/pdl.py): the shrink
waits for the kernel before (the base projection) and lets the expand launch, and the expand loads its b
tile (weights, not written by either) before it waits for the shrink's partials.
LoraConfig.batched_partials has the expand load the partials SPLIT_STEP splits at a time, issued with b
and its rows of out, instead of one split a load before them (fewer round trips in a row, more
registers; off: slower on an H100 from 16 requests).
CALLER CONTRACTS, NOT CHECKED ON CUDA (checking needs the index data: a device-to-host sync):
  - seg_indptr is non-decreasing within [0, T]; no segment has more than ``max_rows`` rows (the
    reference gives rows past it no delta; the kernels' blocks cover ``max_rows`` rounded up to their
    16 rows, so such rows may get one: a segment past the bound is the caller's error);
  - every slot is -1 or in [0, S).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested
from kernels.extend_attention import device_arch
from kernels.pdl import pdl_active, pdl_launch, wait_then_release
from kernels.reference import LORA_BLOCK_ROWS

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()

# rows a program takes (16: tl.dot's smallest M; reference.lora_segments packs a run's rows by it)
BLOCK_M = LORA_BLOCK_ROWS
BLOCK_K = 64  # x columns per step of the shrink's loop
K_PER_SPLIT = 512  # at least this many x columns per shrink program
MAX_SPLITS = 32
TARGET_PROGRAMS = 512  # shrink programs worth having: enough to spread a decode step over the SMs
BLOCK_N = 128  # out columns per expand program before Hopper (32 in fp32, whose FMA dot spills at 128)
# NOTE: on sm_90 (16-bit) the expand's programs take 256 columns and both kernels launch as programmatic
# dependents: 1.13-1.18x the 128-column kernels without PDL over kernels.bench's six LoRA rows (1-64
# requests, 1 and 4 adapters) on an H100, and faster than 256 columns without PDL on all six
# (docs/benchmarks/gpu-nvidia-h100.md); before Hopper neither was measured (PDL needs sm_90).
HOPPER_BLOCK_N = 256
SPLIT_STEP = 8  # shrink splits a load of LoraConfig.batched_partials (a decode step's K of 4096 has 8)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The shrink's least x columns per split program and the expand's out columns per program."""

    k_per_split: int
    block_n: int
    pdl: bool = False  # programmatic dependent launch on sm_90+ (compiled only; ignored elsewhere)
    # the expand loads the shrink's partials SPLIT_STEP splits a load, beside b and its rows of out,
    # instead of one split a load before them: fewer round trips in a row, more registers (compile_check)
    batched_partials: bool = False


def default_config(dtype: torch.dtype, arch: int = 90) -> LoraConfig:
    """For compute capability ``arch`` (x10): K_PER_SPLIT, and 32 out columns a program in fp32; in 16 bits
    HOPPER_BLOCK_N launched as programmatic dependents from sm_90, else BLOCK_N. python -m kernels.tune
    times the others."""
    if dtype == torch.float32:
        return LoraConfig(k_per_split=K_PER_SPLIT, block_n=32)
    if arch >= 90:
        return LoraConfig(k_per_split=K_PER_SPLIT, block_n=HOPPER_BLOCK_N, pdl=True)
    return LoraConfig(k_per_split=K_PER_SPLIT, block_n=BLOCK_N)


@triton.jit
def _segment_block(SEG_INDPTR, SEG_SLOTS, seg, block, R, BLOCK_M: tl.constexpr):
    """Row block ``block`` of segment ``seg``: its slot (0 for -1, a valid address), its rows (int64)
    and their mask, and the rank its weights are read to (0 for slot -1: a base segment's program
    loads no weights and stores nothing)."""
    slot = tl.load(SEG_SLOTS + seg).to(tl.int64)
    start = tl.load(SEG_INDPTR + seg).to(tl.int64)
    end = tl.load(SEG_INDPTR + seg + 1).to(tl.int64)
    rows = start + block * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.maximum(slot, 0), rows, rows < tl.where(slot >= 0, end, start), tl.where(slot >= 0, R, 0)


@triton.jit
def _shrink_kernel(
    X, A, Partial, SEG_INDPTR, SEG_SLOTS, K, R, stride_xt, stride_as, stride_ar, stride_pk, stride_pt,
    COLS_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # NOTE: x comes from the kernel before; the expand may launch once every program has waited
        wait_then_release()
    seg, block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, rows, row_mask, rank = _segment_block(SEG_INDPTR, SEG_SLOTS, seg, block, R, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(split * COLS_PER_SPLIT, tl.minimum(K, (split + 1) * COLS_PER_SPLIT), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(
            X + rows[:, None] * stride_xt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        a = tl.load(A + slot * stride_as + r[None, :] * stride_ar + ks[:, None],
                    mask=(r[None, :] < rank) & k_mask[:, None], other=0.0)  # fmt: skip
        if DOT_FP32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION, out_dtype=tl.float32)
    dst = Partial + split * stride_pk + rows[:, None] * stride_pt + r[None, :]
    tl.store(dst, acc, mask=row_mask[:, None] & (r[None, :] < R))


@triton.jit
def _expand_kernel(
    Partial, B, Out, SEG_INDPTR, SEG_SLOTS, N, R, SPLITS, stride_pk, stride_pt, stride_bs, stride_bn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, PDL: tl.constexpr, BATCHED: tl.constexpr, SPLIT_STEP: tl.constexpr,
):  # fmt: skip
    seg, block, col_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, rows, row_mask, rank = _segment_block(SEG_INDPTR, SEG_SLOTS, seg, block, R, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    b_ptrs = B + slot * stride_bs + cols[None, :] * stride_bn + r[:, None]
    b_mask = (r[:, None] < rank) & col_mask[None, :]
    if PDL:  # NOTE: the segments and b were written before the shrink began, the partials only past the wait
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        tl.extra.cuda.gdc_wait()
    if BATCHED:
        # NOTE: the first SPLIT_STEP splits' partials (one load, summed within each thread: the splits are
        # the tile's outer dimension), the rows of out and b all issued before any is used, then any
        # further partials a step at a time
        first = _partials_step(Partial, 0, SPLITS, rows, row_mask, r, R, stride_pk, stride_pt, SPLIT_STEP)
        dst = Out + rows[:, None] * stride_ot + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(dst, mask=mask, other=0.0)
        if not PDL:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        y = tl.sum(first, 0)
        for s0 in range(SPLIT_STEP, SPLITS, SPLIT_STEP):
            y += tl.sum(_partials_step(Partial, s0, SPLITS, rows, row_mask, r, R, stride_pk, stride_pt,
                                       SPLIT_STEP), 0)  # fmt: skip
    else:
        y = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        y_mask = row_mask[:, None] & (r[None, :] < R)
        for split in range(0, SPLITS):
            y += tl.load(
                Partial + split * stride_pk + rows[:, None] * stride_pt + r[None, :], mask=y_mask, other=0.0
            )
        if not PDL:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    # NOTE: the product is rounded to the inputs' dtype, as x @ a^T computed in that dtype would be
    y = y.to(B.dtype.element_ty)
    if DOT_FP32:
        y, b = y.to(tl.float32), b.to(tl.float32)
    delta = tl.dot(y, b, input_precision=PRECISION, out_dtype=tl.float32)
    if not BATCHED:
        dst = Out + rows[:, None] * stride_ot + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        base = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (base.to(tl.float32) + delta).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _partials_step(Partial, s0, SPLITS, rows, row_mask, r, R, stride_pk, stride_pt, SPLIT_STEP: tl.constexpr):
    """The shrink's partials of splits s0 .. s0 + SPLIT_STEP - 1 for a row block: [SPLIT_STEP, BLOCK_M,
    BLOCK_R] fp32, zeros at splits past SPLITS, rows past the segment and ranks past R."""
    splits = s0 + tl.arange(0, SPLIT_STEP)
    return tl.load(Partial + splits[:, None, None] * stride_pk + rows[None, :, None] * stride_pt + r[None, None, :],
                   mask=(splits < SPLITS)[:, None, None] & row_mask[None, :, None] & (r < R)[None, None, :],
                   other=0.0)  # fmt: skip


def split_k(k: int, row_programs: int, k_per_split: int = K_PER_SPLIT) -> tuple[int, int]:
    """(splits, columns per split, a multiple of BLOCK_K) of the shrink's K for a grid of
    ``row_programs`` (segment, row block) pairs, each split at least ``k_per_split`` columns: few rows
    (decode) split K to fill the GPU; many rows (a prefill) need no split, and each split costs the
    expand a read of the partials per column block."""
    most = min(MAX_SPLITS, triton.cdiv(k, k_per_split), triton.cdiv(TARGET_PROGRAMS, max(1, row_programs)))
    per_split = triton.cdiv(triton.cdiv(k, max(1, most)), BLOCK_K) * BLOCK_K
    return triton.cdiv(k, per_split), per_split


def _partials(*shape: int, device: torch.device) -> torch.Tensor:
    """The shrink's fp32 output [splits, T, R] (every element the expand reads is written first)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _check(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"x [T, K], out [T, N], a [S, R, K] and b [S, N, R] expected, got x {host_checks.shape_of(x)}, "
            f"out {host_checks.shape_of(out)}, a {host_checks.shape_of(a)}, b {host_checks.shape_of(b)}"
        )
    (t, k), (s, r, _) = x.shape, a.shape
    if out.shape[0] != t or a.shape[2] != k or b.shape != (s, out.shape[1], r):
        raise ValueError(
            f"shapes do not agree: x {host_checks.shape_of(x)}, out {host_checks.shape_of(out)}, "
            f"a {host_checks.shape_of(a)}, b {host_checks.shape_of(b)}"
        )
    if len({x.dtype, out.dtype, a.dtype, b.dtype}) != 1 or x.dtype not in host_checks.ATTENTION_DTYPES:
        raise ValueError(f"x, out, a and b must share one of fp16/bf16/fp32, got {x.dtype}, {out.dtype}, "
                         f"{a.dtype}, {b.dtype}")  # fmt: skip
    if len({x.device, out.device, a.device, b.device}) != 1:
        raise ValueError("x, out, a and b must be on one device")
    if out.stride(-1) != 1:
        raise ValueError("out must be contiguous in its last dim (it is updated in place)")


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_rows: int,
    config: LoraConfig | None = None,
) -> torch.Tensor:
    """``out`` with each segment's LoRA delta added (in place; returned). See the module docstring.
    ``config``: default_config for x's dtype and device when None."""
    _check(x, out, a, b)
    n = seg_slots.numel()
    seg_slots = host_checks.index_tensor("seg_slots", seg_slots, x.device)
    seg_indptr = host_checks.index_tensor("seg_indptr", seg_indptr, x.device, n + 1)
    (t, k), (_, r, _), n_cols = x.shape, a.shape, out.shape[1]
    if n == 0 or t == 0 or max_rows <= 0 or r == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    block_r = max(16, triton.next_power_of_2(r))
    row_blocks = triton.cdiv(max_rows, BLOCK_M)
    arch = device_arch(x.device)
    cfg = config or default_config(x.dtype, arch)
    pdl = pdl_active(cfg.pdl, arch)
    splits, per_split = split_k(k, n * row_blocks, cfg.k_per_split)
    partial = _partials(splits, t, r, device=x.device)
    common = {
        "BLOCK_M": BLOCK_M,
        "BLOCK_R": block_r,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "DOT_FP32": INTERPRETED and x.dtype == torch.bfloat16,
        "PDL": pdl,
        "enable_fp_fusion": True,
        "num_warps": 1 if INTERPRETED else 4,
        **pdl_launch(pdl),
    }
    _shrink_kernel[(n, row_blocks, splits)](
        x, a, partial, seg_indptr, seg_slots, k, r, x.stride(0), a.stride(0), a.stride(1),
        partial.stride(0), partial.stride(1),
        COLS_PER_SPLIT=per_split, BLOCK_K=BLOCK_K, **common,
    )  # fmt: skip
    _expand_kernel[(n, row_blocks, triton.cdiv(n_cols, cfg.block_n))](
        partial, b, out, seg_indptr, seg_slots, n_cols, r, splits, partial.stride(0), partial.stride(1),
        b.stride(0), b.stride(1), out.stride(0),
        BLOCK_N=cfg.block_n, BATCHED=cfg.batched_partials, SPLIT_STEP=SPLIT_STEP, **common,
    )  # fmt: skip
    return out
