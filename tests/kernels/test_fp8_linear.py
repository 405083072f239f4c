"""The fp8 linear layer (an fp8 checkpoint's projections kept in fp8): the Triton kernel against
kernels.reference.fp8_linear over block, per-row and per-tensor scales, both fp8 formats, every activation
dtype, biases, ragged shapes past one tile and NaN-poisoned outputs, with 16-bit activations and with
activations quantized to fp8 per token group (its quantization kernel bit for bit); the reference against
its definition."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.test_moe import DTYPES
from tests.support import each_value_once

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# rows, N, K: a decode step, a prefill past one row tile, sizes that are no multiple of any tile
SHAPES = {"decode": (3, 64, 96), "prefill": (40, 48, 64), "ragged": (17, 72, 80)}
# the scales: one a block (square, partial at the ends; rows and columns unequal), one a row, one in all
SCALES = {"block32": (32, 32), "block16x48": (16, 48), "row": None, "tensor": None}


def fp8_weight(n: int, k: int, dtype: torch.dtype, kind: str, seed: int = 0):
    """A random fp8 weight and its scales, the multipliers spread over 2^-8 .. 2^-2 so that a scale read
    for the wrong block or row moves the output by far more than rounding does."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-440, 440).to(dtype)
    block = SCALES[kind]
    shape = {"row": (n, 1), "tensor": (1,)}.get(kind) or (-(-n // block[0]), -(-k // block[1]))
    scale = torch.exp2(torch.rand(shape, generator=g) * -6 - 2)
    return w, scale, block


def activations(rows: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_the_reference_is_the_definition():
    """Each block's multiplier scales its rows and columns only; a partial block at the end of a row."""
    w = torch.tensor([[1.0, 2.0, 4.0], [-1.0, 0.5, 8.0], [3.0, -2.0, 1.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5, 2.0], [4.0, 0.25]])  # blocks of 2 x 2: the last row and column partial
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, -1.0]])
    want = torch.tensor([
        [0.5 + 1.0 + 8.0, -0.5 + 0.25 + 16.0, 12.0 - 8.0 + 0.25],
        [1.0 - 8.0, -1.0 - 16.0, 24.0 - 0.25],
    ])  # fmt: skip
    assert torch.equal(reference.fp8_linear(x, w, scale, (2, 2)), want)
    bias = torch.tensor([1.0, -1.0, 0.5])
    assert torch.equal(
        reference.fp8_linear(x, w, torch.tensor([2.0]), bias=bias), x @ (w.float() * 2).T + bias
    )
    half = reference.fp8_linear(x.to(torch.bfloat16), w, torch.ones(3, 1))
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), x @ w.float().T)


@pytest.mark.parametrize(("shape", "dtype", "kind", "fp8"), each_value_once(SHAPES, DTYPES, SCALES, FP8))
def test_the_kernel_matches_the_reference(backend, assert_close_rel, shape, dtype, kind, fp8):
    fp8_linear = backend.module("fp8_linear")
    rows, n, k = SHAPES[shape]
    w, scale, block = (
        t.to(backend.device) if isinstance(t, torch.Tensor) else t for t in fp8_weight(n, k, fp8, kind)
    )
    x = activations(rows, k, dtype).to(backend.device)
    got = fp8_linear.fp8_linear(x, w, scale, block)
    assert_close_rel(got, reference.fp8_linear(x, w, scale, block))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_leading_dims_strided_rows_and_poisoned_output(backend, assert_close_rel, monkeypatch, dtype):
    """x [2, 9, K] read through a row stride (a slice of a wider tensor), a bias, the output NaN-poisoned
    before the launch: every element must be written."""
    fp8_linear = backend.module("fp8_linear")
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    w, scale, block = fp8_weight(40, 64, torch.float8_e4m3fn, "block32")
    w, scale = w.to(backend.device), scale.to(backend.device)
    wide = activations(18, 96, dtype).to(backend.device)
    x = wide[:, :64].reshape(2, 9, 64)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(dtype).to(backend.device)
    got = fp8_linear.fp8_linear(x, w, scale, block, bias)
    assert got.shape == (2, 9, 40)
    assert_close_rel(got, reference.fp8_linear(x, w, scale, block, bias))


def test_a_block_the_step_does_not_fit_takes_a_shorter_step():
    from kernels import fp8_linear

    cfg = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=128)
    assert fp8_linear.step_for((128, 128), 4096, cfg) == 128
    assert fp8_linear.step_for((128, 96), 4096, cfg) == 32
    assert fp8_linear.step_for(None, 4096, cfg) == 128
    assert fp8_linear.step_for((1, 4096), 4096, cfg) == 128  # one column of blocks: any step
    with pytest.raises(ValueError, match="no step of 16 or more"):
        fp8_linear.step_for((128, 24), 4096, cfg)


def test_bad_arguments_are_refused(backend):
    fp8_linear = backend.module("fp8_linear")
    w, scale, block = fp8_weight(32, 64, torch.float8_e4m3fn, "block32")
    x = activations(2, 64, torch.float32)
    with pytest.raises(ValueError, match=r"needs scale \[1, 2\]"):
        fp8_linear.fp8_linear(x, w, scale[:, :1], block)
    with pytest.raises(ValueError, match="one scale a row"):
        fp8_linear.fp8_linear(x, w, torch.ones(5), None)
    one_row = w[:1]  # one scale in all, 0-d, for a weight of one row: it was refused as a row's (N == 1)
    want = reference.fp8_linear(x, one_row, torch.tensor(0.5), None)
    assert torch.allclose(
        fp8_linear.fp8_linear(x, one_row, torch.tensor(0.5), None).cpu(), want.cpu(), rtol=1e-5
    )
    with pytest.raises(ValueError, match="weight must be float8"):
        fp8_linear.fp8_linear(x, w.float(), scale, block)
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and weight \[N, K\]"):
        fp8_linear.fp8_linear(x[:, :32], w, scale, block)
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_linear.fp8_linear(x, w, scale.half(), block)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_linear.fp8_linear(x, w, scale, block, torch.zeros(32, dtype=torch.float16))


# fp8 by fp8: Hopper's fp8 MMA sums a step's products with fewer bits than fp32 before they join the fp32
# sum, so fp32 activations get a looser bound; quantizing the activations moves the output ~2.5e-2 from the
# 16-bit-activation product, far past the fp32 and fp16 bounds
W8A8_REL_TOL = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def w8a8_tol(backend, dtype: torch.dtype, table: dict = W8A8_REL_TOL) -> float:
    """``table``'s bound for ``dtype``; compiled for CUDA, fp32 takes fp16's: sm_90's fp8 MMAs keep fewer
    bits still (Triton's default there), 2.4-3.1e-4 measured on an H200 (kernels.moe's fp32 experts)."""
    return table[torch.float16 if dtype == torch.float32 and not backend.interpret else dtype]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out_f, ref_f = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out_f).all(), "unwritten (NaN-poisoned) or non-finite output elements"
    return ((out_f - ref_f).norm() / ref_f.norm()).item()


def test_the_activations_reference_is_the_definition():
    """A run's scale is its largest magnitude over 448 (1 for zeros), the last run shorter; the product
    is the dequantized activations' by the dequantized weight."""
    x = torch.tensor([[448.0, -896.0, 3.0, 0.0, 0.0], [1.0, 2.0, 0.5, 7.0, -14.0]])
    codes, scales = reference.quantize_fp8_groups(x, 3)
    assert torch.equal(scales, torch.tensor([[2.0, 1.0], [2.0 / 448, 14.0 / 448]]))
    assert torch.equal(codes.float(), torch.tensor([[224.0, -448.0, 1.5, 0.0, 0.0],
                                                    [224.0, 448.0, 112.0, 224.0, -448.0]]))  # fmt: skip
    assert torch.equal(reference.dequantize_fp8_groups(codes, scales, 3), x)
    w, scale = torch.eye(5).to(torch.float8_e4m3fn), torch.ones(5, 1)
    y = torch.tensor([[1.0, 1.1, 0.0, 0.0, 0.0]])  # 1.1 x 448 / 1.1 = 448; 1 x 448 / 1.1 = 407.3 -> 416
    out = reference.fp8_linear(y, w, scale, fp8_activations=True)
    assert torch.allclose(out, torch.tensor([[416 * 1.1 / 448, 1.1, 0.0, 0.0, 0.0]]))
    assert torch.equal(reference.fp8_linear(y, w, scale), y)  # without: the activations as they are
    assert reference.activation_group((128, 128), 4096) == 128 and reference.activation_group(None, 96) == 96
    assert reference.activation_group((128, 128), 64) == 64


@pytest.mark.parametrize("group", [16, 48, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_activations_quantize_as_the_reference_bit_for_bit(backend, dtype, group):
    """Runs of 16, of 48 (the last one partial) and a whole row; a run of zeros (scale 1) and values whose
    mantissa rounds up into the next binade (126.9 -> 128)."""
    fp8_linear = backend.module("fp8_linear")
    x = activations(5, 80, dtype) * 30
    x[1, :48] = 0
    x[2, 0], x[2, 1] = 448.0, 126.9
    x = x.to(backend.device)
    codes, scales = fp8_linear.quantize_fp8_groups(x, group)
    want_codes, want_scales = reference.quantize_fp8_groups(x, group)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (5, -(-80 // group))
    assert torch.equal(scales.cpu(), want_scales.cpu())
    assert torch.equal(codes.view(torch.uint8).cpu(), want_codes.view(torch.uint8).cpu())


@pytest.mark.parametrize("group", [1050, 2100])
def test_runs_longer_than_a_tile_quantize_as_the_reference_bit_for_bit(backend, group):
    """Runs past kernels.fp8_linear.QUANTIZE_TILE_COLS columns (one scale a row of a wide layer) take the
    kernel that reads a row in chunks: the same codes and scales."""
    fp8_linear = backend.module("fp8_linear")
    assert group > fp8_linear.QUANTIZE_TILE_COLS
    x = (activations(3, 2100, torch.bfloat16) * 30).to(backend.device)
    x[1, 1000] = 126.9  # NOTE: a mantissa that rounds into the next binade, once scaled by 448 / 448
    x[1, 1001] = 448.0
    codes, scales = fp8_linear.quantize_fp8_groups(x, group)
    want_codes, want_scales = reference.quantize_fp8_groups(x, group)
    assert scales.shape == (3, 2100 // group)
    assert torch.equal(scales.cpu(), want_scales.cpu())
    assert torch.equal(codes.view(torch.uint8).cpu(), want_codes.view(torch.uint8).cpu())


def w8a8_case(backend, shape: str, dtype: torch.dtype, kind: str, fp8: torch.dtype = torch.float8_e4m3fn):
    """SHAPES[shape]'s fp8 weight of ``kind`` scales and x whose rows differ in magnitude (2^-2 .. 2^2, so
    that each row's scales are its own), on the backend's device."""
    rows, n, k = SHAPES[shape]
    w, scale, block = (
        t.to(backend.device) if isinstance(t, torch.Tensor) else t for t in fp8_weight(n, k, fp8, kind)
    )
    x = activations(rows, k, dtype) * torch.exp2(torch.arange(rows) % 5 - 2.0)[:, None].to(dtype)
    return w, scale, block, x.to(backend.device)


@pytest.mark.parametrize(("shape", "dtype", "kind", "fp8"), each_value_once(SHAPES, DTYPES, SCALES, FP8))
def test_fp8_activations_match_the_reference(backend, shape, dtype, kind, fp8):
    """The activations quantized per token group (the blocks' columns, or the row) and multiplied fp8 by
    fp8; a scale read for the wrong run or row moves the output past the bound."""
    fp8_linear = backend.module("fp8_linear")
    rows, n, _ = SHAPES[shape]
    w, scale, block, x = w8a8_case(backend, shape, dtype, kind, fp8)
    got = fp8_linear.fp8_linear(x, w, scale, block, fp8_activations=True)
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = w8a8_tol(backend, dtype)
    assert rel_err(got, reference.fp8_linear(x, w, scale, block, fp8_activations=True)) <= tol
    if dtype != torch.bfloat16:  # NOTE: the bound tells the quantized activations from unquantized ones
        assert rel_err(got, reference.fp8_linear(x, w, scale, block)) > tol


def test_fp8_activations_with_bias_leading_dims_strided_rows_and_poisoned_output(backend, monkeypatch):
    fp8_linear = backend.module("fp8_linear")
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    w, scale, block = fp8_weight(40, 64, torch.float8_e4m3fn, "block32")
    w, scale = w.to(backend.device), scale.to(backend.device)
    x = activations(18, 96, torch.float16).to(backend.device)[:, :64].reshape(2, 9, 64)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).half().to(backend.device)
    got = fp8_linear.fp8_linear(x, w, scale, block, bias, fp8_activations=True)
    assert got.shape == (2, 9, 40)
    want = reference.fp8_linear(x, w, scale, block, bias, fp8_activations=True)
    assert rel_err(got, want) <= W8A8_REL_TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("kind", "shape", "step"),
    [("block32", "prefill", 32), ("block32", "ragged", 32), ("row", "ragged", 128), ("tensor", "decode", 128)],
    ids=["blocks", "blocks-ragged", "row-one-step", "tensor-one-step"],
)  # fmt: skip
def test_quantizing_inside_the_product_is_the_separate_quantization(
    backend, monkeypatch, dtype, kind, shape, step
):
    """Where each step is exactly one run of x's scales (32-column steps over 32-column blocks, or one step
    over a whole row), the product can quantize x itself: quantize_fp8_groups is not called, and the output
    is the one the separate quantization gives. By default only decode steps (at most 16 rows) do."""
    fp8_linear = backend.module("fp8_linear")
    rows = SHAPES[shape][0]
    w, scale, block, x = w8a8_case(backend, shape, dtype, kind)
    cfg = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=step)
    separate = fp8_linear.fp8_linear(
        x, w, scale, block, config=cfg, fp8_activations=True, fuse_quantization=False
    )
    quantize = fp8_linear.quantize_fp8_groups

    def not_called(*args):
        raise AssertionError("x was quantized outside the product")

    monkeypatch.setattr(fp8_linear, "quantize_fp8_groups", not_called)
    fused = fp8_linear.fp8_linear(
        x, w, scale, block, config=cfg, fp8_activations=True, fuse_quantization=True
    )
    if rows <= fp8_linear.DECODE_ROWS:  # NOTE: the default for a decode step
        assert torch.equal(fp8_linear.fp8_linear(x, w, scale, block, config=cfg, fp8_activations=True), fused)
    assert rel_err(fused, separate) <= 1e-6
    want = reference.fp8_linear(x, w, scale, block, fp8_activations=True)
    assert rel_err(fused, want) <= w8a8_tol(backend, dtype)
    # a step shorter than a run (16 of 32 columns): quantized outside, by the separate kernel
    calls = []
    monkeypatch.setattr(fp8_linear, "quantize_fp8_groups", lambda *a: calls.append(1) or quantize(*a))
    short = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=16)
    fp8_linear.fp8_linear(x, w, scale, block, config=short, fp8_activations=True, fuse_quantization=True)
    assert calls == [1]
    if rows > fp8_linear.DECODE_ROWS:  # NOTE: a prefill's by default
        fp8_linear.fp8_linear(x, w, scale, block, config=cfg, fp8_activations=True)
        assert calls == [1, 1]


def test_bad_activation_quantization_arguments_are_refused(backend):
    fp8_linear = backend.module("fp8_linear")
    with pytest.raises(ValueError, match="group of at least one column"):
        fp8_linear.quantize_fp8_groups(torch.zeros(2, 8), 0)
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        fp8_linear.quantize_fp8_groups(torch.zeros(2, 8, 4), 4)
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        fp8_linear.quantize_fp8_groups(torch.zeros(2, 8, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="at least one column"):
        reference.quantize_fp8_groups(torch.zeros(2, 8), 0)
    w, scale, _ = fp8_weight(32, 64, torch.float8_e4m3fn, "row")
    with pytest.raises(ValueError, match="it needs fp8_activations"):
        fp8_linear.fp8_linear(torch.zeros(2, 64), w, scale, input_scale=torch.ones(1))
    for bad in (torch.ones(2), torch.ones(1, dtype=torch.float16)):
        with pytest.raises(ValueError, match="an input scale is one float32"):
            fp8_linear.fp8_linear(torch.zeros(2, 64), w, scale, fp8_activations=True, input_scale=bad)
        with pytest.raises(ValueError, match="an input scale is one float32"):
            fp8_linear.quantize_fp8_static(torch.zeros(2, 64), bad)


def static_scale(x: torch.Tensor, headroom: float = 0.8) -> torch.Tensor:
    """A static input scale as a calibration would give, but short of x's largest magnitude (x / it tops
    448 / ``headroom``): the largest values saturate at 448, as a token past the calibration's range does."""
    return (x.float().abs().amax() / 448 * headroom).reshape(1).to(x.device)


def test_the_static_activations_reference_is_the_definition():
    """One scale for every value: x over it rounded to e4m3's nearest even, saturated at +-448; the product
    is the dequantized activations' by the dequantized weight."""
    x = torch.tensor([[1.0, 300.0, -240.0, 0.0], [0.6, 0.53, 0.0, -0.6]])
    codes = reference.quantize_fp8_static(x, torch.tensor([0.5]))
    # 0.6 / 0.5 = 1.2 -> 1.25 (e4m3 steps of 0.125 there); 0.53 / 0.5 = 1.06 -> 1.0; 600 and -480 saturate
    want = torch.tensor([[2.0, 448.0, -448.0, 0.0], [1.25, 1.0, 0.0, -1.25]])
    assert codes.dtype == torch.float8_e4m3fn and torch.equal(codes.float(), want)
    w, scale = torch.eye(4).to(torch.float8_e4m3fn), torch.ones(4, 1)
    out = reference.fp8_linear(x, w, scale, fp8_activations=True, input_scale=torch.tensor(0.5))
    assert torch.equal(out, want * 0.5)


@pytest.mark.parametrize("shape", [(5, 80), (3, 2100)], ids=["one-tile", "three-column-tiles"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_activations_quantize_as_the_reference_bit_for_bit(backend, dtype, shape):
    """A row narrower than a tile and one wider than QUANTIZE_TILE_COLS (three column tiles, the last
    partial); values that saturate, a mantissa that rounds into the next binade (126.9 -> 128 at scale 1)."""
    fp8_linear = backend.module("fp8_linear")
    x = activations(*shape, dtype) * 30
    x[1, 0], x[1, 1] = 126.9, 600.0
    x = x.to(backend.device)
    for scale in (torch.ones(1), static_scale(x)):
        codes = fp8_linear.quantize_fp8_static(x, scale.to(backend.device))
        want = reference.quantize_fp8_static(x, scale.to(backend.device))
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
        assert torch.equal(codes.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())


@pytest.mark.parametrize(("shape", "dtype", "kind"), each_value_once(SHAPES, DTYPES, SCALES))
def test_static_fp8_activations_match_the_reference(backend, monkeypatch, shape, dtype, kind):
    """The activations quantized by one static scale (the largest values saturating), inside the product
    at any step (16-column steps over 32-column blocks too) or first; the sum scaled by it once. The bound
    tells them from per-token quantization and from unquantized activations."""
    fp8_linear = backend.module("fp8_linear")
    rows = SHAPES[shape][0]
    w, scale, block, x = w8a8_case(backend, shape, dtype, kind)
    s = static_scale(x)
    want = reference.fp8_linear(x, w, scale, block, fp8_activations=True, input_scale=s)
    separate = fp8_linear.fp8_linear(x, w, scale, block, fp8_activations=True, input_scale=s,
                                     fuse_quantization=False)  # fmt: skip
    assert separate.dtype == dtype and rel_err(separate, want) <= w8a8_tol(backend, dtype)
    quantize = fp8_linear.quantize_fp8_static
    calls = []
    monkeypatch.setattr(fp8_linear, "quantize_fp8_static", lambda *a: calls.append(1) or quantize(*a))
    short = fp8_linear.Fp8LinearConfig(block_m=16, block_n=32, block_k=16)
    fused = fp8_linear.fp8_linear(x, w, scale, block, config=short, fp8_activations=True, input_scale=s,
                                  fuse_quantization=True)  # fmt: skip
    assert calls == [] and rel_err(fused, want) <= w8a8_tol(backend, dtype)
    fp8_linear.fp8_linear(x, w, scale, block, fp8_activations=True, input_scale=s)
    assert calls == ([] if rows <= fp8_linear.DECODE_ROWS else [1])  # NOTE: inside for a decode step only
    if dtype != torch.bfloat16:
        dynamic = reference.fp8_linear(x, w, scale, block, fp8_activations=True)
        assert rel_err(fused, dynamic) > w8a8_tol(backend, dtype)
        assert rel_err(fused, reference.fp8_linear(x, w, scale, block)) > w8a8_tol(backend, dtype)
