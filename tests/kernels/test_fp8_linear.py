"""The fp8 linear layer (an fp8 checkpoint's projections kept in fp8): the Triton kernel against
kernels.reference.fp8_linear over block, per-row and per-tensor scales, both fp8 formats, every activation
dtype, biases, ragged shapes past one tile and NaN-poisoned outputs; the reference against its definition."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.test_moe import DTYPES

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
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


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("kind", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
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
    with pytest.raises(ValueError, match="weight must be float8"):
        fp8_linear.fp8_linear(x, w.float(), scale, block)
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and weight \[N, K\]"):
        fp8_linear.fp8_linear(x[:, :32], w, scale, block)
    with pytest.raises(ValueError, match="scale must be float32"):
        fp8_linear.fp8_linear(x, w, scale.half(), block)
    with pytest.raises(ValueError, match="bias must be"):
        fp8_linear.fp8_linear(x, w, scale, block, torch.zeros(32, dtype=torch.float16))
