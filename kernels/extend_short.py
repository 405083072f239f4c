"""Triton extend attention for requests with few new tokens each (speculative decoding's verify steps,
short cache-hit prefills): decode's split-K over the request's whole KV, its query tokens stacked.

Semantics are kernels.reference.extend_short_attention (= extend_attention with each request's new
K/V read from the pool at its out_slots); this module must never change them.
Shapes (T = new tokens in the batch, B = requests, S = slots in the pool, D = head dim):
  q [T, Hq, D]; k_cache, v_cache [S, Hkv, D] (one layer, fp16/bf16/fp32), the new tokens' K/V already
  stored at out_slots (the worker stores them before attention);
  qo_indptr [B+1]: request i owns rows qo_indptr[i]:qo_indptr[i+1] of q and of out_slots [T];
  kv_indptr [B+1], kv_indices [nnz]: request i's *prefix* slots, in token order (as for extend);
  max_extend_len: >= every request's new tokens (a host hint; it sizes the grid).
  Output [T, Hq, D] in q's dtype. New token j of a request with p cached tokens sees positions 0 .. p + j.
CALLER CONTRACTS, NOT CHECKED ON CUDA (checking needs the index data: a device-to-host sync): the
  extend kernel's (kernels/extend_attention.py), and out_slots holds slots in [0, S).

Why a second extend kernel: the extend kernel gives each (query head, 64-row block, request) one
program that reads the request's KV alone, which suits long prompts. A verify step has a few tokens
per request over a long prefix: there that kernel reads each KV head once per query head (Hq / Hkv
times), one program per head for the whole prefix. Here a program owns (request, KV head, split of
the KV, block of tokens): its rows are BLOCK_H // GROUP query tokens x the GROUP query heads of that
KV head, so one pass over the KV serves all of them (decode's layout, with a causal limit per row),
and the splits spread a long prefix over the SMs. A merge kernel combines the splits, as in decode,
and DecodeConfig.pdl launches the pair as programmatic dependents, as in decode.

Each block of tokens reads its request's KV once, so a program takes as many tokens as it can
(block_rows): every request's, up to MAX_ROWS rows. A verify step of 5 tokens under GQA 4 is then one
block of 32 rows that reads the KV once, not two blocks of 16 that read it twice. The merge keeps 16
rows a program.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import decode_attention, host_checks, interpret_requested
from kernels.decode_attention import FP8_SHORT_TILES, DecodeConfig, split_cap
from kernels.extend_attention import device_arch
from kernels.online_softmax import attend_tile, gather_kv
from kernels.pdl import pdl_active, pdl_launch, wait_then_release
from kernels.split_merge import block_kv_len, merge_rows, num_splits_of, split_partials

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
_LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * _LOG2E)
# (token, query head) rows a program takes at most, unless one token's group needs more (block_rows). NOTE:
# compiled for sm_90 (head dim 128, 16-bit, Triton 3.6; python -m kernels.compile_check), the 1-request
# decode tiles (128 tokens, 4 warps, 2 stages) take 166 registers and 3 blocks an SM at 16 rows, 205 and 2
# at 32, 255 and 1 at 64 (145 KiB of shared memory); 64-token tiles take 212 and 2 at 64 rows. kernels.bench
# times 16 rows and 64 (on 64-token tiles) beside this. A float32 q and head dims above 128 keep 16 rows
# (max_rows_for): at 32, fp32's tf32 dot spills 320 B at head dim 128 on sm_90 (328 on sm_89), and head dim
# 256 spills 56-112 B on sm_80, sm_89 and sm_90 (16-bit and fp8 pools alike).
MAX_ROWS = 32


def max_rows_for(dtype: torch.dtype, head_dim: int) -> int:
    """block_rows' cap by default for a q of ``dtype`` and ``head_dim``: MAX_ROWS for a 16-bit q at head dims
    up to 128, else 16 (see MAX_ROWS)."""
    return MAX_ROWS if dtype != torch.float32 and head_dim <= 128 else 16


def block_rows(group: int, max_extend_len: int, max_rows: int = MAX_ROWS) -> int:
    """Rows of a program, a power of two: every request's new tokens (at most ``max_extend_len``) times
    the ``group`` query heads of a KV head, at most ``max_rows``; at least 16 (tl.dot's least) and at
    least one token's group. A program takes block_rows // group tokens."""
    one_token = max(16, triton.next_power_of_2(group))
    return max(one_token, min(max_rows, triton.next_power_of_2(group * max_extend_len)))


@triton.jit
def tile_slots(kv_indices, out_slots, kv_start, q_start, prefix_len, n, hi):
    """Pool slots of a request's positions ``n`` [N] below ``hi``: its prefix's from kv_indices, its new
    tokens' from out_slots (0 past ``hi``)."""
    mask_n = n < hi
    cached = n < prefix_len
    from_prefix = tl.load(kv_indices + kv_start + n, mask=mask_n & cached, other=0)
    from_new = tl.load(out_slots + q_start + (n - prefix_len), mask=mask_n & (n >= prefix_len), other=0)
    return tl.where(cached, from_prefix.to(tl.int64), from_new.to(tl.int64))


# NOTE: num_splits and token_blocks are plain arguments: one compiled kernel serves every count
@triton.jit(do_not_specialize=["num_splits", "token_blocks"])
def _short_split_kernel(
    Q,
    K_cache,
    V_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    out_slots,
    Mid_out,  # [T, Hq, num_splits, D] fp32, each split normalised by its own sum
    Mid_lse,  # [T, Hq, >= num_splits] fp32, log2(sum exp2(score)) of the split; -inf when it sees nothing
    qk_scale,  # sm_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    num_splits,  # the most splits any block of tokens may use
    token_blocks,  # blocks of TOKENS tokens per request in the grid (cdiv(max_extend_len, TOKENS))
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,  # query tokens per program: BLOCK_H // GROUP
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    PDL: tl.constexpr,  # launched as a programmatic dependent (sm_90+): as decode's split kernel
    PREFETCH_SLOTS: tl.constexpr,  # the next tile's slots loaded before this one's K/V wait: as decode's
    KScales=None,  # KV_SCALED: [Hkv] float32, an fp8 pool's codes stand for code x KScales[h] (K's of KV head h)
    VScales=None,  # and code x VScales[h] (V's)
    KV_SCALED: tl.constexpr = False,
):
    if PDL:
        wait_then_release()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    n_new = (tl.load(qo_indptr + req + 1) - q_start).to(tl.int32)
    t0 = block * TOKENS
    if t0 >= n_new:
        return
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix_len = (tl.load(kv_indptr + req + 1) - kv_start).to(tl.int32)
    kv_len = block_kv_len(prefix_len, n_new, t0, TOKENS)
    n_splits = num_splits_of(kv_len, num_splits, MIN_SPLIT_LEN)
    if split >= n_splits:  # the merge derives n_splits the same way and never reads this one
        return
    chunk = tl.cdiv(kv_len, n_splits)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    offs_r = tl.arange(0, BLOCK_H)  # row r: token t0 + r // GROUP, query head kv_head * GROUP + r % GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t0 + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    mask_r = (offs_r < TOKENS * GROUP) & (tok < n_new)
    mask_d = offs_d < HEAD_DIM
    rows = q_start + tok
    q = tl.load(
        Q + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    limit = prefix_len + tok + 1  # row r sees positions < limit (causal over its request's new tokens)
    # NOTE: a row whose limit is at or before this split's start sees nothing here. It attends the whole
    # split instead (a fully masked row would make exp2(-inf - -inf) = NaN) and is written as an empty
    # split (lse -inf, zero partial), which the merge weighs 0; every row sees position 0 in split 0.
    sees = limit > lo

    K_head, V_head = K_cache + kv_head * stride_kch, V_cache + kv_head * stride_vch
    if KV_SCALED:  # NOTE: every key is codes of K / k_scale: folded into the scores' multiplier
        qk_scale = qk_scale * tl.load(KScales + kv_head)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if PREFETCH_SLOTS:  # NOTE: tile i + 1's K/V copies then need no slot load of their own (decode's NOTE)
        slots_next = tile_slots(kv_indices, out_slots, kv_start, q_start, prefix_len, lo + offs_n, hi)
    for n_lo in range(lo, hi, BLOCK_N):
        n = n_lo + offs_n
        mask_n = n < hi
        if PREFETCH_SLOTS:
            slots = slots_next
            slots_next = tile_slots(kv_indices, out_slots, kv_start, q_start, prefix_len, n + BLOCK_N, hi)
        else:
            slots = tile_slots(kv_indices, out_slots, kv_start, q_start, prefix_len, n, hi)
        k, v = gather_kv(K_head, V_head, slots, mask_n, stride_kcs, stride_vcs, offs_d, mask_d)
        allowed = mask_n[None, :] & ((n[None, :] < limit[:, None]) | ~sees[:, None])
        m_i, l_i, acc = attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, True, PRECISION, DOT_FP32)

    if KV_SCALED:  # NOTE: and every value codes of V / v_scale: the sum times v_scale, once
        acc = acc * tl.load(VScales + kv_head)
    live = sees & (l_i > 0.0)  # l_i is 0 for a split with no tokens (lo >= hi)
    l_safe = tl.where(live, l_i, 1.0)
    lse = tl.where(live, m_i + tl.log2(l_safe), float("-inf"))
    part = tl.where(live[:, None], acc / l_safe[:, None], 0.0)
    tl.store(
        Mid_out
        + rows[:, None] * stride_mt
        + heads[:, None] * stride_mh
        + split * stride_ms
        + offs_d[None, :],
        part,
        mask=mask_r[:, None] & mask_d[None, :],
    )
    tl.store(Mid_lse + rows * stride_lt + heads * stride_lh + split, lse, mask=mask_r)


def default_config(
    head_dim: int, dtype: torch.dtype, arch: int = 90, pool_dtype: torch.dtype | None = None
) -> DecodeConfig:
    """decode_attention.default_config for one request, except over an fp8 pool on sm_90 (head dims 65-128,
    16-bit q): FP8_SHORT_TILES there."""
    if not INTERPRETED and decode_attention.takes_fp8_tiles(head_dim, dtype, arch, pool_dtype):
        # NOTE: this kernel does not widen to fp16 (DecodeConfig.fp8_f16), and widening an fp8 tile takes
        # registers: on sm_90 its 128-token tiles compile to 255 registers with a 16 B spill (fp16 q);
        # 64-token tiles with 4 warps, 2 stages take 128 / 140 (bf16 / fp16; python -m kernels.compile_check)
        return FP8_SHORT_TILES
    return decode_attention.default_config(head_dim, dtype, arch, 1, pool_dtype)


# kernels.bench's "wide" candidate (and its compile case): WIDE_ROWS rows a program, on wide_tiles(config)
WIDE_ROWS = 64


def wide_tiles(config: DecodeConfig) -> DecodeConfig:
    """``config`` on tiles of at most 64 tokens, for WIDE_ROWS rows a program: on the default's 128-token
    tiles 64 rows compile to one block an SM (see MAX_ROWS)."""
    return dataclasses.replace(config, block_n=min(config.block_n, 64))


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
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
    max_rows: int | None = None,
) -> torch.Tensor:
    """See the module docstring. Never syncs. ``num_splits`` caps splits per block of tokens (from
    choose_num_splits when None). Any max_extend_len >= the longest request's new tokens is right;
    the grid grows with it, so for long ones the extend kernel is the better one (worker/attention.py
    picks: up to 16 new tokens here). Rows of q past the last request (a graph's padding) are left
    unwritten, as the extend kernel leaves them. Raises ValueError on inconsistent shapes, dtypes or
    devices (from metadata) and on a max_extend_len below 1. ``sinks`` [Hq] float32: attention sinks
    (kernels.reference.extend_attention's), added in the merge; ``kv_scales`` (K's, V's): an fp8 pool's
    codes scaled (kernels.reference.extend_short_attention's). ``max_rows``: block_rows' cap, a power of
    two >= 16 (max_rows_for q's dtype and head dim when None; lower, a request's tokens take more blocks:
    tests cross them so)."""
    hkv = host_checks.check_attention(q, k_cache, v_cache, out=out)
    t, hq, d = q.shape
    host_checks.check_sinks(sinks, hq, q.device)
    scaled = host_checks.kv_scale_args(kv_scales, k_cache)
    batch = qo_indptr.numel() - 1
    qo_indptr = host_checks.index_tensor("qo_indptr", qo_indptr, q.device)
    kv_indptr = host_checks.index_tensor("kv_indptr", kv_indptr, q.device, numel=batch + 1)
    kv_indices = host_checks.index_tensor("kv_indices", kv_indices, q.device)
    out_slots = host_checks.index_tensor("out_slots", out_slots, q.device, numel=t)
    if max_extend_len < 1:
        raise ValueError(f"max_extend_len must be >= 1, got {max_extend_len}")
    host_checks.check_max_extend_len(qo_indptr, max_extend_len)
    max_rows = max_rows_for(q.dtype, d) if max_rows is None else max_rows
    if max_rows < 16 or max_rows & (max_rows - 1):
        raise ValueError(f"max_rows must be a power of two >= 16, got {max_rows}")
    if out is None:
        out = torch.empty_like(q)
    if batch < 1 or t == 0:
        return out
    cfg = config or default_config(d, q.dtype, device_arch(q.device), k_cache.dtype)
    group = hq // hkv
    block_h = block_rows(group, max_extend_len, max_rows)
    tokens = block_h // group
    token_blocks = triton.cdiv(max_extend_len, tokens)
    num_splits = split_cap(num_splits, batch * token_blocks, hkv, q.device, cfg)
    block_d = max(16, triton.next_power_of_2(d))
    mid_out, mid_lse = split_partials(t, hq, num_splits, d, q.device)
    scale = d**-0.5 if sm_scale is None else sm_scale
    pdl = pdl_active(cfg.pdl, device_arch(q.device))
    _short_split_kernel[(batch, hkv, num_splits * token_blocks)](
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, out_slots, mid_out, mid_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        num_splits, token_blocks,
        GROUP=group, TOKENS=tokens, BLOCK_H=block_h, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        MIN_SPLIT_LEN=cfg.min_split_len, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16, PDL=pdl, PREFETCH_SLOTS=cfg.prefetch_slots, **scaled,
        enable_fp_fusion=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(pdl),
    )  # fmt: skip
    # NOTE: the merge keeps 16 rows' tokens a program (each row merged is a round trip of its own), however
    # many the split kernel's blocks take
    merge_tokens = block_rows(group, max_extend_len, 16) // group
    merge_rows(mid_out, mid_lse, out, qo_indptr, kv_indptr, num_splits, max_extend_len, merge_tokens,
               cfg.min_split_len, split_new_tokens=True, pdl=pdl, launch=pdl_launch(pdl), sinks=sinks,
               split_tokens=tokens)  # fmt: skip
    return out
