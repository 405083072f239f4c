"""Triton linear layer over fp8 weights and their scales: an fp8 checkpoint's projections kept in fp8.

Semantics are kernels.reference.fp8_linear; this module must never change them.
Shapes: x [..., K] (fp16/bf16/fp32, last dim contiguous); weight [N, K] float8_e4m3fn or float8_e5m2
(contiguous); scale float32, with ``block`` (rows, cols): [ceil(N / rows), ceil(K / cols)], one multiplier a
block of the weight (the last blocks of a row or column may be partial); without: one a row ([N] or [N, 1])
or one for the tensor (one element). bias [N] (x's dtype) or None. Output [..., N] in x's dtype.
A program owns BLOCK_M rows x BLOCK_N columns of the output and walks K in BLOCK_K steps: each weight tile
is widened to x's dtype as it is loaded (exact: every fp8 value is a value of fp16, bf16 and fp32) and
multiplied in fp32; with block scales each step's product is scaled by its blocks' multipliers (BLOCK_K
divides ``cols``, so a step lies in one column of blocks), otherwise the sum is scaled once at the end.
A decode step's projections read the weight's bytes once: half of a 16-bit weight's.
With ``fp8_activations`` (W8A8, as an fp8 checkpoint's "activation_scheme": "dynamic" intends) x is first
quantized to e4m3, one float32 scale a run of the blocks' columns of each row (a whole row without blocks;
quantize_fp8_groups, bit for bit the reference's; a decode step's x is quantized inside the product
where each step is one run), and each step multiplies fp8 by fp8 (sm_90's fp8 warpgroup MMA: twice the
16-bit rate), scaled by the weight's and the row's multipliers; each step's product joins the fp32 sum on
its own (sm_90's fp8 MMAs sum in reduced precision), and a step under 32 deep (blocks of fewer columns; an fp8
MMA takes 32) multiplies in fp16, exactly. With an ``input_scale`` (float32, one element:
a checkpoint's calibrated scale, "activation_scheme": "static") every value of x is quantized by that one
scale instead (quantize_fp8_static; no reduction, so inside the product at any step), and the product is
scaled by it once.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested, reference
from kernels.fused import to_pool

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()


@dataclasses.dataclass(frozen=True)
class Fp8LinearConfig:
    """Output rows and columns a program owns, reduction columns a step takes, launch shape."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# the tiles kernels.bench_fp8_linear times beside the default on every row (kernels.compile_check
# --candidates compiles them; sm_90, bf16: 62-232 registers, none spills; 128 x 256 tiles spill 232 B):
# narrow tiles for decode (more programs over the weight), wider and deeper ones for prefills
CANDIDATES = {
    "m16 n32 k128 s4": Fp8LinearConfig(block_m=16, block_n=32, block_k=128, num_stages=4),
    "m16 n64 k128 s4": Fp8LinearConfig(block_m=16, block_n=64, block_k=128, num_stages=4),
    "m16 n128 k64 s4": Fp8LinearConfig(block_m=16, block_n=128, block_k=64, num_stages=4),
    "m32 n64 k128": Fp8LinearConfig(block_m=32, block_n=64, block_k=128),
    "m64 n128 k64": Fp8LinearConfig(block_m=64, block_n=128, block_k=64),
    "m128 n128 k64 w8": Fp8LinearConfig(block_m=128, block_n=128, block_k=64, num_warps=8),
    "m128 n128 k128 w8": Fp8LinearConfig(block_m=128, block_n=128, block_k=128, num_warps=8),
}
DECODE_ROWS = 16  # default_config: up to this many rows a call is a decode step (one row tile)
# quantize_fp8_groups: runs up to this many columns (rounded up to a power of two) are quantized a tile of
# rows at a time, about this many values a program (a prefill's 128-column runs: 32 rows a program, not one)
QUANTIZE_TILE_COLS, QUANTIZE_TILE_ELEMENTS = 1024, 4096


def default_config(rows: int, fp8_activations: bool = False) -> Fp8LinearConfig:
    """Narrow tiles when the call has few rows (a decode step: the weight's reads are the cost, and more
    programs keep more of them in flight), 128-row tiles for prefills (128 deep with fp8 activations: both
    operands a byte a value). Not yet timed on a GPU (kernels.bench_fp8_linear)."""
    if INTERPRETED:
        return Fp8LinearConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    if rows <= DECODE_ROWS:
        return CANDIDATES["m16 n32 k128 s4"]
    return CANDIDATES["m128 n128 k128 w8" if fp8_activations else "m128 n128 k64 w8"]


@triton.jit
def quantize_rows(x, FP8_MAX: tl.constexpr):
    """A tile x [R, C] as e4m3 codes and one float32 scale a row: the row's largest magnitude over FP8_MAX
    (1 for a row of zeros), the codes x over it (quantize_fp8_groups' rule: divisions rounded to nearest,
    the conversion through fused.to_pool)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX)
    scale = tl.where(scale > 0, scale, 1.0)
    return to_pool(tl.math.div_rn(x, scale[:, None]), tl.float8e4nv), scale


@triton.jit
def quantize_by(x, scale):
    """A tile x as e4m3 codes over one float32 ``scale`` (quantize_fp8_static's rule: the division rounded to
    nearest, the conversion through fused.to_pool)."""
    return to_pool(tl.math.div_rn(x.to(tl.float32), scale), tl.float8e4nv)


@triton.jit
def _fp8_linear_kernel(
    X, XS, W, S, Bias, Out, M, N, K, stride_xm, stride_xsm, stride_wn, stride_om, stride_sr, stride_sc,
    scale_rows, scale_cols,  # the block's rows and columns (BLOCKED); stride_sr: per output row otherwise
    BLOCKED: tl.constexpr, X_FP8: tl.constexpr,  # X_FP8: x's e4m3 codes with XS, one scale a run of it
    QUANTIZE_X: tl.constexpr,  # x in 16/32 bits quantized here, a step a run: fp8 by fp8 without XS
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong
    FP8_MAX: tl.constexpr = 448.0,
    X_STATIC: tl.constexpr = False,  # with X_FP8 or QUANTIZE_X: XS is x's one scale (a static input scale)
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    x_base = X + rows.to(tl.int64)[:, None] * stride_xm
    w_base = W + cols.to(tl.int64)[None, :] * stride_wn  # NOTE: the weight read as [K, N] tiles
    if BLOCKED:
        s_base = S + (cols // scale_rows) * stride_sr
    xs_base = XS + rows * stride_xsm
    if X_STATIC:
        x_static = tl.load(XS)
    if QUANTIZE_X and not X_STATIC and not BLOCKED:
        x_scale = tl.full([BLOCK_M], 1.0, tl.float32)  # NOTE: set by the one step, read after the loop
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_base + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if QUANTIZE_X and X_STATIC:  # NOTE: every value by the one scale (any step)
            x = quantize_by(x, x_static)
        elif QUANTIZE_X:  # NOTE: the step is one run of x: its scales and codes as quantize_fp8_groups' own
            x, x_scale = quantize_rows(x, FP8_MAX)
        elif not X_FP8:  # NOTE: fp8 by fp8 runs on the tensor cores as it is (e4m3 x e4m3 or e5m2)
            w = w.to(X.dtype.element_ty)
        if (X_FP8 or QUANTIZE_X) and BLOCK_K < 32:  # NOTE: an fp8 dot takes 32-deep steps: fp16 (exact)
            x, w = x.to(tl.float16), w.to(tl.float16)
        if DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if BLOCKED:  # NOTE: the step lies in one column of blocks: one multiplier an output column
            scale = tl.load(s_base + (k0 // scale_cols) * stride_sc, mask=col_mask, other=0.0)[None, :]
            if X_FP8 and not X_STATIC:  # NOTE: and in one run of x's scales: one multiplier a row
                scale = scale * tl.load(xs_base + k0 // scale_cols, mask=row_mask, other=0.0)[:, None]
            if QUANTIZE_X and not X_STATIC:
                scale = scale * x_scale[:, None]
            acc += tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32) * scale
        elif X_FP8 or QUANTIZE_X:  # NOTE: sm_90's fp8 MMAs sum in reduced precision: added in fp32 a step
            acc += tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32)
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION, out_dtype=tl.float32)
    if not BLOCKED:
        acc = acc * tl.load(S + cols * stride_sr, mask=col_mask, other=0.0)[None, :]
        if X_FP8 and not X_STATIC:
            acc = acc * tl.load(xs_base, mask=row_mask, other=0.0)[:, None]
        if QUANTIZE_X and not X_STATIC:  # NOTE: one step: the whole row
            acc = acc * x_scale[:, None]
    if X_STATIC:
        acc = acc * x_static
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dst = Out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(dst, acc.to(Out.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _quantize_tiles_kernel(
    X, Q, S, M, K, group, stride_xm, stride_qm, stride_sm, FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr, STATIC: tl.constexpr = False,
):  # fmt: skip
    """One program a run of ``group`` (<= BLOCK_G) columns of BLOCK_R rows, held as one tile; STATIC: S is
    the one scale of every value, read, not written."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    run = tl.program_id(1)
    offs = tl.arange(0, BLOCK_G)
    cols = run * group + offs
    mask = (rows < M)[:, None] & ((offs < group) & (cols < K))[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if STATIC:
        codes = quantize_by(x, tl.load(S))
    else:
        codes, scale = quantize_rows(x, FP8_MAX)
    tl.store(Q + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], codes, mask=mask)
    if not STATIC:
        tl.store(S + rows * stride_sm + run, scale, mask=rows < M)


@triton.jit
def _quantize_groups_kernel(
    X, Q, S, K, group, stride_xm, stride_qm, stride_sm, FP8_MAX: tl.constexpr, CHUNK: tl.constexpr
):  # fmt: skip
    """One program a run of ``group`` columns of one row, read in CHUNKs twice: its largest magnitude,
    then its codes (runs too long for one tile: one scale a row of a wide layer)."""
    row, run = tl.program_id(0), tl.program_id(1)
    start = run * group
    end = tl.minimum(start + group, K)
    x_row = X + row.to(tl.int64) * stride_xm
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(start, end, CHUNK):
        cs = c0 + tl.arange(0, CHUNK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cs, mask=cs < end, other=0.0).to(tl.float32)))
    scale = tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX)  # NOTE: rounded as the reference's division
    scale = tl.where(scale > 0, scale, 1.0)
    q_row = Q + row.to(tl.int64) * stride_qm
    for c0 in range(start, end, CHUNK):
        cs = c0 + tl.arange(0, CHUNK)
        x = tl.load(x_row + cs, mask=cs < end, other=0.0).to(tl.float32)
        tl.store(q_row + cs, to_pool(tl.math.div_rn(x, scale), Q.dtype.element_ty), mask=cs < end)
    tl.store(S + row * stride_sm + run, scale)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp16 / bf16 / fp32, last dim contiguous) as e4m3 codes [M, K] and float32 scales
    [M, ceil(K / group)]: kernels.reference.quantize_fp8_groups, bit for bit (the divisions round to
    nearest)."""
    _check_quantized(x, group)
    m, k = x.shape
    runs = triton.cdiv(k, group)
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, runs), dtype=torch.float32, device=x.device)
    width = triton.next_power_of_2(group)
    if m and k and width <= QUANTIZE_TILE_COLS:  # NOTE: a program a tile of rows x one run
        _quantize_tiles(x, codes, scales, group, width, runs)
    elif m and k:  # NOTE: a program a run of one row, read in chunks
        _quantize_groups_kernel[(m, runs)](
            x, codes, scales, k, group, x.stride(0), codes.stride(0), scales.stride(0),
            FP8_MAX=torch.finfo(torch.float8_e4m3fn).max, CHUNK=16 if INTERPRETED else 1024,
            enable_fp_fusion=True, num_warps=1 if INTERPRETED else 4,
        )  # fmt: skip
    return codes, scales


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32, last dim contiguous) as e4m3 codes [M, K] over one float32 ``scale``
    (one element, on x's device; read there, so a CUDA graph may replay it): kernels.reference.
    quantize_fp8_static, bit for bit. A tile of rows a program, as quantize_fp8_groups' tiles."""
    _check_quantized(x, 1)
    check_input_scale(scale, x.device)
    m, k = x.shape
    codes = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if m and k:
        width = min(triton.next_power_of_2(k), QUANTIZE_TILE_COLS)
        _quantize_tiles(x, codes, scale, width, width, triton.cdiv(k, width), static=True)
    return codes


def _quantize_tiles(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, group: int, width: int, runs: int,
    static: bool = False,
) -> None:  # fmt: skip
    """_quantize_tiles_kernel over x [M, K] (M, K > 0): runs of ``group`` columns (``width``, a power of two,
    at least ``group``), about QUANTIZE_TILE_ELEMENTS values a program; ``static``: ``scales`` is the one
    scale of every value (read), else one a run of each row (written)."""
    m, k = x.shape
    block_r = min(triton.next_power_of_2(m), max(1, QUANTIZE_TILE_ELEMENTS // width))
    _quantize_tiles_kernel[(triton.cdiv(m, block_r), runs)](
        x, codes, scales, m, k, group, x.stride(0), codes.stride(0), 0 if static else scales.stride(0),
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max, BLOCK_R=block_r, BLOCK_G=width, STATIC=static,
        enable_fp_fusion=True, num_warps=1 if INTERPRETED else 4,
    )  # fmt: skip


def _check_quantized(x: torch.Tensor, group: int) -> None:
    """ValueError unless x is what quantize_fp8_groups / quantize_fp8_static take."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in host_checks.ATTENTION_DTYPES or group < 1:
        raise ValueError(
            f"x [M, K] of fp16, bf16 or fp32 with contiguous rows and a group of at least one column "
            f"expected, got {x.dtype} {host_checks.shape_of(x)}, group {group}"
        )


def check_input_scale(scale: torch.Tensor, device: torch.device) -> None:
    """ValueError unless ``scale`` is a static input scale: float32, one element, on ``device``."""
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != device:
        raise ValueError(
            f"an input scale is one float32 on the input's device ({device}), got {scale.dtype} "
            f"{host_checks.shape_of(scale)} on {scale.device}"
        )


def static_input_scale(
    scale: torch.Tensor | None, fp8_activations: bool, device: torch.device
) -> torch.Tensor | None:  # fmt: skip
    """A product's static input scale as the kernels read it ([1]), or None without one. ValueError unless it
    comes with ``fp8_activations`` and is one float32 on ``device`` (check_input_scale)."""
    if scale is None:
        return None
    if not fp8_activations:
        raise ValueError("an input scale quantizes the product's input: it needs fp8_activations")
    check_input_scale(scale, device)
    return scale.reshape(1)


def check_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None,
) -> None:  # fmt: skip
    """ValueError unless the arguments are as the module docstring says (metadata only)."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x [..., K] and weight [N, K] expected, got x {host_checks.shape_of(x)}, weight "
            f"{host_checks.shape_of(weight)}"
        )
    if x.dtype not in host_checks.ATTENTION_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if weight.dtype not in host_checks.FP8_POOL_DTYPES:
        raise ValueError(f"weight must be float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    n, k = weight.shape
    if block is not None:
        rows, cols = block
        if rows < 1 or cols < 1 or scale.shape != (-(-n // rows), -(-k // cols)):
            raise ValueError(
                f"an fp8 weight [{n}, {k}] in {rows}x{cols} blocks needs scale [{-(-n // max(rows, 1))}, "
                f"{-(-k // max(cols, 1))}], got {host_checks.shape_of(scale)}"
            )
    elif scale.numel() != 1 and (scale.numel() != n or scale.shape not in ((n,), (n, 1))):
        raise ValueError(
            f"an fp8 weight [{n}, {k}] without blocks needs one scale a row ([{n}] or [{n}, 1]) or one in all, "
            f"got {host_checks.shape_of(scale)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(
            f"bias must be [{n}] in x's dtype {x.dtype}, got {bias.dtype} {host_checks.shape_of(bias)}"
        )
    tensors = [x, weight, scale, *([bias] if bias is not None else [])]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, weight, scale and bias must be on one device")


def step_for(block: tuple[int, int] | None, k: int, cfg: Fp8LinearConfig) -> int:
    """BLOCK_K for a launch: ``cfg.block_k``, halved until it divides the blocks' columns (a step must lie
    in one column of blocks; a block of at least K columns has one). ValueError below 16 (tl.dot's least)."""
    step = cfg.block_k
    if block is None or block[1] >= k:
        return step
    while step >= 16 and block[1] % step:
        step //= 2
    if step < 16:
        raise ValueError(f"fp8 weight blocks of {block[1]} columns: no step of 16 or more divides them")
    return step


def quantizes_inside(
    fuse_quantization: bool | None, rows: int, step: int, group: int, k: int, static: bool = False
) -> bool:  # fmt: skip
    """Whether a product of fp8 activations quantizes its x tiles itself rather than taking
    quantize_fp8_groups' (quantize_fp8_static's) codes: where asked (``fuse_quantization``; None: for a
    decode step's at most DECODE_ROWS ``rows``), and only where each ``step`` of the ``k`` columns is exactly
    one run of ``group`` (or one step covers a run of the whole row), or at any step with one ``static``
    scale."""
    if fuse_quantization is None:
        fuse_quantization = rows <= DECODE_ROWS
    return fuse_quantization and (static or step == group or step >= k == group)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None, config: Fp8LinearConfig | None = None, fp8_activations: bool = False,
    fuse_quantization: bool | None = None, input_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """See the module docstring and kernels.reference.fp8_linear. ``input_scale`` (with ``fp8_activations``):
    x's one static scale, float32, one element on x's device. ``fuse_quantization`` (with
    ``fp8_activations``; quantizes_inside decides): True: where each step of the product is exactly one run
    of x's scales (a step as wide as the blocks' columns, or one step over the whole row), x is quantized
    inside the product instead of by quantize_fp8_groups first (the same codes and scales; one launch and
    x's codes' round trip saved, each column tile quantizing its rows again); False: never; None: True for
    calls of at most DECODE_ROWS rows (a decode step: a launch saved on each projection), False above (a
    prefill's x tiles stay a byte a value in shared memory: 16-bit ones do not fit sm_89 at 128 x 128 x
    128)."""
    check_fp8_linear(x, weight, scale, block, bias)
    input_scale = static_input_scale(input_scale, fp8_activations, x.device)
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    cfg = config or default_config(m, fp8_activations)
    step = step_for(block, k, cfg)
    if block is None:  # NOTE: one scale in all is a scale a row at stride 0
        strides, block_rows, block_cols = (0 if scale.numel() == 1 else 1, 0), 1, k
        scale = scale.reshape(-1)
    else:
        strides, (block_rows, block_cols) = scale.stride(), block
    x_scales = scale if input_scale is None else input_scale  # NOTE: unread without fp8 activations
    group = reference.activation_group(block, k)
    fused = fp8_activations and quantizes_inside(
        fuse_quantization, m, step, group, k, input_scale is not None
    )
    if fp8_activations and not fused and input_scale is not None:
        x2 = quantize_fp8_static(x2, input_scale)
    elif fp8_activations and not fused:
        x2, x_scales = quantize_fp8_groups(x2, group)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _fp8_linear_kernel[grid](
        x2, x_scales, weight, scale, bias if bias is not None else out, out, m, n, k, x2.stride(0),
        x_scales.stride(0), weight.stride(0), out.stride(0), strides[0], strides[1], block_rows, block_cols,
        BLOCKED=block is not None, X_FP8=fp8_activations and not fused, QUANTIZE_X=fused,
        X_STATIC=input_scale is not None, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=step, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and x2.dtype == torch.bfloat16 and not fused, enable_fp_fusion=True,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out.reshape(*lead, n)
