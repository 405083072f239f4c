"""Triton RMSNorm (alone and after the residual add) and SiLU-and-multiply vs kernels.reference on
poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import strided

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 2, 64)])  # non-power-of-two width; a [..., H] input
def test_rms_norm_matches_reference(backend, assert_close_rel, dtype, shape):
    pointwise = backend.module("pointwise")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(*shape, generator=g) * 3).to(backend.device, dtype)
    w = torch.randn(shape[-1], generator=g).to(backend.device, dtype)
    out = torch.full_like(x, float("nan"))
    pointwise.rms_norm(x, w, 1e-6, out=out)
    ref = reference.rms_norm(x.cpu().reshape(-1, shape[-1]), w.cpu(), 1e-6).reshape(shape)
    assert_close_rel(out.cpu(), ref)


def test_rms_norm_reads_a_strided_weight_by_value(backend, assert_close_rel):
    pointwise = backend.module("pointwise")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 96, generator=g).to(backend.device)
    w = strided(torch.randn(96, generator=g).to(backend.device))
    assert not w.is_contiguous()
    assert_close_rel(pointwise.rms_norm(x, w, 1e-6).cpu(), reference.rms_norm(x.cpu(), w.cpu(), 1e-6))


@pytest.mark.parametrize(
    ("weight_shape", "out_shape", "match"),
    [((64,), None, "weight has shape"),  # the kernel would read 32 elements past its end
     ((96, 1), None, "weight has shape"),
     ((96,), (3, 96), "out has shape")],
)  # fmt: skip
def test_rms_norm_rejects_a_weight_or_out_of_the_wrong_shape(backend, weight_shape, out_shape, match):
    pointwise = backend.module("pointwise")
    x = torch.randn(4, 96, device=backend.device)
    out = None if out_shape is None else torch.empty(out_shape, device=backend.device)
    with pytest.raises(ValueError, match=match):
        pointwise.rms_norm(x, torch.ones(weight_shape, device=backend.device), 1e-6, out=out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 96), (3, 2, 64)])
def test_add_rms_norm_matches_reference(backend, assert_close_rel, dtype, shape):
    pointwise = backend.module("pointwise")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=g) * 3).to(backend.device, dtype)
    delta = strided(
        torch.randn(*shape, generator=g).to(backend.device, dtype)
    )  # a strided view is read by value
    w = torch.randn(shape[-1], generator=g).to(backend.device, dtype)
    out = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
    total, normed = pointwise.add_rms_norm(x, delta, w, 1e-6, out=out)
    assert total is out[0] and normed is out[1]
    total_ref, normed_ref = reference.add_rms_norm(x.cpu(), delta.cpu(), w.cpu(), 1e-6)
    assert_close_rel(total.cpu(), total_ref)
    if not (backend.interpret and dtype == torch.bfloat16):  # NOTE: the interpreter truncates to bf16
        assert torch.equal(total.cpu(), total_ref)  # one rounding of an fp32 sum, as the reference
    assert_close_rel(normed.cpu(), normed_ref)
    # the norm reads the sum as stored (rounded to dtype), exactly as rms_norm after an unfused add
    assert_close_rel(
        normed.cpu(), reference.rms_norm(total_ref.reshape(-1, shape[-1]), w.cpu(), 1e-6).reshape(shape)
    )


def _silu(gate: torch.Tensor) -> torch.Tensor:
    return gate * torch.sigmoid(gate)


def _gelu_tanh(gate: torch.Tensor) -> torch.Tensor:  # as transformers' gelu_pytorch_tanh (Gemma's GeGLU)
    return 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1100])  # one block; several blocks with a ragged last one
@pytest.mark.parametrize(("name", "act"), [("silu_and_mul", _silu), ("gelu_tanh_and_mul", _gelu_tanh)])
def test_gated_activations_match_reference(backend, assert_close_rel, dtype, inter, name, act):
    pointwise = backend.module("pointwise")
    g = torch.Generator().manual_seed(6)
    gate_up = (torch.randn(3, 2 * inter, generator=g) * 4).to(backend.device, dtype)
    out = torch.full((3, inter), float("nan"), dtype=dtype, device=backend.device)
    assert getattr(pointwise, name)(gate_up, out=out) is out
    ref = getattr(reference, name)(gate_up.cpu())
    gate, up = gate_up.cpu().float().chunk(2, dim=-1)
    assert_close_rel(out.cpu(), ref)
    assert_close_rel(ref, (act(gate) * up).to(dtype))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        getattr(pointwise, name)(torch.randn(4, 33).to(backend.device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_matches_gpt_oss_definition(backend, assert_close_rel, dtype):
    """gpt-oss's expert activation: gate clamped above at the limit, up to +-limit, (up + 1) * gate *
    sigmoid(alpha * gate); values of order 10 so that both clamps bite."""
    pointwise = backend.module("pointwise")
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(5, 2 * 1100, generator=g) * 6).to(backend.device, dtype)
    out = torch.full((5, 1100), float("nan"), dtype=dtype, device=backend.device)
    assert pointwise.clamped_swiglu_and_mul(gate_up, 1.702, 7.0, out=out) is out
    gate, up = gate_up.cpu().float().chunk(2, dim=-1)
    assert (gate > 7).any() and (up.abs() > 7).any()
    glu = gate.clamp(max=7.0) * torch.sigmoid(1.702 * gate.clamp(max=7.0))
    want = ((up.clamp(-7.0, 7.0) + 1) * glu).to(dtype)
    ref = reference.clamped_swiglu_and_mul(gate_up.cpu(), 1.702, 7.0)
    assert_close_rel(ref, want)
    assert_close_rel(out.cpu(), ref)
    assert_close_rel(pointwise.gated_activation(gate_up, "clamped_swiglu", 1.702, 7.0).cpu(), ref)
    with pytest.raises(ValueError, match="unknown activation"):
        pointwise.gated_activation(gate_up, "relu")


def test_add_rms_norm_and_silu_and_mul_reject_inconsistent_inputs(backend):
    pointwise = backend.module("pointwise")
    x = torch.randn(4, 32).to(backend.device)
    w = torch.randn(32).to(backend.device)
    with pytest.raises(ValueError, match="delta"):
        pointwise.add_rms_norm(x, x[:, :16], w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        pointwise.add_rms_norm(x, x, w[:16], 1e-6)
    with pytest.raises(ValueError, match=r"out\[1\]"):
        pointwise.add_rms_norm(
            x, x, w, 1e-6, out=(torch.empty_like(x), torch.empty(4, 16).to(backend.device))
        )
    with pytest.raises(ValueError, match="gate_up"):
        pointwise.silu_and_mul(torch.randn(4, 33).to(backend.device))
    with pytest.raises(ValueError, match="out"):
        pointwise.silu_and_mul(x, out=torch.empty(4, 32).to(backend.device))
