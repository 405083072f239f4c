"""Triton mixture-of-experts MLP: every token's top-k experts in two grouped GEMM launches.

Semantics are kernels.reference.fused_moe; this module must never change them.
Shapes (T = tokens, H = hidden size, E = experts, I = one expert's intermediate size, K = experts a token):
  x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
  topk_weights [T, K] (fp32), topk_ids [T, K] (ints in [0, E)): token t's output is
  sum_j topk_weights[t, j] * w2[e] @ (silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j]; with the experts'
  biases b13 [E, 2I] and b2 [E, H] (gpt-oss) added to each product, and another gated activation by name.
  w13 / w2 may be MXFP4 (gpt-oss as released): uint8 codes [E, 2I, H/2] / [E, H, I/2], two values a byte,
  with uint8 scales [E, 2I, H/32] / [E, H, I/32], decoded tile by tile inside the GEMMs; or fp8 (an fp8
  checkpoint's experts, --fp8-weights): float8_e4m3fn / float8_e5m2 [E, 2I, H] / [E, H, I] with float32
  scales, one a ``fp8_block`` block of each expert's weight or one a row ([E, N, 1]), each tile widened
  to x's dtype and each step's product times its blocks' scales (as kernels.fp8_linear does); with
  ``fp8_activations`` each GEMM's input quantized per token group first and multiplied fp8 by fp8.
Math in fp32; the gate/up product and its activation are rounded to x's dtype between the launches (as
the same matmuls in x's dtype would round them), the K expert outputs are summed in fp32.

``moe_route`` is the router's choice, one program a token. ``moe_align`` sorts the T*K (token, expert)
pairs by expert into blocks of BLOCK_M pairs that share one expert (each expert's run padded to whole
blocks), one program for up to ALIGN_KERNEL_MAX_PAIRS pairs. A GEMM program takes one block and one
tile of output columns, reading its expert's weight tile once for all of the block's pairs. The first
GEMM reads x's row of each pair (row pair // K) and writes [T*K, 2I]; the activation (kernels.pointwise's)
makes [T*K, I]; the second GEMM multiplies by each pair's routing weight and writes [T*K, H] in fp32,
which is summed over K. The grid is the worst case's, (T*K + E*(BLOCK_M - 1)) / BLOCK_M blocks: programs
past the last expert's blocks load nothing and store nothing, so the launches depend on T alone and
replay in a CUDA graph (no host sync anywhere).
CALLER CONTRACT, NOT CHECKED ON CUDA (checking needs the data: a device-to-host sync): every topk_ids
entry is in [0, E).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested, pointwise, reference
from kernels.fp8_linear import (
    quantize_by,
    quantize_fp8_groups,
    quantize_fp8_static,
    quantize_rows,
    quantizes_inside,
    static_input_scale,
    step_for,
)

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Pairs a block holds (one expert's), output columns and reduction columns a program's step takes."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# moe_align runs as one Triton program up to this many (token, expert) pairs and experts (a decode step of
# 256 requests at 8 experts a token is 2,048), as torch ops past them
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_KERNEL_MAX_EXPERTS = 1024
# the tiles kernels.bench_moe times beside the default on every row (kernels.compile_check --candidates
# compiles them): decode-sized blocks with wider or deeper steps, and larger blocks for prefills
CANDIDATES = {
    "m16 n64 k128": MoeConfig(block_m=16, block_n=64, block_k=128),
    "m16 n128 k128": MoeConfig(block_m=16, block_n=128, block_k=128),
    "m16 n64 k256 s4": MoeConfig(block_m=16, block_n=64, block_k=256, num_stages=4),
    "m32 n64 k128": MoeConfig(block_m=32, block_n=64, block_k=128),
    "m64 n64 k64": MoeConfig(block_m=64, block_n=64, block_k=64),
    "m64 n128 k64 w8": MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8),
    "m128 n128 k64 w8": MoeConfig(block_m=128, block_n=128, block_k=64, num_warps=8),
    "m64 n256 k64 w8": MoeConfig(block_m=64, block_n=256, block_k=64, num_warps=8),
}


def default_config(pairs: int, experts: int, mxfp4: bool = False) -> MoeConfig:
    """Small blocks when experts see few pairs each (decode: the weights' reads are the cost, and a
    block's padding is wasted work), larger ones in a prefill. ``mxfp4``: MXFP4 weights, whose decoded
    tile lives in registers: 32-deep steps, one block of scales a step, applied to the step's product
    (sm_90, bf16, kernels.compile_check: the decode tiles take 64-72 registers with Triton 3.9 and 96 with
    3.6, against 128 and 245-250 at 64 deep, which decodes each value with its scale; the prefill tiles
    153-159 and 187-193, against 151-182 and 255 spilling 32-48 B on 3.6). Not yet timed on a GPU
    (kernels.bench_moe times 32, 64 and 128 deep on every MXFP4 row)."""
    if INTERPRETED:
        return MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=1, num_stages=1)
    cfg = CANDIDATES["m16 n64 k128" if pairs <= 2 * experts else "m64 n128 k64 w8"]
    return dataclasses.replace(cfg, block_k=32) if mxfp4 else cfg


def _aligned_size(pairs: int, experts: int, block_m: int) -> int:
    """moe_align's P: room for every pair and each expert's last block's padding, in whole blocks."""
    return triton.cdiv(pairs + experts * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P] int32, block_experts [P / block_m] int32) for the T*K pairs of ``topk_ids``
    (pair p is token p // K's choice p % K): each expert's pairs in order, starting at a multiple of
    ``block_m``, the rest of its last block holding T*K (no pair); block_experts[b] is block b's expert,
    -1 past the last used block. P = T*K + E*(block_m - 1) rounded up to block_m, whatever the ids.
    Up to ALIGN_KERNEL_MAX_PAIRS pairs (decode steps, short extends: what CUDA graphs replay) one Triton
    program does it all; past that, torch ops (moe_align_torch: the same output, ~25 kernels)."""
    n = topk_ids.numel()
    if n > ALIGN_KERNEL_MAX_PAIRS or experts > ALIGN_KERNEL_MAX_EXPERTS:
        return moe_align_torch(topk_ids, experts, block_m)
    size = _aligned_size(n, experts, block_m)
    ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_pairs = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    block_e = max(16, triton.next_power_of_2(experts))
    _align_kernel[(1,)](
        ids, sorted_pairs, block_experts, n, size, size // block_m, experts,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(128, 4096 // block_e)),
        num_warps=1 if INTERPRETED else 4, enable_fp_fusion=True,
    )  # fmt: skip
    return sorted_pairs, block_experts


def moe_align_torch(topk_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align in torch ops that never sync (a scatter-add for the counts, a stable argsort, a
    searchsorted for each block's expert)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # NOTE: not bincount, which syncs for its size
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)  # pair numbers grouped by expert, in order within each
    by_expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[by_expert]
    size = _aligned_size(n, experts, block_m)
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=flat.device)
    sorted_pairs[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=flat.device)
    owner = torch.searchsorted(ends, starts, right=True)  # NOTE: empty experts end where the one before does
    return sorted_pairs, torch.where(owner < experts, owner, -1).to(torch.int32)


@triton.jit
def _align_kernel(
    IDS, SORTED, BLOCK_EXPERTS, N, P, NUM_BLOCKS, E,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """moe_align in one program: the experts' counts, their padded runs (a cumsum), then each pair's
    place (its expert's start, the pairs of that expert in earlier chunks, and those before it in its
    chunk), the padding's sentinel and each block's expert. Every element is written exactly once."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, N, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(IDS + i, mask=i < N, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)  # each expert's pairs placed so far
    for c0 in range(0, N, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(IDS + i, mask=i < N, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, 0) - onehot  # pairs of the same expert earlier in this chunk
        dest = tl.sum(onehot * (starts + seen)[None, :] + onehot * before, 1)
        tl.store(SORTED + dest, i, mask=i < N)
        seen += tl.sum(onehot, 0)
    filled = starts + counts  # the first padding position of each run
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        owner = ((p[:, None] >= starts[None, :]) & (p[:, None] < ends[None, :])).to(tl.int32)
        first_pad = tl.sum(owner * filled[None, :], 1)  # 0 past the last run: all padding
        tl.store(SORTED + p, N, mask=(p < P) & (p >= first_pad))
    for b0 in range(0, NUM_BLOCKS, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        start = b * BLOCK_M
        owner = ((start[:, None] >= starts[None, :]) & (start[:, None] < ends[None, :])).to(tl.int32)
        expert = tl.where(tl.sum(owner, 1) > 0, tl.sum(owner * experts[None, :], 1), -1)
        tl.store(BLOCK_EXPERTS + b, expert, mask=b < NUM_BLOCKS)


@triton.jit
def _route_kernel(
    LOGITS, WEIGHTS, IDS, E, stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One token's softmax over the experts and its TOP_K largest (the lowest index among equals first)."""
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(LOGITS + t * stride_l + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = probs / tl.sum(probs, 0)
    k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, experts, BLOCK_E), 0)
        weights = tl.where(k == j, best, weights)
        ids = tl.where(k == j, idx, ids)
        probs = tl.where(experts == idx, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(WEIGHTS + t * TOP_K + k, weights, mask=k < TOP_K)
    tl.store(IDS + t * TOP_K + k, ids, mask=k < TOP_K)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.reference.moe_route in one launch: (topk_weights [T, K] float32, topk_ids [T, K] int32)."""
    if router_logits.dim() != 2 or not 0 < top_k <= router_logits.shape[1]:
        raise ValueError(
            f"router_logits [T, E] and 0 < top_k <= E expected, got {host_checks.shape_of(router_logits)}, {top_k}"
        )
    t, e = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_E=max(16, triton.next_power_of_2(e)), BLOCK_K=max(2, triton.next_power_of_2(top_k)),
            num_warps=1 if INTERPRETED else 4, enable_fp_fusion=True,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _e2m1(code):
    """The float32 value of 4-bit E2M1 codes (sign, 2 exponent bits, 1 mantissa bit; no infinities)."""
    exponent = ((code >> 1) & 3).to(tl.float32)
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0.0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2(exponent - 1.0))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _grouped_gemm_kernel(
    A, W, C, SORTED, BLOCK_EXPERTS, PAIR_WEIGHTS, PAIRS, N, KDIM, stride_a, stride_we, stride_wn, stride_c,
    TOP_K: tl.constexpr, ROW_PER_TOKEN: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong
    Bias=None, stride_be=0, HAS_BIAS: tl.constexpr = False,
    Scales=None, stride_se=0, stride_sn=0, MXFP4: tl.constexpr = False,
    stride_sk=0, scale_rows=1, scale_cols=1, FP8: tl.constexpr = False,
    AScales=None, stride_as=0, A_FP8: tl.constexpr = False,
    QUANTIZE_A: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0, A_STATIC: tl.constexpr = False,
):  # fmt: skip
    """C[pair, n] = A[row] . W[expert, n] (+ Bias[expert, n] when HAS_BIAS; the sum times the pair's
    weight when WEIGHTED) for the block's pairs; row = pair // TOP_K when ROW_PER_TOKEN (A is x), else the
    pair (A is the activation). MXFP4: W is [E, N, KDIM/2] uint8 codes with Scales [E, N, KDIM/32]
    (kernels.reference.dequantize_mxfp4), each tile decoded to A's dtype before its dot (BLOCK_K and
    KDIM multiples of 32; with BLOCK_K 32, each step's product times its one scale a column instead of
    each value times its own). FP8: W is fp8 [E, N, KDIM] with float32 Scales, one a block of scale_rows x
    scale_cols of each expert's weight (BLOCK_K divides scale_cols, or scale_cols >= KDIM: a step lies in
    one column of blocks), each tile widened to A's dtype and each step's product times its scales.
    A_FP8 (with FP8): A is e4m3 codes with float32 AScales, one a run of scale_cols of each row
    (kernels.fp8_linear.quantize_fp8_groups): the product fp8 by fp8 (in fp16, exactly, at steps under 32
    deep: an fp8 MMA takes 32), times the row's scale too.
    QUANTIZE_A (with FP8): A in 16/32 bits, each step one run of it, quantized here as quantize_fp8_groups
    would (the same codes and scales), then as A_FP8. A_STATIC (with A_FP8 or QUANTIZE_A): AScales is A's
    one scale (a static input scale: fp8_linear.quantize_fp8_static's codes), applied once to the sum."""
    block, col_block = tl.program_id(0), tl.program_id(1)
    expert = tl.load(BLOCK_EXPERTS + block).to(tl.int64)
    pairs = tl.load(SORTED + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < tl.where(expert >= 0, PAIRS, 0)  # NOTE: an unused block's pairs are none
    rows = pairs // TOP_K if ROW_PER_TOKEN else pairs
    rows = tl.where(valid, rows, 0)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = W + tl.maximum(expert, 0) * stride_we + cols[None, :] * stride_wn
    if MXFP4:
        s_base = Scales + tl.maximum(expert, 0) * stride_se + cols[None, :] * stride_sn
    if FP8:
        s_base = Scales + tl.maximum(expert, 0) * stride_se + (cols // scale_rows) * stride_sn
    if A_STATIC:
        a_static = tl.load(AScales)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.where(expert >= 0, KDIM, 0), BLOCK_K):  # NOTE: an unused block reads nothing
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < KDIM
        a = tl.load(
            A + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0
        )
        if MXFP4:  # NOTE: each code byte is read for both of its values (the second read hits the cache)
            codes = tl.load(w_base + (ks // 2)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
            codes = (codes >> ((ks % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
            # NOTE: a 32-deep step is one block of scales: the values (E2M1 is exact in A's dtype) go into the
            # dot as decoded and the step's product takes the scale; a deeper step scales each value
            if BLOCK_K == 32:
                w = _e2m1(codes).to(A.dtype.element_ty)
                step_scale = tl.load(s_base + k0 // 32, mask=col_mask[None, :], other=127)
                step_scale = tl.exp2(step_scale.to(tl.float32) - 127.0)
            else:
                scale = tl.load(
                    s_base + (ks // 32)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=127
                )
                w = (_e2m1(codes) * tl.exp2(scale.to(tl.float32) - 127.0)).to(A.dtype.element_ty)
        else:
            w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if FP8 and not A_FP8 and not QUANTIZE_A:  # NOTE: exact: every fp8 value is a value of A's dtype
                w = w.to(A.dtype.element_ty)
        if QUANTIZE_A and A_STATIC:  # NOTE: every value by the one scale (any step)
            a = quantize_by(a, a_static)
        elif QUANTIZE_A:  # NOTE: the step is one run of each row: its scale and codes
            a, a_scale = quantize_rows(a, FP8_MAX)
        if (A_FP8 or QUANTIZE_A) and BLOCK_K < 32:  # NOTE: an fp8 dot takes 32-deep steps: fp16 (exact)
            a, w = a.to(tl.float16), w.to(tl.float16)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if FP8:  # NOTE: the step lies in one column of blocks: one scale an output column
            scale = tl.load(s_base + (k0 // scale_cols) * stride_sk, mask=col_mask, other=0.0)[None, :]
            if A_FP8 and not A_STATIC:  # NOTE: and in one run of A's scales: one a row
                scale = (
                    scale
                    * tl.load(AScales + rows * stride_as + k0 // scale_cols, mask=valid, other=0.0)[:, None]
                )
            if QUANTIZE_A and not A_STATIC:
                scale = scale * a_scale[:, None]
            acc += tl.dot(a, w, input_precision=PRECISION, out_dtype=tl.float32) * scale
        elif MXFP4 and BLOCK_K == 32:
            acc += tl.dot(a, w, input_precision=PRECISION, out_dtype=tl.float32) * step_scale
        else:
            acc += tl.dot(a, w, input_precision=PRECISION, out_dtype=tl.float32)
    if A_STATIC:
        acc = acc * a_static
    if HAS_BIAS:
        bias = tl.load(Bias + tl.maximum(expert, 0) * stride_be + cols, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if WEIGHTED:
        acc = acc * tl.load(PAIR_WEIGHTS + tl.where(valid, pairs, 0), mask=valid, other=0.0)[:, None]
    dst = C + pairs[:, None] * stride_c + cols[None, :]
    tl.store(dst, acc.to(C.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


def _check(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    b13: torch.Tensor | None, b2: torch.Tensor | None, s13: torch.Tensor | None, s2: torch.Tensor | None,
    fp8_block: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or weights.dim() != 2 or ids.shape != weights.shape:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights and topk_ids [T, K] expected, got x "
            f"{host_checks.shape_of(x)}, w13 {host_checks.shape_of(w13)}, w2 {host_checks.shape_of(w2)}, "
            f"topk_weights {host_checks.shape_of(weights)}, topk_ids {host_checks.shape_of(ids)}"
        )
    (t, h), (e, two_i, _) = x.shape, w13.shape
    # NOTE: an MXFP4 weight holds two values a byte
    k13, k2 = (
        w.shape[2] * (2 if s is not None and w.dtype == torch.uint8 else 1) for w, s in ((w13, s13), (w2, s2))
    )
    if two_i % 2 or k13 != h or w2.shape[:2] != (e, h) or k2 != two_i // 2 or weights.shape[0] != t:
        raise ValueError(
            f"shapes do not agree: x {host_checks.shape_of(x)}, w13 {host_checks.shape_of(w13)}, "
            f"w2 {host_checks.shape_of(w2)}, topk_ids {host_checks.shape_of(ids)}"
        )
    if x.dtype not in host_checks.ATTENTION_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    for name, w, scales in (("w13", w13, s13), ("w2", w2, s2)):
        if scales is None and w.dtype != x.dtype:
            raise ValueError(
                f"x, w13 and w2 must share one of fp16/bf16/fp32, got {x.dtype} and {name} {w.dtype}"
            )
        if scales is not None and w.dtype in host_checks.FP8_POOL_DTYPES:
            _check_fp8_scales(name, w, scales, fp8_block)
        elif scales is not None and (w.dtype != torch.uint8 or scales.dtype != torch.uint8
                                     or scales.shape != (*w.shape[:2], w.shape[2] // 16) or w.shape[2] % 16):  # fmt: skip
            raise ValueError(
                f"an MXFP4 {name} is uint8 [E, N, K/2] with uint8 scales [E, N, K/32] (K a multiple of 32), got "
                f"{w.dtype} {host_checks.shape_of(w)} and {scales.dtype} {host_checks.shape_of(scales)}"
            )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be integers, got {ids.dtype}")
    tensors = [x, w13, w2, weights, ids, *(a for a in (b13, b2, s13, s2) if a is not None)]
    if len({a.device for a in tensors}) != 1:
        raise ValueError(
            "x, w13, w2, topk_weights, topk_ids, the biases and the scales must be on one device"
        )
    for name, bias, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(bias.shape)}")


def _check_fp8_scales(
    name: str, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] | None
) -> None:  # fmt: skip
    """An fp8 expert weight's scales: float32, one a ``block`` of each expert's [N, K], else one a row."""
    e, n, k = w.shape
    want = (e, -(-n // block[0]), -(-k // block[1])) if block else (e, n, 1)
    if scales.dtype != torch.float32 or scales.shape != want:
        raise ValueError(
            f"an fp8 {name} {host_checks.shape_of(w)} needs float32 scales {list(want)}, got {scales.dtype} "
            f"{host_checks.shape_of(scales)}"
        )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    w13_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
    fp8_block: tuple[int, int] | None = None,
    fp8_activations: bool = False,
    fuse_quantization: bool | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] in x's dtype; see the module docstring. ``config``: default_config for the shape when None.
    ``b13`` [E, 2I] / ``b2`` [E, H]: the experts' biases, ``activation`` (with ``alpha`` and ``limit``):
    the gated activation by name; ``w13_scales`` / ``w2_scales``: w13 / w2 are MXFP4 (uint8) or fp8
    (scales one a ``fp8_block`` block, else one a row), decoded tile by tile in the GEMMs;
    ``fp8_activations`` (fp8 experts only): each GEMM's input quantized per token group
    (kernels.fp8_linear.quantize_fp8_groups) and multiplied fp8 by fp8, inside the GEMM where its steps are
    the runs and ``fuse_quantization`` says so (fp8_linear.quantizes_inside, over the call's tokens), or by
    one static scale each where given (``w13_input_scale`` for x, ``w2_input_scale`` for the activation:
    float32, one element on x's device); as kernels.reference.fused_moe takes them all."""
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2, w13_scales, w2_scales, fp8_block)
    fp8_experts = w13.dtype in host_checks.FP8_POOL_DTYPES and w2.dtype in host_checks.FP8_POOL_DTYPES
    if fp8_activations and not fp8_experts:
        raise ValueError(f"fp8 activations need fp8 experts, got w13 {w13.dtype} and w2 {w2.dtype}")
    w13_input_scale, w2_input_scale = (
        static_input_scale(s, fp8_activations, x.device) for s in (w13_input_scale, w2_input_scale)
    )
    (t, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    pairs = t * k
    cfg = config or default_config(pairs, e, mxfp4=w13.dtype == torch.uint8 or w2.dtype == torch.uint8)
    if w13.dtype in host_checks.FP8_POOL_DTYPES or w2.dtype in host_checks.FP8_POOL_DTYPES:
        # NOTE: a step must lie in one column of scale blocks (in both GEMMs: one block_k serves them)
        cfg = dataclasses.replace(
            cfg, block_k=min(step_for(fp8_block, h, cfg), step_for(fp8_block, two_i // 2, cfg))
        )
    sorted_pairs, block_experts = moe_align(topk_ids, e, cfg.block_m)
    pair_weights = topk_weights.reshape(-1).float().contiguous()
    common = {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "TOP_K": k,
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "DOT_FP32": INTERPRETED and x.dtype == torch.bfloat16,
        "enable_fp_fusion": True,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    blocks = block_experts.numel()
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    a, a_args = _inputs(x, fp8_activations, fp8_block, fuse_quantization, t, cfg.block_k, w13_input_scale)
    _grouped_gemm_kernel[(blocks, triton.cdiv(two_i, cfg.block_n))](
        a, w13, gate_up, sorted_pairs, block_experts, pair_weights, pairs, two_i, h,
        a.stride(0), w13.stride(0), w13.stride(1), gate_up.stride(0),
        ROW_PER_TOKEN=True, WEIGHTED=False, **common, **_bias_args(b13), **_scale_args(w13, w13_scales, cfg, fp8_block),
        **a_args,
    )  # fmt: skip
    act = pointwise.gated_activation(gate_up, activation, alpha, limit)
    out = torch.empty(pairs, h, dtype=torch.float32, device=x.device)
    a, a_args = _inputs(act, fp8_activations, fp8_block, fuse_quantization, t, cfg.block_k, w2_input_scale)
    _grouped_gemm_kernel[(blocks, triton.cdiv(h, cfg.block_n))](
        a, w2, out, sorted_pairs, block_experts, pair_weights, pairs, h, two_i // 2,
        a.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        ROW_PER_TOKEN=False, WEIGHTED=True, **common, **_bias_args(b2), **_scale_args(w2, w2_scales, cfg, fp8_block),
        **a_args,
    )  # fmt: skip
    return out.view(t, k, h).sum(dim=1).to(x.dtype)


def _scale_args(
    w: torch.Tensor, scales: torch.Tensor | None, cfg: MoeConfig, fp8_block: tuple[int, int] | None
) -> dict:  # fmt: skip
    """The grouped GEMM's arguments for quantized weights: none; an fp8 weight's scales (one a block of
    ``fp8_block``, else one a row: a block of 1 x K); or MXFP4's [E, N, K/32], read at unit stride."""
    if scales is None:
        return {}
    if w.dtype != torch.uint8:
        rows, cols = fp8_block or (1, w.shape[2])
        return {"Scales": scales, "stride_se": scales.stride(0), "stride_sn": scales.stride(1),
                "stride_sk": scales.stride(2), "scale_rows": rows, "scale_cols": cols, "FP8": True}  # fmt: skip
    if cfg.block_k % 32:
        raise ValueError(f"MXFP4 weights need block_k a multiple of 32, got {cfg.block_k}")
    scales = scales if scales.stride(-1) == 1 else scales.contiguous()
    return {"Scales": scales, "stride_se": scales.stride(0), "stride_sn": scales.stride(1), "MXFP4": True}


def _inputs(
    a: torch.Tensor, fp8_activations: bool, fp8_block: tuple[int, int] | None, fuse: bool | None, tokens: int,
    step: int, input_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """A grouped GEMM's input and its arguments: ``a`` as it is; with fp8 activations, ``a`` for the GEMM to
    quantize itself where fp8_linear.quantizes_inside says so (``fuse`` for a call of ``tokens``), else its
    e4m3 codes with their scales (one a run of the blocks' columns of each row, else one a row:
    kernels.reference.activation_group), or by its one static ``input_scale`` ([1]) where given."""
    if not fp8_activations:
        return a, {}
    k = a.shape[-1]
    group = reference.activation_group(fp8_block, k)
    static = input_scale is not None
    if quantizes_inside(fuse, tokens, step, group, k, static):
        return a, {"QUANTIZE_A": True, **({"AScales": input_scale, "A_STATIC": True} if static else {})}
    if static:
        return quantize_fp8_static(a, input_scale), {"AScales": input_scale, "A_FP8": True, "A_STATIC": True}
    codes, scales = quantize_fp8_groups(a, group)
    return codes, {"AScales": scales, "stride_as": scales.stride(0), "A_FP8": True}


def _bias_args(bias: torch.Tensor | None) -> dict:
    """The grouped GEMM's bias arguments: none, or [E, N] rows read at unit stride."""
    if bias is None:
        return {}
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    return {"Bias": bias, "stride_be": bias.stride(0), "HAS_BIAS": True}
