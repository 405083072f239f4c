"""Argument checks the Triton host wrappers run before a launch: a bad shape, dtype or device is a
ValueError here instead of an out-of-bounds read or write on the device.

NOTE: they read tensor metadata only (shape, dtype, device, strides), never a device's tensor data, so no
check waits on the device (CUDA-graph safe); what needs the data is a documented caller contract instead
(of KV scales held on the CPU, the few values are read: kv_scales).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# an fp8 KV pool: the attention kernels widen its K/V to q's dtype as they load them (exact), the KV
# stores saturate and round into it (kernels.reference.to_pool)
FP8_POOL_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
POOL_DTYPES = ATTENTION_DTYPES + FP8_POOL_DTYPES


def e4m3_supported(device: torch.device | str) -> bool:
    """Whether the kernels can read and write float8_e4m3fn on ``device``: Triton converts it on CUDA from
    compute capability 8.9 (Ada, Hopper) on; elsewhere (the interpreter, the CPU's torch references) always.
    The KV pool (--kv-cache-dtype) and fp8 weights (--fp8-weights, --quantization) ask this one question."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def shape_of(x: torch.Tensor) -> list[int]:
    return list(x.shape)


def index_tensor(name: str, x: torch.Tensor, device: torch.device, numel: int | None = None) -> torch.Tensor:
    """``x`` as the kernels read an index tensor (indptr, slots, positions): 1-D int32/int64 on
    ``device`` with ``numel`` entries when given, returned contiguous.
    NOTE: the kernels address it as ``ptr + i``; .contiguous() is free when it already is."""
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {shape_of(x)}")
    if x.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the other inputs on {device}")
    if numel is not None and x.numel() != numel:
        raise ValueError(f"{name} must have {numel} entries, got {x.numel()}")
    return x.contiguous()


def check_max_extend_len(qo_indptr: torch.Tensor, max_extend_len: int) -> None:
    """ValueError when ``max_extend_len`` is below the longest request's new tokens (rows would go
    unwritten). Checked only where it costs nothing: ``qo_indptr`` on the CPU (the interpreter,
    tests); on CUDA it would be a sync."""
    if qo_indptr.device.type == "cpu" and qo_indptr.numel() > 1:
        longest = int((qo_indptr[1:] - qo_indptr[:-1]).max())
        if max_extend_len < longest:
            raise ValueError(f"max_extend_len={max_extend_len} < {longest}, the longest request's new tokens")


def check_unit_stride(**tensors: torch.Tensor) -> None:
    """The kernels step through head_dim (the last dim) with stride 1."""
    for name, x in tensors.items():
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")


def check_out(name: str, out: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """A preallocated output: exactly ``like``'s shape, dtype and device (the kernel writes every
    element of that shape; a smaller tensor would be written past its end)."""
    if out.shape != like.shape:
        raise ValueError(f"{name} has shape {shape_of(out)}, expected {like_name}'s {shape_of(like)}")
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{name} is {out.dtype} on {out.device}, expected {like_name}'s {like.dtype} on {like.device}"
        )


def check_pool_slots(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One S for K and V: a slot indexes each (a ValueError, not an out-of-bounds read or write)."""
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError(
            f"v_cache has {v_cache.shape[0]} slots, k_cache {k_cache.shape[0]}: expected the same"
        )


def check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> int:
    """q [T, Hq, D]; k_cache, v_cache [S, Hkv, D]; k_new, v_new [T, Hkv, D] when given (extend); one
    dtype (fp16/bf16/fp32) and device for all, except that the pool may be fp8 (FP8_POOL_DTYPES, K and V
    alike); Hq a multiple of Hkv; ``out`` like q. Returns Hkv."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D [tokens, Hq, D], got shape {shape_of(q)}")
    t, hq, d = q.shape
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must be 3-D [S, Hkv, D], got shape {shape_of(k_cache)}")
    hkv = k_cache.shape[1]
    pool_row = [hkv, d]
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dim() != 3 or list(x.shape[1:]) != pool_row:
            raise ValueError(
                f"{name} has shape {shape_of(x)}; expected [S, Hkv, D] with [Hkv, D] = {pool_row} "
                f"(D from q {shape_of(q)}, Hkv from k_cache)"
            )
    check_pool_slots(k_cache, v_cache)
    new = [(name, x) for name, x in (("k_new", k_new), ("v_new", v_new)) if x is not None]
    for name, x in new:
        if list(x.shape) != [t, hkv, d]:
            raise ValueError(
                f"{name} has shape {shape_of(x)}; expected [T, Hkv, D] = {[t, hkv, d]} "
                f"(T and D from q, Hkv from the pool)"
            )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    operands = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), *new]
    if q.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"q is {q.dtype}; the attention kernels take fp16, bf16 or fp32")
    pool = k_cache.dtype if k_cache.dtype in FP8_POOL_DTYPES and v_cache.dtype == k_cache.dtype else q.dtype
    mixed = {
        name: x.dtype for name, x in operands if x.dtype != (pool if name.endswith("_cache") else q.dtype)
    }
    if mixed:
        raise ValueError(
            f"q is {q.dtype} but {mixed}: q, k/v and the pool must share one dtype (the pool may be fp8)"
        )
    elsewhere = {name: x.device for name, x in operands if x.device != q.device}
    if elsewhere:
        raise ValueError(f"q is on {q.device} but {elsewhere}")
    check_unit_stride(**dict(operands))
    if out is not None:
        check_out("out", out, q, "q")
        check_unit_stride(out=out)
    return hkv


def check_sinks(sinks: torch.Tensor | None, hq: int, device: torch.device) -> None:
    """Attention sinks, when given: float32 [Hq], contiguous, on the inputs' device (one per query head)."""
    if sinks is None:
        return
    if sinks.shape != (hq,) or sinks.dtype != torch.float32:
        raise ValueError(f"sinks must be float32 [Hq] = [{hq}], got {sinks.dtype} {shape_of(sinks)}")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, the other inputs on {device}")
    check_unit_stride(sinks=sinks)


# an fp8 pool's K and V scales as the kernels take them (kv_scales): a pair (K's, V's), each one number for
# every KV head or a sequence of one a head, or the float32 [2, Hkv] tensor kv_scales returns
KVScales = Sequence[float | Sequence[float]] | torch.Tensor


def kv_scales(scales: KVScales | None, k_cache: torch.Tensor) -> torch.Tensor | None:
    """An fp8 pool's K and V scales as float32 [2, Hkv] on the pool's device (row 0 K's, row 1 V's, one a
    KV head: the pool's codes for head h stand for code x scale[., h]), or None without. ``scales`` is a
    pair (K's, V's), each one number (a checkpoint's scale a tensor, for every head) or Hkv numbers (one
    a head: compressed-tensors' attn_head), copied to the device at each call (so not while a CUDA graph
    captures); or the [2, Hkv] tensor itself, used as it is (what the worker holds: its values checked
    where it was loaded, as no check here reads a device's data). ValueError over a 16-bit pool, for
    another shape, dtype or device, or for values not positive and finite (read on the host)."""
    if scales is None:
        return None
    if k_cache.dtype not in FP8_POOL_DTYPES:
        raise ValueError(f"KV scales apply to an fp8 pool, not a {k_cache.dtype} one")
    hkv = k_cache.shape[1]
    if isinstance(scales, torch.Tensor):
        if scales.shape != (2, hkv) or scales.dtype != torch.float32:
            raise ValueError(f"KV scales as a tensor are float32 [2, Hkv] = [2, {hkv}] (K's, V's, one a KV "
                             f"head), got {scales.dtype} {shape_of(scales)}")  # fmt: skip
        if scales.device != k_cache.device:
            raise ValueError(f"KV scales are on {scales.device}, the pool on {k_cache.device}")
        check_unit_stride(kv_scales=scales)
        if scales.device.type == "cpu":
            _positive_finite(scales.flatten().tolist())
        return scales
    if len(scales) != 2:
        raise ValueError(f"KV scales are a pair (K's, V's), got {len(scales)} values")
    rows = []
    for s in scales:
        per_head = isinstance(s, Sequence) or (isinstance(s, torch.Tensor) and s.dim() > 0)
        row = [float(x) for x in s] if per_head else [float(s)] * hkv
        if len(row) != hkv:
            raise ValueError(f"KV scales are one number or one a KV head ({hkv}) each, got {len(row)}")
        rows.append(_positive_finite(row))
    return torch.tensor(rows, dtype=torch.float32, device=k_cache.device)


def _positive_finite(values: list[float]) -> list[float]:
    if not all(math.isfinite(s) and s > 0 for s in values):
        raise ValueError(f"KV scales are positive finite numbers, got {values}")
    return values


def kv_scale_args(scales: KVScales | None, k_cache: torch.Tensor) -> dict:
    """The attention and KV-store kernels' arguments for an fp8 pool's K and V scales (kv_scales): none
    without them, so that an unscaled launch compiles as it always has."""
    checked = kv_scales(scales, k_cache)
    if checked is None:
        return {}
    return {"KScales": checked[0], "VScales": checked[1], "KV_SCALED": True}
