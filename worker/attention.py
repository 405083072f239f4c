"""Attention over one layer of the KV pool: Triton kernels (kernels.ops) on CUDA, torch on CPU.

Chooses the backend only; never decides which slots a request owns (the ForwardBatch says so).
On CPU both run through torch's fused attention (scaled_dot_product_attention) in float32, with the
semantics of kernels.reference: prefill one request at a time (a causal mask offset by its cached
prefix), or padded batches when every request has few new tokens (verify steps), decode as padded
batches of similar lengths. TRITON_INTERPRET=1 sends CPU tensors through the Triton
kernels instead (tests: the model on the kernels).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from kernels import host_checks, interpret_requested, reference
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


def extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    sm_scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """Prefill: q [T, Hq, D] attends each request's prefix slots plus its own new k, v [T, Hkv, D]
    (causal; with ``window`` > 0 the last ``window`` positions only; ``softcap`` > 0: soft-capped
    scores; ``sinks`` [Hq]: attention sinks; ``kv_scales``: an fp8 pool's K and V scales). Returns
    [T, Hq, D]. The new K/V must already be in the pool at ``batch.out_slots``: steps of few new tokens
    per request (SHORT_EXTEND) read them there, unless windowed or soft-capped (those take the extend
    path); a verify step (``batch.verify``) over an fp8 pool attends them as stored on every path. On
    the CPU, soft-capped scores, sinks and scaled pools take the reference (SDPA has none), the short
    steps' reading the new K/V back from the pool as the kernels do."""
    ops = kernel_ops(q.device)
    short = 0 < (batch.max_extend_len or SHORT_EXTEND + 1) <= SHORT_EXTEND and window <= 0 and softcap <= 0
    reads_pool = short and (
        ops is not reference or sinks is not None or kv_scales is not None or batch.batch_size > 1
    )
    if batch.verify and not reads_pool and k_cache.dtype in host_checks.FP8_POOL_DTYPES:
        # NOTE: a verify step scores its tokens as decode steps would, and those read the new K/V back
        # from the pool, rounded: so do the paths that take them as computed
        k, v = (x.to(k.dtype) for x in reference.stored_kv(k_cache, v_cache, batch.out_slots, kv_scales))
    if ops is reference:
        if short and (sinks is not None or kv_scales is not None):  # NOTE: the new K/V read back, as on CUDA
            return reference.extend_short_attention(q, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr,
                                                    batch.kv_indices, batch.out_slots, sm_scale, sinks=sinks,
                                                    kv_scales=kv_scales)  # fmt: skip
        if softcap > 0 or sinks is not None or kv_scales is not None:
            return reference.extend_attention(q, k, v, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr,
                                              batch.kv_indices, sm_scale, window=window, softcap=softcap,
                                              sinks=sinks, kv_scales=kv_scales)  # fmt: skip
        if batch.batch_size > 1 and short:
            return extend_short(q, k_cache, v_cache, batch, sm_scale)
        return _extend_sdpa(q, k, v, k_cache, v_cache, batch, sm_scale, window)
    if short:  # NOTE: verify steps, short cache-hit chunks: each KV head read once, split over the SMs
        return ops.extend_short_attention(
            q, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.out_slots, sm_scale,
            max_extend_len=batch.max_extend_len, sinks=sinks, kv_scales=kv_scales,
        )  # fmt: skip
    return ops.extend_attention(
        q, k, v, k_cache, v_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, sm_scale,
        max_extend_len=batch.max_extend_len, max_prefix_len=batch.max_prefix_len,
        config=batch.extend_config, window=window, softcap=softcap, sinks=sinks, kv_scales=kv_scales,
    )  # fmt: skip


def _extend_sdpa(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    batch: ForwardBatch, sm_scale: float, window: int = 0,
) -> torch.Tensor:  # fmt: skip
    """kernels.reference.extend_attention through SDPA, one request at a time, float32 math: new
    token j of a request with p cached tokens sees keys 0 .. p + j (plain causal when p == 0), from
    p + j - window + 1 on with a window."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_new.shape[1]
    qo, kvp, kv_indices = batch.qo_indptr.tolist(), batch.kv_indptr.tolist(), batch.kv_indices
    for i in range(len(qo) - 1):
        rows, p = slice(qo[i], qo[i + 1]), kvp[i + 1] - kvp[i]
        n = qo[i + 1] - qo[i]
        if n == 0:
            continue
        k, v = k_new[rows], v_new[rows]
        mask = None
        if p:
            slots = kv_indices[kvp[i] : kvp[i + 1]].long()
            k = torch.cat([k_cache.index_select(0, slots).to(k.dtype), k])  # NOTE: an fp8 pool widens exactly
            v = torch.cat([v_cache.index_select(0, slots).to(v.dtype), v])
        if p or 0 < window < p + n:
            ones = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
            mask = ones.tril(diagonal=p) & (ones.triu(diagonal=p - window + 1) if window > 0 else ones)
        # NOTE: [1, heads, tokens, D] views (3-D inputs take torch's slow unfused path); SDPA
        # repeats each KV head for its query heads (enable_gqa)
        o = F.scaled_dot_product_attention(
            *(x.float().transpose(0, 1).unsqueeze(0) for x in (q[rows], k, v)),
            attn_mask=mask, is_causal=mask is None, scale=sm_scale, enable_gqa=gqa,
        )  # fmt: skip
        out[rows] = o[0].transpose(0, 1).to(q.dtype)
    return out


# extend steps whose requests have at most this many new tokens each (max_extend_len) go batched on
# the CPU (extend_short) and through kernels/extend_short.py on the kernels: their new K/V are read
# from the pool, where they were stored before attention
SHORT_EXTEND = 16


def extend_short(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, sm_scale: float,
    min_saved_slots: int = 4096,
) -> torch.Tensor:  # fmt: skip
    """``_extend_sdpa`` for requests with few new tokens each (speculative decoding's verify steps,
    small prefill chunks), as padded batches like decode instead of one call per request: the new
    tokens' K/V are already in the pool (stored before attention), so request i attends its prefix
    slots then its own new slots, new token j up to its own position."""
    qo, kvp, out_slots = batch.qo_indptr.tolist(), batch.kv_indptr.tolist(), batch.out_slots
    pieces = []
    for i in range(len(qo) - 1):
        pieces += [batch.kv_indices[kvp[i] : kvp[i + 1]].long(), out_slots[qo[i] : qo[i + 1]].long()]
    slots = torch.cat(pieces)
    lens = [kvp[i + 1] - kvp[i] + qo[i + 1] - qo[i] for i in range(len(qo) - 1)]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    for group in decode_groups(lens, min_saved_slots):
        rows = [
            i for i in group if qo[i + 1] > qo[i]
        ]  # NOTE: a request row may hold no tokens (graph padding)
        if not rows:
            continue
        new = [qo[i + 1] - qo[i] for i in rows]
        width = max(new)
        # NOTE: request r's new token j goes to padded row r * width + j
        src = torch.tensor(
            [qo[i] + j for i, n in zip(rows, new, strict=True) for j in range(n)], device=q.device
        )
        dst = torch.tensor([r * width + j for r, n in enumerate(new) for j in range(n)], device=q.device)
        padded = q.new_zeros(len(rows) * width, *q.shape[1:])
        padded[dst] = q[src]
        idx = torch.tensor(rows, device=q.device)
        o = _attend_rows(padded.view(len(rows), width, *q.shape[1:]), k_cache, v_cache,
                         torch.tensor(starts, device=q.device)[idx], torch.tensor(lens, device=q.device)[idx],
                         torch.tensor(new, device=q.device), slots, sm_scale)  # fmt: skip
        out[src] = o.reshape(-1, *q.shape[1:])[dst]
    return out


def _attend_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
    new: torch.Tensor, slots: torch.Tensor, sm_scale: float,
) -> torch.Tensor:  # fmt: skip
    """q [B, N, Hq, D]: request b's slots slots[starts[b] : starts[b] + lens[b]], its last new[b]
    being its new tokens; query row j sees the first lens[b] - new[b] + j + 1 of them (rows past
    new[b] are padding). Float32 math, GQA as in ``attend_padded``. Returns [B, N, Hq, D]."""
    b, n, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    offsets = torch.arange(int(lens.max()), device=q.device)
    valid = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
    index = slots[torch.where(valid, starts.unsqueeze(1) + offsets, 0)].flatten()
    k = k_cache.index_select(0, index).view(b, -1, hkv, d).float()
    v = v_cache.index_select(0, index).view(b, -1, hkv, d).float()
    limit = (lens - new).unsqueeze(1) + torch.arange(1, n + 1, device=q.device)  # [B, N]
    mask = offsets.view(1, 1, -1) < limit.unsqueeze(2)  # [B, N, L]; padding rows stay non-empty
    mask = mask[:, None, :, None, :].expand(b, 1, n, g, mask.shape[-1]).reshape(b, 1, n * g, -1)
    # NOTE: rows ordered (token, query head of the group): [B, Hkv, N * group, D]
    qh = q.float().view(b, n, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, n * g, d)
    out = F.scaled_dot_product_attention(
        qh, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=sm_scale
    )
    return out.view(b, hkv, n, g, d).permute(0, 2, 1, 3, 4).reshape(b, n, hq, d).to(q.dtype)


def decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, sm_scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:  # fmt: skip
    """One token per request: q [B, Hq, D] attends all of the request's slots (its own K/V must
    already be stored), the last ``window`` with a window > 0, scores soft-capped with a softcap > 0,
    attention sinks with ``sinks``, an fp8 pool's ``kv_scales``. Returns [B, Hq, D]."""
    ops = kernel_ops(q.device)
    options = {"window": window, "softcap": softcap, "sinks": sinks, "kv_scales": kv_scales}
    if ops is reference:
        if softcap > 0 or sinks is not None or kv_scales is not None:
            return reference.decode_attention(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, sm_scale,
                                              **options)  # fmt: skip
        return decode_grouped(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, sm_scale, window=window)
    return ops.decode_attention(q, k_cache, v_cache, batch.kv_indptr, batch.kv_indices, sm_scale, **options)


def decode_grouped(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    min_saved_slots: int = 4096,
    window: int = 0,
) -> torch.Tensor:
    """kernels.reference.decode_attention, one padded computation per group of requests of similar
    length (a group's longest at most twice its shortest), so a long request does not make every
    short one in the batch gather and attend over its length. Groups are used only when each extra
    one saves at least ``min_saved_slots`` padded slots: below that, its extra gather and attention
    call cost more than the padding (python -m worker.bench_cpu_attention). ``window`` > 0: each
    request's last ``window`` slots."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    starts, lens = kv_indptr[:-1].long(), (kv_indptr[1:] - kv_indptr[:-1]).long()
    if window > 0:
        starts, lens = starts + (lens - window).clamp_min(0), lens.clamp_max(window)
    groups = decode_groups(lens.tolist(), min_saved_slots)
    if len(groups) <= 1:
        return attend_padded(q, k_cache, v_cache, starts, lens, kv_indices, sm_scale)
    out = torch.empty_like(q)
    for rows in groups:
        idx = torch.tensor(rows, device=q.device)
        out[idx] = attend_padded(q[idx], k_cache, v_cache, starts[idx], lens[idx], kv_indices, sm_scale)
    return out


def decode_groups(lengths: list[int], min_saved_slots: int = 4096) -> list[list[int]]:
    """length_groups(lengths), or one group of all when the split saves fewer than
    ``min_saved_slots`` padded slots per extra group."""
    groups = length_groups(lengths)
    if len(groups) > 1:
        saved = len(lengths) * max(lengths) - sum(len(g) * lengths[g[-1]] for g in groups)
        if saved < min_saved_slots * (len(groups) - 1):
            return [list(range(len(lengths)))]
    return groups


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` in groups, shortest first; a group's longest is at most twice its shortest."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and lengths[i] <= 2 * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def attend_padded(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Requests' slots kv_indices[starts[i] : starts[i] + lens[i]] gathered into [B, L_max] (padding
    masked out), float32 math, GQA by grouping query heads."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    offsets = torch.arange(int(lens.max()), device=q.device)
    valid = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
    slots = kv_indices.long()[torch.where(valid, starts.unsqueeze(1) + offsets, 0)].flatten()
    # NOTE: index_select gathers rows ~10x faster than advanced indexing (k_cache[slots]) on CPU
    k = k_cache.index_select(0, slots).view(b, -1, hkv, d).float()  # [B, L, Hkv, D]
    v = v_cache.index_select(0, slots).view(b, -1, hkv, d).float()
    # NOTE: query head h reads KV head h // (Hq // Hkv): view q as [B, Hkv, group, D], so the group
    # of query heads sharing a KV head becomes SDPA's query-length axis.
    out = F.scaled_dot_product_attention(
        q.float().view(b, hkv, hq // hkv, d), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=sm_scale,
    )  # fmt: skip
    return out.reshape(b, hq, d).to(q.dtype)
