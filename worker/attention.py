"""Attention over one layer of the KV pool: Triton kernels (kernels.ops) on CUDA, torch on CPU.

Chooses the backend only; never decides which slots a request owns (the ForwardBatch says so).
On CPU, decode runs one padded batched computation (same semantics as kernels.reference);
TRITON_INTERPRET=1 sends CPU tensors through the Triton kernels too (tests: the model on the kernels).
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import interpret_requested, reference
from worker.forward_batch import ForwardBatch

_ops: ModuleType | None = None
_ops_tried = False


def kernel_ops(device: torch.device) -> ModuleType:
    """The module whose functions run on ``device``: ``kernels.ops`` on CUDA (or any device under
    TRITON_INTERPRET=1) when it imports, else ``kernels.reference`` (both expose the same signatures)."""
    global _ops, _ops_tried
    if device.type != "cuda" and not interpret_requested():
        return reference
    if not _ops_tried:
        _ops_tried = True
        try:
            from kernels import ops  # Triton; import lazily so CPU-only installs never load it

            _ops = ops
        except ImportError:
            _ops = None
    return _ops if _ops is not None else reference


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write the new tokens' k, v [T, Hkv, D] into the layer's pool rows ``batch.out_slots``."""
    kernel_ops(k.device).store_kv(k_cache, v_cache, batch.out_slots, k, v)


def extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    sm_scale: float,
) -> torch.Tensor:
    """Prefill: q [T, Hq, D] attends each request's prefix slots plus its own new k, v [T, Hkv, D]
    (causal). Returns [T, Hq, D]."""
    ops = kernel_ops(q.device)
    return ops.extend_attention(
        q, k, v, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, sm_scale,
        max_extend_len=batch.max_extend_len,
    )  # fmt: skip


def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, sm_scale: float
) -> torch.Tensor:
    """One token per request: q [B, Hq, D] attends all of the request's slots (its own K/V must
    already be stored). Returns [B, Hq, D]."""
    ops = kernel_ops(q.device)
    if ops is reference:
        return _decode_padded(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, sm_scale)
    return ops.decode_attention(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, sm_scale)


def _decode_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """kernels.reference.decode_attention for the whole batch at once: every request's slots are
    gathered into [B, L_max] (padding masked out), float32 math, GQA by grouping query heads."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    starts, lens = kv_indptr[:-1].long(), (kv_indptr[1:] - kv_indptr[:-1]).long()
    offsets = torch.arange(int(lens.max()), device=q.device)
    valid = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
    slots = kv_indices.long()[torch.where(valid, starts.unsqueeze(1) + offsets, 0)]
    k, v = k_cache[slots].float(), v_cache[slots].float()  # [B, L, Hkv, D]
    # NOTE: query head h reads KV head h // (Hq // Hkv): view q as [B, Hkv, group, D].
    scores = torch.einsum("bhgd,blhd->bhgl", q.float().view(b, hkv, hq // hkv, d), k) * sm_scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", scores.softmax(dim=-1), v)
    return out.reshape(b, hq, d).to(q.dtype)
