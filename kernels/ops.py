"""Public kernel entry points: Triton on CUDA tensors (or under TRITON_INTERPRET=1), torch references otherwise.

Signatures and semantics are exactly those of kernels.reference; this module must never import triton
unless a Triton path is taken (the CPU worker may run without triton installed).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

import torch

from kernels import host_checks, interpret_requested, reference

_KERNEL_MODULES = (
    "extend_attention",
    "extend_short",
    "decode_attention",
    "pointwise",
    "fused",
    "fp8_linear",
    "lora",
    "moe",
    "sampling",
    "stream",
)


def triton_library_interpreted() -> bool:
    """Whether triton was imported in interpreter mode (importing it now if needed, under the current
    TRITON_INTERPRET). Triton fixes this per process: its own @jit library functions (tl.zeros,
    tl.cdiv, ...) are decorated once, at import, so interpreted and compiled kernels cannot mix."""
    import triton.language.standard as tl_standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl_standard.cdiv, InterpretedFunction)


def kernel_module(name: str, interpret: bool) -> ModuleType:
    """The Triton module ``kernels.<name>``, checked to run interpreted (CPU) or compiled (CUDA)."""
    if name not in _KERNEL_MODULES:
        raise ValueError(f"unknown kernel module {name!r}; expected one of {_KERNEL_MODULES}")
    library = triton_library_interpreted()
    module = importlib.import_module(f"kernels.{name}")
    if library != interpret or interpret != module.INTERPRETED:
        want = "interpreted" if interpret else "compiled"
        raise RuntimeError(
            f"{want} Triton kernels requested, but this process imported triton "
            f"{'interpreted' if library else 'compiled'} and kernels.{name} "
            f"{'interpreted' if module.INTERPRETED else 'compiled'}; TRITON_INTERPRET must be set "
            "(or unset) before triton and kernels.* are first imported"
        )
    return module


def _triton_mode(x: torch.Tensor) -> bool | None:
    """None: use the reference. Otherwise whether to run Triton interpreted (True) or compiled."""
    interpret = interpret_requested()
    if not (x.is_cuda or interpret):
        return None
    if importlib.util.find_spec("triton") is None:
        if x.is_cuda:
            raise RuntimeError("CUDA tensors need triton installed (pip install 'radixgate[worker]')")
        return None
    return interpret


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
    max_prefix_len: int | None = None,
    config: Any = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """Prefill with a cached prefix; see kernels.reference.extend_attention (``window``: sliding-window
    attention; ``softcap``: soft-capped scores; ``sinks``: attention sinks; ``kv_scales``: an fp8 pool's). ``max_extend_len`` (tokens, the most rows of any
    request) spares the Triton path a device-to-host sync; ``max_prefix_len`` (the longest cached
    prefix) picks its tiles; ``config`` (an extend_attention.ExtendConfig: an extend graph's variant)
    overrides them."""
    mode = _triton_mode(q)
    if mode is None:
        return reference.extend_attention(
            q, k_new, v_new, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
            max_extend_len=max_extend_len, window=window, softcap=softcap, sinks=sinks, kv_scales=kv_scales,
        )  # fmt: skip
    return kernel_module("extend_attention", mode).extend_attention(
        q, k_new, v_new, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale,
        max_extend_len=max_extend_len, max_prefix_len=max_prefix_len, config=config, window=window,
        softcap=softcap, sinks=sinks, kv_scales=kv_scales,
    )  # fmt: skip


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
    max_extend_len: int,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """Extend for few new tokens per request, their K/V already in the pool; see
    kernels.reference.extend_short_attention. ``max_extend_len``: the most new tokens of any request;
    ``sinks``: attention sinks; ``kv_scales``: an fp8 pool's."""
    mode = _triton_mode(q)
    if mode is None:
        return reference.extend_short_attention(
            q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out_slots, sm_scale, sinks=sinks,
            kv_scales=kv_scales,
        )  # fmt: skip
    return kernel_module("extend_short", mode).extend_short_attention(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out_slots, sm_scale,
        max_extend_len=max_extend_len, sinks=sinks, kv_scales=kv_scales,
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
    """One query token per request; see kernels.reference.decode_attention (``window``: the last slots
    attended, 0 for all; ``softcap``: soft-capped scores; ``sinks``: attention sinks; ``kv_scales``: an
    fp8 pool's)."""
    mode = _triton_mode(q)
    options = {"window": window, "softcap": softcap, "sinks": sinks, "kv_scales": kv_scales}
    if mode is None:
        return reference.decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale, **options)
    return kernel_module("decode_attention", mode).decode_attention(
        q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale, **options
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See kernels.reference.rms_norm."""
    mode = _triton_mode(x)
    if mode is None:
        return reference.rms_norm(x, weight, eps)
    return kernel_module("pointwise", mode).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernels.reference.add_rms_norm."""
    mode = _triton_mode(x)
    if mode is None:
        return reference.add_rms_norm(x, delta, weight, eps)
    return kernel_module("pointwise", mode).add_rms_norm(x, delta, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See kernels.reference.silu_and_mul."""
    mode = _triton_mode(gate_up)
    if mode is None:
        return reference.silu_and_mul(gate_up)
    return kernel_module("pointwise", mode).silu_and_mul(gate_up)


def gated_activation(
    gate_up: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0
) -> torch.Tensor:
    """See kernels.reference.gated_activation."""
    mode = _triton_mode(gate_up)
    if mode is None:
        return reference.gated_activation(gate_up, activation, alpha, limit)
    return kernel_module("pointwise", mode).gated_activation(gate_up, activation, alpha, limit)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernels.reference.apply_rope."""
    mode = _triton_mode(q)
    if mode is None:
        return reference.apply_rope(q, k, positions, cos_sin_cache)
    return kernel_module("fused", mode).apply_rope(q, k, positions, cos_sin_cache)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    kv_scales: host_checks.KVScales | None = None,
) -> None:  # fmt: skip
    """See kernels.reference.store_kv."""
    mode = _triton_mode(k)
    if mode is None:
        reference.store_kv(k_cache, v_cache, slots, k, v, kv_scales)
        return
    kernel_module("fused", mode).store_kv(k_cache, v_cache, slots, k, v, kv_scales)


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
    """See kernels.reference.rope_store_kv."""
    mode = _triton_mode(q)
    if mode is None:
        return reference.rope_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots, kv_scales)
    return kernel_module("fused", mode).rope_store_kv(
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots, kv_scales=kv_scales
    )


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_rows: int,
) -> torch.Tensor:
    """See kernels.reference.lora_add (``max_rows``: the most rows of any segment, the grid's size)."""
    mode = _triton_mode(x)
    if mode is None:
        return reference.lora_add(x, out, a, b, seg_indptr, seg_slots, max_rows)
    return kernel_module("lora", mode).lora_add(x, out, a, b, seg_indptr, seg_slots, max_rows)


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """See kernels.reference.moe_route (one launch on the GPU)."""
    mode = _triton_mode(router_logits)
    if mode is None:
        return reference.moe_route(router_logits, top_k, renormalize)
    return kernel_module("moe", mode).moe_route(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    **options: Any,
) -> torch.Tensor:  # fmt: skip
    """See kernels.reference.fused_moe (``options``: its biases and activation)."""
    mode = _triton_mode(x)
    if mode is None:
        return reference.fused_moe(x, w13, w2, topk_weights, topk_ids, **options)
    return kernel_module("moe", mode).fused_moe(x, w13, w2, topk_weights, topk_ids, **options)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None, fp8_activations: bool = False, input_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """See kernels.reference.fp8_linear (on the GPU one GEMM: the weight widened tile by tile, or with
    ``fp8_activations`` x quantized per token group, or by its static ``input_scale``, and multiplied fp8 by
    fp8)."""
    mode = _triton_mode(x)
    if mode is None:
        return reference.fp8_linear(x, weight, scale, block, bias, fp8_activations, input_scale)
    return kernel_module("fp8_linear", mode).fp8_linear(
        x, weight, scale, block, bias, fp8_activations=fp8_activations, input_scale=input_scale
    )


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's top-p threshold without a sort; see kernels.reference.top_p_threshold."""
    mode = _triton_mode(probs)
    if mode is None:
        return reference.top_p_threshold(probs, top_p)
    return kernel_module("sampling", mode).top_p_threshold(probs, top_p)
