"""Torch reference implementations of every kernel in kernels/ (float32 math).

They define the semantics the Triton kernels must match, and they are the worker's CPU path.
Shapes (T = new tokens in the batch, B = requests, S = slots in the KV pool, D = head dim):
  q [T, Hq, D]; k_new, v_new [T, Hkv, D]; k_cache, v_cache [S, Hkv, D] (one layer);
  qo_indptr [B+1]: request i owns rows qo_indptr[i]:qo_indptr[i+1] of q / k_new / v_new;
  kv_indptr [B+1], kv_indices [nnz]: request i's KV slots are kv_indices[kv_indptr[i]:kv_indptr[i+1]].
Hq must be a multiple of Hkv (GQA: query head h reads KV head h // (Hq // Hkv)).
The pool may be fp8 (float8_e4m3fn or float8_e5m2, K and V alike) under q of any float dtype: attention
reads its values as they are (fp8 widens exactly to fp16, bf16 and fp32), and the KV stores write
``to_pool``'s values into it (saturated at the format's largest finite value, rounded to nearest even).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels import host_checks

LORA_BLOCK_ROWS = 16  # rows one program of the LoRA kernels takes (kernels.lora.BLOCK_M)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int, sm_scale: float, window: int = 0,
    softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [n, Hq, D] attends k, v [n_prefix + n, Hkv, D]; query j sees keys 0 .. n_prefix + j, only the
    last ``window`` of them when window > 0 (sliding-window attention); with softcap > 0 each score s
    becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). ``sinks`` [Hq] (attention sinks,
    gpt-oss): head h's softmax also counts one more score, sinks[h], whose value is zero, so a query
    may give its keys less than all of its weight."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    total = k.shape[0]
    keys = torch.arange(total, device=q.device).unsqueeze(0)
    positions = (n_prefix + torch.arange(n, device=q.device)).unsqueeze(1)
    allowed = keys <= positions
    if window > 0:
        allowed &= keys > positions - window
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def pool_values(rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """KV pool rows [S, Hkv, D] as the values they stand for, in float32: as stored (an fp8 code widens
    exactly), or each head's codes times its ``scale`` [Hkv] (an fp8 pool with a checkpoint's KV scales:
    store_kv stored x / scale)."""
    return rows.float() if scale is None else rows.float() * scale.to(rows.device)[:, None]


def stored_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: host_checks.KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows ``slots`` of the pool as the values they stand for (pool_values), float32."""
    k_scale, v_scale = _scales_of(kv_scales, k_cache)
    rows = slots.long()
    return pool_values(k_cache[rows], k_scale), pool_values(v_cache[rows], v_scale)


def _scales_of(
    kv_scales: host_checks.KVScales | None, k_cache: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An fp8 pool's (K's, V's) scales, one a KV head each (host_checks.kv_scales), or (None, None)."""
    scales = host_checks.kv_scales(kv_scales, k_cache)
    return (None, None) if scales is None else (scales[0], scales[1])


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    max_extend_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """Prefill with a cached prefix. ``kv_indices`` holds each request's *prefix* slots only;
    the new tokens' own K/V come from ``k_new``/``v_new`` under a causal mask. Returns [T, Hq, D]
    in q's dtype. ``max_extend_len`` is a launch hint for the Triton kernel; ignored here. ``window``
    > 0: sliding-window attention, the token at position p sees positions p - window + 1 .. p only
    (positions count the request's prefix, then its new tokens). ``softcap`` > 0: scores soft-capped,
    softcap * tanh(score / softcap), before the softmax. ``sinks`` [Hq] float32: attention sinks, one
    extra score per head in each softmax, attending nothing (gpt-oss). ``kv_scales`` (K's, V's, one a
    tensor or one a KV head: host_checks.kv_scales): an fp8 pool's rows stand for their codes times their
    head's scale (pool_values); the new tokens' k_new / v_new as they are."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k_scale, v_scale = _scales_of(kv_scales, k_cache)
    out = torch.empty_like(q)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(qo) - 1):
        rows = slice(qo[i], qo[i + 1])
        if qo[i] == qo[i + 1]:
            continue
        slots = kv_indices[kvp[i] : kvp[i + 1]].long()
        k = torch.cat([pool_values(k_cache[slots], k_scale), k_new[rows].float()])
        v = torch.cat([pool_values(v_cache[slots], v_scale), v_new[rows].float()])
        out[rows] = _attend(q[rows], k, v, len(slots), scale, window, softcap, sinks).to(q.dtype)
    return out


def extend_short_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    out_slots: torch.Tensor,
    sm_scale: float | None = None,
    *,
    max_extend_len: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """extend_attention with the new tokens' K/V read from the pool at ``out_slots`` (stored there
    before attention, as the worker does; with ``kv_scales``, scaled as the prefix's are).
    ``max_extend_len`` is a launch hint; ignored here."""
    slots = out_slots.long()
    k_scale, v_scale = _scales_of(kv_scales, k_cache)
    return extend_attention(
        q, pool_values(k_cache[slots], k_scale), pool_values(v_cache[slots], v_scale), k_cache, v_cache,
        qo_indptr, kv_indptr, kv_indices, sm_scale, window=window, softcap=softcap, sinks=sinks,
        kv_scales=kv_scales,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """One query token per request, q [B, Hq, D], over all of its KV slots (the current token's
    K/V already stored), or the last ``window`` of them when window > 0; scores soft-capped when
    softcap > 0, attention sinks with ``sinks``, an fp8 pool's ``kv_scales`` (as extend_attention's).
    Returns [B, Hq, D] in q's dtype."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k_scale, v_scale = _scales_of(kv_scales, k_cache)
    out = torch.empty_like(q)
    kvp = kv_indptr.tolist()
    for i in range(q.shape[0]):
        start = kvp[i] if window <= 0 else max(kvp[i], kvp[i + 1] - window)
        slots = kv_indices[start : kvp[i + 1]].long()
        # the single query is the last of the sequence: it sees every slot
        k, v = pool_values(k_cache[slots], k_scale), pool_values(v_cache[slots], v_scale)
        o = _attend(q[i : i + 1], k, v, len(slots) - 1, scale, softcap=softcap, sinks=sinks)
        out[i] = o[0].to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> x / rms(x) * weight, computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, normed): total = x + delta in x's dtype, normed = rms_norm(total) as stored."""
    total = (x.float() + delta.float()).to(x.dtype)
    return total, rms_norm(total, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], float32 math, in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> gelu(gate) * up [T, I] with GELU's tanh approximation (Gemma's
    GeGLU), float32 math, in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


def clamped_swiglu_and_mul(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) [T, I]
    with g = min(gate, limit): gpt-oss's experts' activation. float32 math, in gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)


def gated_activation(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0, impl: Any = None
) -> torch.Tensor:
    """A gated MLP's activation by name: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "clamped_swiglu" (gpt-oss,
    with ``alpha`` and ``limit``), computed by ``impl``'s function of that name (a module: this one when
    None, kernels.pointwise for the Triton kernels)."""
    impl = impl or sys.modules[__name__]
    if activation == "silu":
        return impl.silu_and_mul(gate_up)
    if activation == "gelu_tanh":
        return impl.gelu_tanh_and_mul(gate_up)
    if activation == "clamped_swiglu":
        return impl.clamped_swiglu_and_mul(gate_up, alpha, limit)
    raise ValueError(f"unknown activation {activation!r}; silu, gelu_tanh and clamped_swiglu are")


# MXFP4 (OCP Microscaling FP4, gpt-oss's experts): a row of K values as K/32 blocks of 4-bit E2M1 codes (two a
# byte, the low nibble first: [..., K/2] uint8) and one E8M0 scale a block (2^(s - 127): [..., K/32] uint8)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # values sharing one scale


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., K/2] uint8 and scales [..., K/32] uint8 -> [..., K] in ``dtype`` (float32 math: exact,
    and exact in bf16 for the scales real checkpoints hold). Raises ValueError when the two do not describe
    the same rows."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 codes and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if (
        packed.dim() < 1
        or packed.shape[:-1] != scales.shape[:-1]
        or packed.shape[-1] != 16 * scales.shape[-1]
    ):
        raise ValueError(
            f"MXFP4 codes [..., K/2] and scales [..., K/32] expected, got {list(packed.shape)} and "
            f"{list(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[torch.stack([packed & 0x0F, packed >> 4], dim=-1).long()].flatten(-2)  # [..., K]
    exponents = scales.to(torch.int32).repeat_interleave(MXFP4_BLOCK, dim=-1) - 127
    return torch.ldexp(values, exponents).to(dtype)


def dequantize_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """An fp8 checkpoint's weight [..., N, K] (float8_e4m3fn) times its scale, in ``dtype`` (float32 math):
    with ``block`` (rows, columns), scale [..., ceil(N / rows), ceil(K / columns)] holds one multiplier a
    block (the last blocks of a row or column may be partial); without, scale holds one per tensor (any
    shape of one element) or one per output row ([..., N, 1] or [..., N])."""
    w = weight.float()
    s = scale.float()
    if block is not None:
        rows, cols = block
        n, k = w.shape[-2:]
        if tuple(s.shape[-2:]) != (-(-n // rows), -(-k // cols)):
            raise ValueError(
                f"an fp8 weight {list(w.shape)} in {rows}x{cols} blocks has scales {list(s.shape)}"
            )
        s = s.repeat_interleave(rows, dim=-2)[..., :n, :].repeat_interleave(cols, dim=-1)[..., :k]
    elif s.numel() != 1:  # NOTE: one a row, [..., N] or [..., N, 1]
        s = s if s.dim() == w.dim() and s.shape[-1] == 1 else s.unsqueeze(-1)
        if s.shape[-2] != w.shape[-2]:
            raise ValueError(f"an fp8 weight {list(w.shape)} has scales {list(scale.shape)}: not one a row")
    return (w * s).to(dtype)


def quantize_fp8_rows(w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, ...]:
    """A 16- or 32-bit weight [..., N, K] as fp8 codes of ``dtype`` and float32 scales [..., N, 1], one a row
    (quantize_fp8_groups with one group a row). dequantize_fp8_weight(codes, scales, None, ...) is the weight
    each row to fp8's precision."""
    return quantize_fp8_groups(w, w.shape[-1], dtype)


def quantize_fp8_groups(
    x: torch.Tensor, group: int, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as fp8 codes of ``dtype`` [..., K] and float32 scales [..., ceil(K / group)], one a run of
    ``group`` columns of a row (the last may be shorter): the run's largest magnitude over the format's
    largest value (1 for a run of zeros), the codes the run over its scale rounded to nearest even
    (to_pool). An fp8 projection's activations quantized per token group (fp8_linear's fp8_activations)."""
    if group < 1:
        raise ValueError(f"a quantization group needs at least one column, got {group}")
    k = x.shape[-1]
    runs = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, runs * group - k)).unflatten(-1, (runs, group))
    amax = padded.abs().amax(dim=-1)
    # NOTE: over a tensor, not a number: CUDA torch divides by a Python number as a product with its
    # reciprocal, which can round the other way; a tensor's division rounds to nearest on every device
    scale = amax / torch.full_like(amax, torch.finfo(dtype).max)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = to_pool(padded / scale.unsqueeze(-1), dtype).flatten(-2)[..., :k]
    return codes, scale


def quantize_fp8_static(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """x [..., K] as fp8 codes of ``dtype`` over one float32 ``scale`` (one element: a checkpoint's
    calibrated input scale, "activation_scheme": "static"): x over it rounded to nearest even, saturated at
    the format's largest value (to_pool). Their values are the codes times ``scale``."""
    return to_pool(x.float() / scale.float().reshape(()), dtype)


def dequantize_fp8_groups(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_fp8_groups' codes [..., K] times their scales [..., ceil(K / group)], in float32."""
    k = codes.shape[-1]
    return codes.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None, fp8_activations: bool = False, input_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [..., K] times an fp8 weight [N, K] (float8_e4m3fn or float8_e5m2) dequantized with its scale
    (dequantize_fp8_weight: one a ``block``, else one a row or one in all), plus ``bias`` [N]: float32 math,
    the output [..., N] in x's dtype (an fp8 checkpoint's projection kept in fp8; kernels.fp8_linear).
    ``fp8_activations``: x first quantized to e4m3 and dequantized (what a product of fp8 by fp8 computes):
    per token (quantize_fp8_groups, one scale a run of the blocks' columns, or a whole row without blocks),
    or with ``input_scale`` (float32, one element) by that one scale (quantize_fp8_static)."""
    w = dequantize_fp8_weight(weight, scale, block, torch.float32)
    out = (fp8_activation_values(x, block, input_scale) if fp8_activations else x.float()) @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def activation_group(block: tuple[int, int] | None, k: int) -> int:
    """Columns of x one activation scale covers for an fp8 weight of ``block`` scales over ``k`` columns:
    the blocks' columns (a step of the product lies in one), else the whole row."""
    return k if block is None else min(block[1], k)


def fp8_activation_values(
    x: torch.Tensor, block: tuple[int, int] | None, input_scale: torch.Tensor | None = None
) -> torch.Tensor:  # fmt: skip
    """x [..., K] as fp8 activations for a weight of ``block`` scales give it to the product, in float32:
    quantized per run of activation_group's columns (quantize_fp8_groups), or by ``input_scale`` where
    given (quantize_fp8_static), then dequantized."""
    if input_scale is not None:
        return quantize_fp8_static(x, input_scale).float() * input_scale.float().reshape(())
    group = activation_group(block, x.shape[-1])
    return dequantize_fp8_groups(*quantize_fp8_groups(x, group), group)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts router's choice: router_logits [T, E] -> (topk_weights [T, K] float32,
    topk_ids [T, K] int32): the K largest of softmax(logits) (float32 math), divided by their sum when
    ``renormalize`` (Mixtral, Qwen3-MoE), as they are otherwise (Qwen2-MoE). The worker's path on
    every device (torch ops, no host sync)."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
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
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mixture-of-experts MLP: x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I],
    topk_weights / topk_ids [T, K] -> [T, H] in x's dtype: token t's sum over j of topk_weights[t, j] *
    (w2[e] @ act(w13[e] @ x_t + b13[e]) + b2[e]), e = topk_ids[t, j], with the biases b13 [E, 2I] and
    b2 [E, H] where given and ``act`` the gated_activation named ``activation``. float32 math; the
    gate/up product and its activation rounded to x's dtype (as kernels.moe rounds them between its
    launches). With ``w13_scales`` [E, 2I, H/32] (``w2_scales`` [E, H, I/32]) a uint8 w13 (w2) is MXFP4,
    [E, 2I, H/2] ([E, H, I/2]): its weights are dequantize_mxfp4's, in x's dtype; an fp8 one (float8_e4m3fn
    or float8_e5m2, an fp8 checkpoint's experts) has float32 scales, one a ``fp8_block`` block of each
    expert's weight ([E, ceil(N / rows), ceil(K / cols)]) or, without, one a row ([E, N, 1]): its weights
    are dequantize_fp8_weight's, in float32. ``fp8_activations``: each GEMM's input (x, then the activation)
    quantized to e4m3 per token group first and dequantized (quantize_fp8_groups, one scale a run of
    ``fp8_block``'s columns, else a whole row), or by one float32 scale each (``w13_input_scale`` for x,
    ``w2_input_scale`` for the activation: quantize_fp8_static) where given, and dequantized: what a product
    of fp8 by fp8 computes."""

    def inputs(a: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
        """A GEMM's input rows in float32, as fp8 activations round them when asked."""
        return fp8_activation_values(a, fp8_block, input_scale) if fp8_activations else a.float()

    def weight(w: torch.Tensor, scales: torch.Tensor | None, e: int) -> torch.Tensor:
        """Expert e's weight in float32 (MXFP4 and fp8 ones dequantized: only the experts the batch chose)."""
        if scales is not None and w.dtype != torch.uint8:
            return dequantize_fp8_weight(w[e], scales[e], fp8_block, torch.float32)
        return (w[e] if scales is None else dequantize_mxfp4(w[e], scales[e], x.dtype)).float()

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    x_in = inputs(x, w13_input_scale)
    for e in torch.unique(ids).tolist():
        tokens, choice = (ids == e).nonzero(as_tuple=True)
        gate_up = x_in[tokens] @ weight(w13, w13_scales, e).T
        if b13 is not None:
            gate_up += b13[e].float()
        act = gated_activation(gate_up.to(x.dtype), activation, alpha, limit)
        y = inputs(act, w2_input_scale) @ weight(w2, w2_scales, e).T
        if b2 is not None:
            y += b2[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, choice].float()[:, None])
    return out.to(x.dtype)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding, NeoX / HF-Llama layout (rotate the two halves of each head).
    ``cos_sin_cache`` [max_pos, D]: cos in [:, :D/2], sin in [:, D/2:]. Returns new (q, k)."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kv_scales: host_checks.KVScales | None = None,
) -> None:  # fmt: skip
    """Write k, v [T, Hkv, D] into the pool rows ``slots`` [T] (in place); with an fp8 pool's ``kv_scales``
    (K's, V's; host_checks.kv_scales) each value over its KV head's scale (float32 division), then rounded
    into the pool."""
    scales = host_checks.kv_scales(kv_scales, k_cache)
    if scales is not None:
        k, v = k.float() / scales[0].to(k.device)[:, None], v.float() / scales[1].to(v.device)[:, None]
    k_cache[slots.long()] = to_pool(k, k_cache.dtype)
    v_cache[slots.long()] = to_pool(v, v_cache.dtype)


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV pool of ``dtype`` stores it: fp8 saturates at the format's largest finite value
    (never inf or NaN for a finite x) and rounds to nearest even from float32; other dtypes convert."""
    if dtype in host_checks.FP8_POOL_DTYPES:
        top = torch.finfo(dtype).max
        return x.float().clamp(-top, top).to(dtype)
    return x.to(dtype)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scales: host_checks.KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope, then store_kv of the rotated k and v (``kv_scales``: store_kv's); returns the rotated
    (q, k)."""
    q, k = apply_rope(q, k, positions, cos_sin_cache)
    store_kv(k_cache, v_cache, slots, k, v, kv_scales)
    return q, k


def lora_segments(
    slots: Sequence[int] | np.ndarray, indptr: Sequence[int] | np.ndarray, cap: int
) -> tuple[np.ndarray, np.ndarray]:
    """lora_add's (seg_indptr [n+1], seg_slots [n]) (int64, host) for n requests where request i of
    adapter slot ``slots[i]`` owns rows indptr[i]:indptr[i+1]: each run of neighbouring requests on one
    slot is one segment, cut every ``cap`` rows. ``cap`` must be at least each request's rows, so
    there are never more segments than requests: the unused ones are empty (at the end, slot -1), and
    the kernels' grid, which is sized by the segment count and ``cap``, is the batch's whatever its
    adapters. The rows and deltas are the same as with one segment per request; a run's rows then load
    the adapter's weights once per ``LORA_BLOCK_ROWS`` rows instead of once per request."""
    slots, indptr = np.asarray(slots, dtype=np.int64), np.asarray(indptr, dtype=np.int64)
    n = slots.size
    if indptr.size != n + 1:
        raise ValueError(f"indptr needs {n + 1} entries for {n} slots, got {indptr.size}")
    if cap <= 0 or (n and int(np.diff(indptr).max()) > cap):
        raise ValueError(f"cap {cap} is below a request's rows")
    first = np.ones(n, dtype=bool)
    first[1:] = slots[1:] != slots[:-1]
    starts = indptr[:-1][first]
    ends = np.append(starts[1:], indptr[-1])
    chunks = np.maximum(1, -(-(ends - starts) // cap))  # an empty run keeps one (empty) segment
    within = np.arange(int(chunks.sum())) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    seg_indptr = np.full(n + 1, indptr[-1] if n else 0, dtype=np.int64)
    seg_slots = np.full(n, -1, dtype=np.int64)
    seg_indptr[: within.size] = np.repeat(starts, chunks) + within * cap
    seg_slots[: within.size] = np.repeat(slots[first], chunks)
    return seg_indptr, seg_slots


def lora_rows(
    seg_indptr: torch.Tensor, seg_slots: torch.Tensor, max_rows: int | None = None
) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for each adapter slot of lora_add's segments (int64 rows on seg_indptr's
    device; slot -1 left out): what the reference path computes once per batch."""
    bounds, slots = seg_indptr.long().cpu(), seg_slots.long().cpu()
    lengths = (bounds[1:] - bounds[:-1]).clamp(min=0, max=max_rows)
    segment = torch.repeat_interleave(torch.arange(slots.numel()), lengths)  # each covered row's segment
    within = torch.arange(segment.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    rows, row_slots = bounds[:-1][segment] + within, slots[segment]
    return [(s, rows[row_slots == s].to(seg_indptr.device)) for s in row_slots.unique().tolist() if s >= 0]


def lora_add_rows(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    groups: list[tuple[int, torch.Tensor]],
) -> torch.Tensor:
    """lora_add with its segments given as lora_rows' groups: one pair of matmuls per adapter."""
    for s, r in groups:
        y = (x.index_select(0, r).float() @ a[s].float().t()).to(x.dtype).float()
        out.index_copy_(0, r, (out.index_select(0, r).float() + y @ b[s].float().t()).to(out.dtype))
    return out


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_rows: int | None = None,
) -> torch.Tensor:
    """LoRA deltas of a batch that mixes adapters, added to ``out`` in place (returned).
    x [T, K]; out [T, N] (the base projection of x); a [S, R, K]; b [S, N, R] (S adapter slots);
    segment i owns rows seg_indptr[i]:seg_indptr[i+1] (its first ``max_rows`` only, when given) and
    gains (x @ a[s]^T) @ b[s]^T with s = seg_slots[i]; a slot of -1 leaves its rows alone. Float32
    math, with the [rows, R] product rounded to x's dtype (as two matmuls in that dtype round it)."""
    return lora_add_rows(x, out, a, b, lora_rows(seg_indptr, seg_slots, max_rows))


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p threshold [B] (float32): sort the row's probabilities [B, V], keep each token
    whose higher-ranked tokens hold less than top_p of the mass (the top one always), and return the
    smallest probability kept."""
    ranked = probs.float().sort(dim=-1, descending=True).values
    mass_before = ranked.cumsum(dim=-1) - ranked
    kept = (mass_before < top_p.float().unsqueeze(1)).sum(dim=-1).clamp_min(1)  # NOTE: a prefix of the ranks
    return ranked.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
