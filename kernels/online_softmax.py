"""The online-softmax step shared by the attention kernels (flash-attention recurrence).

One tile of keys/values updates the running row max ``m``, row sum ``l`` and accumulator ``acc``
(all float32). It never loads or stores: callers gather K/V (gather_kv: one head's tile through
slot or row indices) however their layout needs."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_kv(K, V, rows, mask_n, stride_k, stride_v, offs_d, mask_d):
    """One tile of one head's keys, transposed [D, N], and values [N, D]: ``K``/``V`` point at that
    head, ``rows`` [N] are pool slots or token rows, and rows outside ``mask_n`` (or dims outside
    ``mask_d``) read as 0."""
    k = tl.load(
        K + rows[None, :] * stride_k + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0
    )
    v = tl.load(
        V + rows[:, None] * stride_v + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
    )
    return k, v


@triton.jit
def attend_tile(
    q,  # [M, D] queries (input dtype)
    k,  # [D, N] keys, transposed (q's dtype, or fp8 from an fp8 pool)
    v,  # [N, D] values (as k)
    allowed,  # [M, N] bool: which scores count (padding and causal masks); read only when MASKED
    m_i,  # [M] running max of scaled scores (log2 domain)
    l_i,  # [M] running sum of exp2(score - m_i)
    acc,  # [M, D] running sum of p @ v
    qk_scale,  # sm_scale * log2(e)
    MASKED: tl.constexpr,  # False for a tile where every score counts: skips the select
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    EMPTY_ROWS: tl.constexpr = False,  # a row may have seen no key yet after this tile (sliding windows)
    softcap=0.0,  # SOFTCAP: each score s (natural scale) becomes softcap * tanh(s / softcap) (Gemma 2)
    SOFTCAP: tl.constexpr = False,
):
    if k.dtype.is_fp8():  # NOTE: an fp8 pool's K/V widen exactly to q's dtype (fp32 when DOT_FP32)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if SOFTCAP:  # NOTE: qk is in the log2 domain (scale times log2(e)); tanh(x) = 2 sigmoid(2x) - 1
        capped = 2.0 * tl.sigmoid(2.0 * qk * (0.6931471805599453 / softcap)) - 1.0
        qk = capped * (softcap * 1.4426950408889634)
    if MASKED:
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if EMPTY_ROWS:  # NOTE: exp2(-inf - -inf) is NaN: a row with nothing seen so far keeps l = 0, acc = 0
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p_lo = p.to(v.dtype)  # P@V runs at the input precision, as on the GPU
    if DOT_FP32:
        p_lo = p_lo.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_lo, v, input_precision=PRECISION)
    return m_new, l_i, acc
