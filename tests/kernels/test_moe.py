"""Mixture-of-experts MLP (kernels.moe) vs kernels.reference.fused_moe, and the reference vs the plain
definition: experts no token chose, one expert taking every token, a token whose top-k repeats none,
sizes that are not multiples of the tiles, decode-like and prefill-like batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from tests.support import each_value_once

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BLOCKS = [((16, 32),), ((32, 48),), (None,)]  # the fp8 experts' scale blocks (rows x columns), or one a row


def moe_case(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
):
    """x, w13, w2 scaled as real weights are (outputs of order 1), router logits, and their routing."""
    g = torch.Generator().manual_seed(seed + tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = reference.moe_route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


def by_definition(x, w13, w2, weights, ids, b13=None, b2=None, clamped=False):
    """Each token's experts one at a time, float32 throughout; with ``clamped``, gpt-oss's activation
    (alpha 1.702, limit 7)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].float() @ x[t].float() + (0 if b13 is None else b13[e].float())
            gate, up = gate_up.chunk(2)
            if clamped:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            else:
                act = F.silu(gate) * up
            y = w2[e].float() @ act + (0 if b2 is None else b2[e].float())
            out[t] += float(weights[t, j]) * y
    return out


def biases(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 1):
    """Expert biases b13 [E, 2I], b2 [E, H] of order 1 (the gate's clamp at 7 bites with x of order 3)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(experts, 2 * inter, generator=g).to(dtype), torch.randn(
        experts, hidden, generator=g
    ).to(dtype)


def test_routing_takes_the_largest_probabilities_and_renormalizes_when_asked():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 5.5, 0.0]])
    weights, ids = reference.moe_route(logits, 2, renormalize=False)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[1, 3], [2, 0]] and ids.dtype == torch.int32
    torch.testing.assert_close(weights, probs.gather(1, ids.long()))
    normed, _ = reference.moe_route(logits, 2, renormalize=True)
    torch.testing.assert_close(normed.sum(-1), torch.ones(2))
    torch.testing.assert_close(normed, weights / weights.sum(-1, keepdim=True))


def test_the_reference_is_the_definition():
    x, w13, w2, weights, ids = moe_case(9, 6, 2, 24, 10, torch.float32)
    ids[3] = torch.tensor([5, 5], dtype=torch.int32)  # a token may name one expert twice: both count
    got = reference.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, by_definition(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_the_reference_with_biases_and_clamped_swiglu_is_the_definition():
    x, w13, w2, weights, ids = moe_case(9, 6, 2, 24, 10, torch.float32)
    b13, b2 = biases(6, 24, 10, torch.float32)
    x = x * 3
    got = reference.fused_moe(x, w13, w2, weights, ids, b13=b13, b2=b2, activation="clamped_swiglu")
    want = by_definition(x, w13, w2, weights, ids, b13, b2, clamped=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, reference.fused_moe(x, w13, w2, weights, ids, b13=b13, b2=b2), atol=1e-2)


def test_align_groups_each_experts_pairs_in_whole_blocks():
    moe = pytest.importorskip("kernels.moe")
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 4]], dtype=torch.int32)  # experts 2 and 5 unused
    sorted_pairs, block_experts = moe.moe_align(ids, 6, 4)
    n = ids.numel()
    assert sorted_pairs.numel() == -(-(n + 6 * 3) // 4) * 4 == block_experts.numel() * 4
    used = [b for b in block_experts.tolist() if b >= 0]
    assert used == [0, 1, 3, 4] and set(block_experts.tolist()[len(used) :]) <= {-1}
    flat = ids.reshape(-1).tolist()
    for b, e in enumerate(used):
        block = sorted_pairs[4 * b : 4 * b + 4].tolist()
        pairs = [p for p in block if p < n]
        assert pairs == sorted(pairs) and pairs == [p for p in range(n) if flat[p] == e]
        assert block[len(pairs) :] == [n] * (4 - len(pairs))  # padding only after the pairs
    assert (sorted_pairs[4 * len(used) :] == n).all()


CASES = {
    # tokens, experts, top_k, hidden, inter: a decode step (few pairs, most experts idle), a prefill
    # whose runs span several blocks, sizes past one tile that are not multiples of it, top-1
    "decode": (3, 8, 2, 64, 48),
    "prefill": (40, 4, 2, 48, 40),
    "ragged": (17, 5, 3, 72, 36),
    "top1": (6, 3, 1, 32, 16),
}


@pytest.fixture
def poisoned(monkeypatch):
    """Every floating-point torch.empty (the kernels' intermediate and output buffers) starts as NaN, so
    an element no program writes fails the comparison."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_the_reference(backend, assert_close_rel, poisoned, case, dtype):
    moe = backend.module("moe")
    x, w13, w2, weights, ids = (t.to(backend.device) for t in moe_case(*CASES[case], dtype))
    got = moe.fused_moe(x, w13, w2, weights, ids)
    assert_close_rel(got, reference.fused_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_with_biases_and_clamped_swiglu_matches_the_reference(
    backend, assert_close_rel, poisoned, case, dtype
):
    moe = backend.module("moe")
    _, experts, _, hidden, inter = CASES[case]
    x, w13, w2, weights, ids = (t.to(backend.device) for t in moe_case(*CASES[case], dtype))
    b13, b2 = (b.to(backend.device) for b in biases(experts, hidden, inter, dtype))
    x = x * 3
    options = {"b13": b13, "b2": b2, "activation": "clamped_swiglu", "alpha": 1.702, "limit": 7.0}
    got = moe.fused_moe(x, w13, w2, weights, ids, **options)
    assert_close_rel(got, reference.fused_moe(x, w13, w2, weights, ids, **options))
    with pytest.raises(ValueError, match="b2 must be"):
        moe.fused_moe(x, w13, w2, weights, ids, b2=b2[:, :-1])


def mxfp4_experts(experts: int, hidden: int, inter: int, seed: int = 2):
    """Random MXFP4 experts: codes [E, 2I, H/2] / [E, H, I/2] and scales near 2^-3 (values of order 1/4)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (experts, 2 * inter, hidden // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (experts, hidden, inter // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(121, 126, (experts, 2 * inter, hidden // 32), dtype=torch.uint8, generator=g)
    s2 = torch.randint(121, 126, (experts, hidden, inter // 32), dtype=torch.uint8, generator=g)
    return w13, w2, s13, s2


def test_the_reference_dequantizes_mxfp4_codes_by_definition():
    """Low nibble first; sign bit, 2 exponent bits (bias 1), 1 mantissa bit; times 2^(scale - 127)."""
    packed = torch.tensor([0x2F, 0x91, 0x07, 0xE4] + [0] * 12, dtype=torch.uint8)
    got = reference.dequantize_mxfp4(packed, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert got[:8].tolist() == [-12.0, 2.0, 1.0, -1.0, 12.0, 0.0, 4.0, -8.0]
    half = reference.dequantize_mxfp4(packed, torch.tensor([126], dtype=torch.uint8), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half[:2].tolist() == [-3.0, 0.5]


@pytest.mark.parametrize(
    ("dtype", "case", "step"), each_value_once(DTYPES, ["decode", "prefill"], ["default", "k64"])
)
def test_fused_moe_on_mxfp4_experts_matches_the_reference(
    backend, assert_close_rel, poisoned, case, dtype, step
):
    """gpt-oss's experts as released: MXFP4 codes decoded tile by tile in both GEMMs (with the biases and
    the clamped SwiGLU), against the reference on the dequantized weights; by default in 32-deep steps (one
    block of scales a step, applied to its product), and in 64-deep ones (each value scaled as decoded)."""
    moe = backend.module("moe")
    tokens, experts, top_k, hidden, inter = {"decode": (3, 8, 2, 64, 64), "prefill": (40, 4, 2, 96, 64)}[case]
    x, _, _, weights, ids = (
        t.to(backend.device) for t in moe_case(tokens, experts, top_k, hidden, inter, dtype)
    )
    w13, w2, s13, s2 = (t.to(backend.device) for t in mxfp4_experts(experts, hidden, inter))
    b13, b2 = (b.to(backend.device) for b in biases(experts, hidden, inter, dtype))
    options = {"b13": b13, "b2": b2, "activation": "clamped_swiglu"}
    config = None if step == "default" else moe.MoeConfig(block_m=16, block_n=32, block_k=64)
    got = moe.fused_moe(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, **options, config=config)
    want = reference.fused_moe(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, **options)
    assert_close_rel(got, want)
    dense = [reference.dequantize_mxfp4(w, s, dtype) for w, s in ((w13, s13), (w2, s2))]
    assert_close_rel(moe.fused_moe(x, *dense, weights, ids, **options), want)  # the same experts, unpacked
    with pytest.raises(ValueError, match="an MXFP4 w2 is uint8"):
        moe.fused_moe(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2[..., :1])


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None, seed: int = 3):
    """``w13`` / ``w2`` as an fp8 checkpoint's experts: e4m3 codes and float32 scales (one a ``block`` of
    each expert, else one a row) spread over 2^-8 .. 2^-2, so a scale read for the wrong block, row or
    expert moves the output by far more than rounding does."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for w in (w13, w2):
        e, n, k = w.shape
        shape = (e, -(-n // block[0]), -(-k // block[1])) if block else (e, n, 1)
        scales = torch.exp2(torch.rand(shape, generator=g) * -6 - 2)
        codes = (torch.randn(w.shape, generator=g) * 64).clamp(-440, 440).to(torch.float8_e4m3fn)
        out += [
            codes,
            scales * k**-0.5 / 64 / scales.mean(),
        ]  # NOTE: weights of rms ~1/sqrt(K), as moe_case's
    return out


@pytest.mark.parametrize(("dtype", "block", "case"), each_value_once(DTYPES, BLOCKS, ["decode", "prefill"]))
def test_fused_moe_on_fp8_experts_matches_the_reference(
    backend, assert_close_rel, poisoned, case, block, dtype
):
    """An fp8 checkpoint's experts (--fp8-weights fp8): e4m3 codes widened tile by tile and each step's
    product times its scales (block scales partial at the ends: 72 hidden columns, 40 units), in both GEMMs,
    against the reference on the same experts; the reference against the dequantized experts."""
    moe = backend.module("moe")
    tokens, experts, top_k, hidden, inter = {"decode": (3, 8, 2, 72, 40), "prefill": (40, 4, 2, 72, 40)}[case]
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    w13, s13, w2, s2 = fp8_experts(w13, w2, block)
    options = {"w13_scales": s13, "w2_scales": s2, "fp8_block": block}
    dev = backend.device
    args = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    got = moe.fused_moe(*args, **{**options, "w13_scales": s13.to(dev), "w2_scales": s2.to(dev)})
    want = reference.fused_moe(x, w13, w2, weights, ids, **options)
    assert_close_rel(got, want.to(dev))
    dense = [reference.dequantize_fp8_weight(w, s, block, torch.float32) for w, s in ((w13, s13), (w2, s2))]
    assert_close_rel(reference.fused_moe(x.float(), *dense, weights, ids).to(dtype), want)
    with pytest.raises(ValueError, match=r"an fp8 w2 .* needs float32 scales"):
        moe.fused_moe(*args, w13_scales=s13.to(dev), w2_scales=s2[..., :1].to(dev)[:, :1], fp8_block=block)
    # gpt-oss's experts quantized at load (--mxfp4-experts dequantized --quantization fp8): biases, clamped SwiGLU
    b13, b2 = biases(experts, hidden, inter, dtype)
    extra = {"b13": b13, "b2": b2, "activation": "clamped_swiglu"}
    got = moe.fused_moe(*args, **{**options, "w13_scales": s13.to(dev), "w2_scales": s2.to(dev)},
                        **{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})  # fmt: skip
    assert_close_rel(got, reference.fused_moe(x, w13, w2, weights, ids, **options, **extra).to(dev))


# fp8 activations: the gate/up product is rounded to x's dtype before the activation is quantized, and
# where the kernel's and the reference's sums differ in that last bit the activation's fp8 code can take the
# other neighbour (bf16: 0.6-1.9% in the interpreter); fp32 as kernels.fp8_linear's bound
MOE_W8A8_REL_TOL = {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 5e-2}


@pytest.mark.parametrize(("dtype", "block", "case"), each_value_once(DTYPES, BLOCKS, ["decode", "prefill"]))
def test_fused_moe_with_fp8_activations_matches_the_reference(backend, poisoned, case, block, dtype):
    """--fp8-activations dynamic on fp8 experts: x and the activation quantized per token group (the
    blocks' columns, or a row) before their GEMMs, multiplied fp8 by fp8; rows of different magnitudes,
    so a scale read for the wrong row or run fails."""
    from tests.kernels.test_fp8_linear import rel_err, w8a8_tol

    moe = backend.module("moe")
    tokens, experts, top_k, hidden, inter = {"decode": (3, 8, 2, 72, 40), "prefill": (40, 4, 2, 72, 40)}[case]
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    x = x * torch.exp2(torch.arange(tokens) % 5 - 2.0)[:, None].to(dtype)
    w13, s13, w2, s2 = fp8_experts(w13, w2, block)
    options = {"w13_scales": s13, "w2_scales": s2, "fp8_block": block}
    dev = backend.device
    args = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    on_dev = {**options, "w13_scales": s13.to(dev), "w2_scales": s2.to(dev)}
    got = moe.fused_moe(*args, **on_dev, fp8_activations=True)
    want = reference.fused_moe(x, w13, w2, weights, ids, **options, fp8_activations=True)
    assert got.dtype == dtype and rel_err(got, want) <= w8a8_tol(backend, dtype, MOE_W8A8_REL_TOL)
    unquantized = rel_err(got, reference.fused_moe(x, w13, w2, weights, ids, **options))
    if dtype != torch.bfloat16:  # NOTE: the bound tells quantized inputs from unquantized ones
        assert unquantized > w8a8_tol(backend, dtype, MOE_W8A8_REL_TOL)
    _, plain13, plain2, _, _ = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    with pytest.raises(ValueError, match="fp8 activations need fp8 experts"):
        moe.fused_moe(args[0], plain13.to(dev), plain2.to(dev), *args[3:], fp8_activations=True)


@pytest.mark.parametrize(("dtype", "case"), each_value_once(DTYPES, ["decode", "prefill"]))
def test_experts_quantizing_their_inputs_inside_the_gemms_match_the_separate_quantization(
    backend, monkeypatch, poisoned, case, dtype
):
    """32-column steps over 32-column blocks: each GEMM quantizes its input itself (quantize_fp8_groups not
    called) and gives what the separate quantization gives; by default a decode step's do, a prefill's
    not."""
    from tests.kernels.test_fp8_linear import rel_err, w8a8_tol

    moe = backend.module("moe")
    tokens, experts, top_k, hidden, inter = {"decode": (3, 8, 2, 64, 64), "prefill": (40, 4, 2, 64, 64)}[case]
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    x = x * torch.exp2(torch.arange(tokens) % 5 - 2.0)[:, None].to(dtype)
    block = (16, 32)
    w13, s13, w2, s2 = fp8_experts(w13, w2, block)
    dev = backend.device
    args = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    cfg = moe.MoeConfig(block_m=16, block_n=32, block_k=32)
    options = {"w13_scales": s13.to(dev), "w2_scales": s2.to(dev), "fp8_block": block, "config": cfg,
               "fp8_activations": True}  # fmt: skip
    separate = moe.fused_moe(*args, **options, fuse_quantization=False)
    quantize, calls = moe.quantize_fp8_groups, []
    monkeypatch.setattr(moe, "quantize_fp8_groups", lambda *a: calls.append(1) or quantize(*a))
    fused = moe.fused_moe(*args, **options, fuse_quantization=True)
    assert calls == [] and rel_err(fused, separate) <= 1e-6
    want = reference.fused_moe(x, w13, w2, weights, ids, w13_scales=s13, w2_scales=s2, fp8_block=block,
                               fp8_activations=True)  # fmt: skip
    assert rel_err(fused, want) <= w8a8_tol(backend, dtype, MOE_W8A8_REL_TOL)
    moe.fused_moe(*args, **options)  # the default: inside for a decode step's 3 tokens, first for 40
    assert calls == ([] if case == "decode" else [1, 1])


@pytest.mark.parametrize(
    ("dtype", "block", "case"), each_value_once(DTYPES, BLOCKS[::2], ["decode", "prefill"])
)
def test_fused_moe_with_static_input_scales_matches_the_reference(backend, monkeypatch, poisoned, case, block,
                                                                  dtype):  # fmt: skip
    """--fp8-activations static on fp8 experts: x and the activation quantized by one scale each (a
    checkpoint's input scales; x's short of its largest values, which saturate), inside the GEMMs at any
    step or first, each GEMM's sum scaled by it once; the bound tells them from per-token quantization."""
    from tests.kernels.test_fp8_linear import rel_err, static_scale, w8a8_tol

    moe = backend.module("moe")
    tokens, experts, top_k, hidden, inter = {"decode": (3, 8, 2, 72, 40), "prefill": (40, 4, 2, 72, 40)}[case]
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, hidden, inter, dtype)
    x = x * torch.exp2(torch.arange(tokens) % 5 - 2.0)[:, None].to(dtype)
    w13, s13, w2, s2 = fp8_experts(w13, w2, block)
    dev = backend.device
    scales = {"w13_input_scale": static_scale(x), "w2_input_scale": torch.tensor([0.01])}
    options = {"w13_scales": s13, "w2_scales": s2, "fp8_block": block, "fp8_activations": True}
    want = reference.fused_moe(x, w13, w2, weights, ids, **options, **scales)
    args = [t.to(dev) for t in (x, w13, w2, weights, ids)]
    on_dev = {**{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in options.items()},
              **{k: v.to(dev) for k, v in scales.items()}}  # fmt: skip
    quantize, calls = moe.quantize_fp8_static, []
    monkeypatch.setattr(moe, "quantize_fp8_static", lambda *a: calls.append(1) or quantize(*a))
    for fuse, quantized_first in ((True, []), (False, [1, 1]), (None, [] if case == "decode" else [1, 1])):
        calls.clear()
        got = moe.fused_moe(*args, **on_dev, fuse_quantization=fuse)
        assert calls == quantized_first and got.dtype == dtype
        assert rel_err(got, want) <= w8a8_tol(backend, dtype, MOE_W8A8_REL_TOL)
    if dtype != torch.bfloat16:
        dynamic = reference.fused_moe(x, w13, w2, weights, ids, **options)
        assert rel_err(got, dynamic) > w8a8_tol(backend, dtype, MOE_W8A8_REL_TOL)
    with pytest.raises(ValueError, match="it needs fp8_activations"):
        moe.fused_moe(*args, **{**on_dev, "fp8_activations": False})
    with pytest.raises(ValueError, match="an input scale is one float32"):
        moe.fused_moe(*args, **{**on_dev, "w2_input_scale": torch.ones(2, device=dev)})


def test_every_pair_lands_with_one_expert_taking_all_tokens_and_others_none(
    backend, assert_close_rel, poisoned
):
    moe = backend.module("moe")
    x, w13, w2, weights, ids = (t.to(backend.device) for t in moe_case(21, 6, 2, 32, 24, torch.float16))
    ids[:, 0] = 4  # every token's first choice: one run of 21 pairs over two blocks
    ids[:, 1] = torch.where(torch.arange(21, device=ids.device) % 2 == 0, 1, 0).to(ids.dtype)
    cfg = dataclasses.replace(moe.default_config(42, 6), block_m=16)
    got = moe.fused_moe(x, w13, w2, weights, ids, config=cfg)
    assert_close_rel(got, reference.fused_moe(x, w13, w2, weights, ids))
    assert moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


def test_fused_moe_refuses_shapes_that_do_not_agree():
    moe = pytest.importorskip("kernels.moe")
    x, w13, w2, weights, ids = moe_case(4, 3, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="do not agree"):
        moe.fused_moe(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="expected"):
        moe.fused_moe(x, w13, w2, weights, ids[:, :1])
    with pytest.raises(ValueError, match="integers"):
        moe.fused_moe(x, w13, w2, weights, ids.float())


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (3, 128, 8, 16), (37, 6, 3, 16), (300, 60, 4, 64), (64, 200, 2, 32)],
)
def test_the_align_kernel_gives_exactly_what_the_torch_ops_give(backend, tokens, experts, top_k, block_m):
    """One Triton program (decode steps, CUDA graphs) against the torch ops (long prefills): the same
    arrays, element for element, whatever experts the pairs name (many idle, one crowded)."""
    moe = backend.module("moe")
    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
    ids[: tokens // 2, 0] = experts - 1  # one expert takes half the tokens' first choice
    ids = ids.to(backend.device)
    got, want = moe.moe_align(ids, experts, block_m), moe.moe_align_torch(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("experts", "top_k", "renormalize"), [(8, 2, True), (128, 8, True), (60, 4, False), (3, 1, False)]
)
def test_the_route_kernel_takes_the_references_experts_and_weights(backend, experts, top_k, renormalize):
    """fp32 logits: the same experts in the same order. bf16 logits tie often (128 experts, 8 bits of
    mantissa): equal weights, each the softmax of the expert chosen, whichever of equals is taken."""
    moe = backend.module("moe")
    logits = torch.randn(19, experts, generator=torch.Generator().manual_seed(experts)).to(backend.device)
    weights, ids = moe.moe_route(logits, top_k, renormalize)
    want_w, want_ids = reference.moe_route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    half = logits.to(torch.bfloat16)
    weights, ids = moe.moe_route(half, top_k, renormalize)
    want_w, _ = reference.moe_route(half, top_k, renormalize)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    chosen = half.float().softmax(-1).gather(1, ids.long())
    torch.testing.assert_close(chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen, want_w)
    assert all(len(set(row)) == top_k for row in ids.tolist())
    tied = torch.tensor(
        [[0.5, 2.0, 0.0, 2.0, 2.0]], device=backend.device
    )  # of equals, the lowest index first
    assert moe.moe_route(tied, 2, renormalize)[1].tolist() == [[1, 3]]
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(logits, experts + 1, renormalize)
