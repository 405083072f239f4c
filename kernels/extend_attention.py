"""Triton extend (prefill with a cached prefix) attention over a paged KV pool, ragged batch in one launch.

Semantics are kernels.reference.extend_attention; this module must never change them.
Shapes (T = new tokens in the batch, B = requests, S = slots in the pool, D = head dim):
  q [T, Hq, D]; k_new, v_new [T, Hkv, D]; k_cache, v_cache [S, Hkv, D] (one layer, fp16/bf16/fp32);
  qo_indptr [B+1] (int32/int64): request i owns rows qo_indptr[i]:qo_indptr[i+1] of q / k_new / v_new;
  kv_indptr [B+1], kv_indices [nnz] (int32/int64): request i's *prefix* slots, in token order.
  Output [T, Hq, D] in q's dtype. Query head h reads KV head h // (Hq // Hkv).
  One dtype for q, k_new, v_new and the pool; a preallocated ``out`` has q's shape and dtype. The wrapper
  checks all of this from metadata (ValueError) and passes the index tensors on contiguous.
``max_prefix_len`` (tokens, the longest cached prefix) is a host hint for the tile choice only
(default_config, with T); it never changes what is computed. ``window`` > 0 is sliding-window
attention: the new token at position p (prefix included) sees positions p - window + 1 .. p only.
CALLER CONTRACTS, NOT CHECKED ON CUDA (checking needs the index data: a device-to-host sync):
  - max_extend_len, when given, is >= the longest request's new tokens (max of qo_indptr's diffs);
    a smaller hint silently leaves the later rows of longer requests unwritten (checked, ValueError,
    only when qo_indptr is on the CPU: the interpreter and tests).
  - qo_indptr and kv_indptr are non-decreasing, qo_indptr[-1] <= T, kv_indptr[-1] <= len(kv_indices),
    and every kv_indices entry is a slot in [0, S); otherwise the kernel reads out of bounds.
Math: scores and softmax in fp32 (exp2 with log2(e) folded into the scale), P@V accumulated in fp32.

Prefix splits (ExtendConfig.split_prefix, or an explicit ``num_splits`` > 1): a batch of few new tokens
over a long cached prefix gives this kernel few programs (Hq x query blocks: 64 for 256 new tokens
in 128-row blocks), each walking the whole prefix one tile at a time, on a GPU with 132 SMs. With
splits, each program takes one part of its request's prefix (tile-aligned, at least MIN_SPLIT_LEN
tokens a split, at most ``num_splits``), the last part also takes the request's own new tokens, and
each writes a partial output and its log2-sum-exp, which a merge kernel combines, as decode does
(kernels/split_merge.py). The split cap comes from the grid (enough programs for SPLIT_WAVES waves of
SMs) and, when known, the longest prefix; inside the kernel each request takes only the splits its
prefix fills, so it needs no host sync and a CUDA graph replays over any prefix. Eager calls take it
over a deep prefix (EAGER_SPLIT_MIN_PREFIX cached tokens, sm_90, 16-bit pools), where every eager
measurement found it faster; over shorter prefixes they disagree, and it stays off (default_config). In
the worker's extend graphs it pays over long prefixes: graph_configs and graph_variant say which graphs
take it and which steps replay them.

Packed blocks (ExtendConfig.packed_blocks, PACKED_BLOCKS; batches of more than one request): the grid
is (Hq, block slots, splits) with one slot per query block that exists (split_merge.packed_blocks: at
most cdiv(T, BLOCK_M) + requests - 1), each program finding its (request, block) from a prefix sum of
the requests' block counts (split_merge.locate_block), instead of (Hq, blocks of the longest request,
requests). An extend graph has 32 request rows, mostly empty at a cache hit: unpacked, 31 of them are
programs that load qo_indptr and exit; packed, 31 slots per head at most. Off by default until
kernels.sweep's extend-graph rows say it pays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested
from kernels.online_softmax import attend_tile, gather_kv
from kernels.split_merge import (
    finish_split,
    locate_block,
    merge_rows,
    packed_blocks,
    prefix_splits_of,
    request_lanes,
    sm_count,
    split_partials,
    splits_for,
)

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
_LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * _LOG2E)
# On sm_90 a batch of few new tokens over a long cached prefix takes the long-prefix tiles: at least
# LONG_PREFIX tokens in its longest prefix and at most FEW_NEW_TOKENS new tokens in all (twice that from
# DEEP_PREFIX on). Measured on an H100 with python -m kernels.sweep (see default_config).
LONG_PREFIX = 1024
DEEP_PREFIX = 8192
FEW_NEW_TOKENS = 1024
# The prefix split in every default configuration (CUDA graphs' too): off. Benchmarks flip it for a process
# (worker.bench_profile --split-prefix) to time a model step with it. default_config takes it for eager calls
# over a deep prefix (EAGER_SPLIT_MIN_PREFIX) on sm_90 whatever this says.
SPLIT_PREFIX = False
# An eager call whose longest prefix is known and at least this long (tokens) takes the prefix split on sm_90
# (head dims 65-128, 16-bit q and pool); the split cap (prefix_split_cap) then splits only a small grid.
EAGER_SPLIT_MIN_PREFIX = DEEP_PREFIX
PACKED_BLOCKS = False  # likewise the packed grid (ExtendConfig.packed_blocks)
# An extend graph (worker.extend_graph) is captured over a prefix of unknown length, so the default tiles
# are those of an unknown prefix (64x32 on sm_90) and its split cap comes from its tokens alone. The worker
# also captures it in the configurations graph_configs names ("long_prefix": the long-prefix tiles, "split":
# the default tiles with the prefix split) and replays the one graph_variant picks for the step's longest
# cached prefix. From kernels.sweep's extend-graph rows on an H100 (one request in a graph of 32 rows:
# docs/benchmarks/kernels-sweep-split-nvidia-h100-80gb-hbm3.json): 128x64 beat 64x32 from 512 cached
# tokens (1.11-1.46x) and lost with none (0.75-0.89x); the split beat 128x64 from 1,024 cached tokens in
# graphs of 32-64 tokens, from 2,048 at 128 and from 4,096 at 256 (and 64x32 unsplit from 1,024 at 32-128
# tokens, from 2,048 at 256), up to 5x at 16,384. The rule takes the fastest on all 24 rows
# (tests/kernels/test_sweep.py).
GRAPH_LONG_TILES_MIN_PREFIX = 512  # tokens
SPLIT_GRAPH_MIN_PREFIX = 1024  # tokens
SPLIT_GRAPH_PREFIX_PER_TOKEN = 16  # cached tokens per graph token, against the long-prefix tiles
SPLIT_GRAPH_PREFIX_PER_TOKEN_DEFAULT_TILES = 8  # against the default tiles (where no long-prefix tiles)
MAX_PREFIX_SPLITS = 16
SPLIT_WAVES = 2  # prefix splits aim for this many waves of programs per SM
MERGE_TOKENS = 8  # rows of one (request, query head) a merge program combines


@dataclasses.dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes (tokens) and launch shape for one head_dim / dtype."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_prefix: bool = False  # split each request's prefix over several programs when the grid is small
    min_split_len: int = 256  # the shortest prefix part worth a split (tokens)
    packed_blocks: bool = False  # a batch's grid holds the query blocks that exist (no empty requests' rows)


# sm_90's two tile choices at head dims 65-128 (fp16/bf16); default_config picks between them
SM90_TILES = ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
LONG_PREFIX_TILES = ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
FP8_PRE_HOPPER_TILES = ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)  # default_config
# sm_90's tiles over an fp8 pool (head dims 65-128, 16-bit q) wherever a batch may have a prefix
FP8_PREFIX_TILES = ExtendConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)


def default_config(
    head_dim: int,
    dtype: torch.dtype,
    arch: int = 90,
    max_prefix_len: int | None = None,
    new_tokens: int | None = None,
    pool_dtype: torch.dtype | None = None,
) -> ExtendConfig:
    """Defaults for compute capability ``arch`` (x10: 90 = H100) and a batch whose longest cached prefix
    is ``max_prefix_len`` tokens and whose requests have ``new_tokens`` new tokens in all (None: unknown,
    as in a CUDA graph replayed over any prefix), over a pool of ``pool_dtype`` (None: ``dtype``); small
    tiles in the interpreter so short test sequences span many tiles. The prefix split is on for eager
    calls over a deep prefix (EAGER_SPLIT_MIN_PREFIX) and everywhere SPLIT_PREFIX says, the packed grid
    where PACKED_BLOCKS says."""
    cfg = _default_tiles(head_dim, dtype, arch, max_prefix_len, new_tokens)
    sm90_tiles = not INTERPRETED and 64 < head_dim <= 128 and arch >= 90 and dtype != torch.float32
    fp8 = pool_dtype in host_checks.FP8_POOL_DTYPES
    if fp8 and sm90_tiles and head_dim == 128 and max_prefix_len != 0:
        # NOTE: python -m kernels.tune --kind extend --kv-dtype fp8 on an H200 (bf16, head dim 128; docs/
        # benchmarks/kernels-tune-fp8-extend-nvidia-h200-2026-11-29-2.json): 128x128 with 8 warps, 2 stages
        # ran 1.18-1.33x the default's time on all four shapes with a prefix (4,096-16,384 cached tokens,
        # 256-1,024 new), against both 64x32 and the long-prefix tiles. Without a prefix the pool is not
        # read (0.97x and 1.25x there): the 16-bit choice stays. At head dim 128 it compiles to 252-254
        # registers on sm_90 (Triton 3.6); masked head dims (96) spill 88-96 B, so they keep theirs.
        cfg = FP8_PREFIX_TILES
    if sm90_tiles and not fp8 and max_prefix_len is not None and max_prefix_len >= EAGER_SPLIT_MIN_PREFIX:
        # NOTE: eager calls over a deep prefix, the split where the grid leaves SMs idle: kernels.bench's split
        # rows (1 x 16k + 1,024 new, 4 x 16k + 256) ran 1.10-1.12x the unsplit tiles on an H100 and on an
        # H200 (twice), and kernels.sweep's eager rows from 8,192 cached tokens 1.02-3.0x (H100,
        # docs/benchmarks/kernels-sweep-split-nvidia-h100-80gb-hbm3.json). Below, they disagree: at
        # 4,096 the bench's 1 x 256 row ran 1.17, 1.21 and 0.68x, the sweep's 0.74x, and the sweep's split
        # lost on 11 of its 13 rows under 8,192 (down to 0.34x at 1,024; tests/kernels/test_sweep.py).
        cfg = dataclasses.replace(cfg, split_prefix=True)
    if fp8 and arch < 90 and not INTERPRETED:
        # NOTE: before Hopper, widening an fp8 tile for mma.sync takes registers the 16-bit pools' tiles
        # do not have: at head dim 128 they spill 16 B (sm_80) and 8 B (sm_89); 32x16 with 4 warps spills
        # at no head dim up to 256 on either (python -m kernels.compile_check --arch 80 / 89)
        cfg = FP8_PRE_HOPPER_TILES
    if SPLIT_PREFIX or PACKED_BLOCKS:
        cfg = dataclasses.replace(
            cfg, split_prefix=cfg.split_prefix or SPLIT_PREFIX, packed_blocks=PACKED_BLOCKS
        )
    return cfg


def _default_tiles(
    head_dim: int, dtype: torch.dtype, arch: int, max_prefix_len: int | None, new_tokens: int | None
) -> ExtendConfig:
    if INTERPRETED:
        return ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, min_split_len=16)
    # NOTE: each fp16/bf16 choice compiles without register spills for sm_80, sm_89 and sm_90
    # (python -m kernels.compile_check --arch N): 128x64 with 4 warps spills at head_dim 64 on sm_90,
    # and before Hopper (mma.sync, no wgmma) 128x64 spills at head_dim 128 while 128x32 does not.
    # fp32 (an ieee dot on CUDA cores, a correctness path) spills at head_dim 128 with every tile
    # tried on sm_90; 32x16 spills least. Above 128 (BLOCK_D 256) the former 64x32 with 4 warps spilled
    # at head_dim 256 (255 registers; 120 / 128 / 16 B per thread on sm_90 / sm_80 / sm_89); 64x16 with
    # 8 warps does not (195 registers on sm_90, with wgmma), nor, with more headroom before Hopper,
    # 32x16 (128 on sm_80). At head_dim 512 64x16 spills 440 B on sm_90 and 32x16 does not (sm_80, sm_90;
    # it still spills 24 B on sm_89). See docs/kernels.md.
    if dtype == torch.float32:
        if head_dim <= 64:
            return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    # NOTE: on sm_90 (head_dim 128, bf16) python -m kernels.tune measured 64x32 with 4 warps 1.19x faster
    # than 128x64 with 8 warps over its four shapes (geomean; 1.48x with a 4096-token prefix, 0.99x at
    # 4 x 4096 new tokens): docs/benchmarks/kernels-tune-nvidia-h200.json. Head dim 64 is not tuned yet.
    # 128x64 with 8 warps and 3 stages wins where the grid is small and each program's walk over the
    # prefix is long: few new tokens (few query blocks) over a long prefix. On an H100 (kernels.sweep,
    # docs/benchmarks/kernels-sweep-nvidia-h100-80gb-hbm3.json) it ran 1.16-1.45x faster than 64x32 at
    # <= 1024 new tokens over prefixes of 1024-32768 and 1.05-1.14x at 2048 new tokens over prefixes of
    # 8192 and more; it lost without a prefix (0.70-0.92x), at 3072 new tokens (0.92-0.96x) and at 16384
    # (kernels.bench's rows: 0.88-0.94x).
    if 64 < head_dim <= 128 and arch >= 90:
        return LONG_PREFIX_TILES if long_prefix_batch(max_prefix_len, new_tokens) else SM90_TILES
    if head_dim <= 64:
        return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return ExtendConfig(block_m=128, block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 256 and arch >= 90:
        return ExtendConfig(block_m=64, block_n=16, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=32, block_n=16, num_warps=8, num_stages=2)


def long_prefix_batch(max_prefix_len: int | None, new_tokens: int | None) -> bool:
    """Whether a batch with this longest cached prefix and this many new tokens in all takes the
    long-prefix tiles on sm_90 (head dims 65-128, fp16/bf16); False when either is unknown."""
    if max_prefix_len is None or new_tokens is None or max_prefix_len < LONG_PREFIX:
        return False
    return new_tokens <= (2 * FEW_NEW_TOKENS if max_prefix_len >= DEEP_PREFIX else FEW_NEW_TOKENS)


def prefix_split_cap(
    num_splits: int | None,
    new_tokens: int,
    hq: int,
    device: torch.device,
    cfg: ExtendConfig,
    max_prefix_len: int | None = None,
) -> int:
    """The prefix split cap a launch uses, in 1..MAX_PREFIX_SPLITS: ``num_splits`` when given (a CUDA
    graph fixes it); 1 when ``cfg`` does not split; else enough splits that the Hq x query-block
    programs of ``new_tokens`` rows make SPLIT_WAVES waves on ``device``'s SMs, no more than the longest
    prefix (``max_prefix_len``, when known) fills with ``cfg.min_split_len``-token parts."""
    if num_splits is None:
        if not cfg.split_prefix:
            return 1
        programs = hq * triton.cdiv(max(new_tokens, 1), cfg.block_m)
        return splits_for(
            programs, sm_count(device), SPLIT_WAVES, max_prefix_len, cfg.min_split_len, MAX_PREFIX_SPLITS
        )
    return int(min(max(num_splits, 1), MAX_PREFIX_SPLITS))


@functools.lru_cache(maxsize=8)
def _arch_of(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def graph_configs(
    new_tokens: int, hq: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    pool_dtype: torch.dtype | None = None,
) -> dict[str, ExtendConfig]:  # fmt: skip
    """The configurations besides the default worth capturing an extend graph of ``new_tokens`` rows in
    (its prefix unknown; the pool ``pool_dtype``), by name: "long_prefix" where the long-prefix tiles
    differ from the default's, "split" where the prefix split would give the default tiles more programs
    on ``device``."""
    arch = device_arch(device)
    default = default_config(head_dim, dtype, arch, None, new_tokens, pool_dtype)
    configs = {}
    long_prefix = default_config(head_dim, dtype, arch, LONG_PREFIX, new_tokens, pool_dtype)
    if long_prefix != default:
        configs["long_prefix"] = long_prefix
    split = dataclasses.replace(default, split_prefix=True)
    if prefix_split_cap(None, new_tokens, hq, device, split) > 1:
        configs["split"] = split
    return configs


def graph_variant(max_prefix_len: int, graph_tokens: int, variants: Collection[str]) -> str:
    """Which of an extend graph's captures (``variants``: graph_configs' names) runs a step whose longest
    cached prefix is ``max_prefix_len`` tokens fastest: "split", "long_prefix" or "default" (see
    GRAPH_LONG_TILES_MIN_PREFIX)."""
    per_token = (
        SPLIT_GRAPH_PREFIX_PER_TOKEN
        if "long_prefix" in variants
        else SPLIT_GRAPH_PREFIX_PER_TOKEN_DEFAULT_TILES
    )
    if "split" in variants and max_prefix_len >= max(SPLIT_GRAPH_MIN_PREFIX, per_token * graph_tokens):
        return "split"
    if "long_prefix" in variants and max_prefix_len >= GRAPH_LONG_TILES_MIN_PREFIX:
        return "long_prefix"
    return "default"


def device_arch(device: torch.device) -> int:
    """Compute capability x10 of a CUDA device (cached); 90, the H100 the defaults are chosen for, for
    any other device."""
    if device.type != "cuda":
        return 90
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _attend_rows(
    q, K, V, rows, mask_n, offs_m, n, stride_k, stride_v, offs_d, mask_d, m_i, l_i, acc, qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    window=0, WINDOW_FROM=None, WINDOWED: tl.constexpr = False, softcap=0.0, SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """One key tile: K/V of one head at token ``rows`` (pool slots or new-token rows) into the running
    softmax. MASKED: apply ``mask_n`` (and, when CAUSAL, key n <= query m) to the scores. WINDOWED: also
    key n > WINDOW_FROM - window ([M]: each query's position in the key numbering of ``n``)."""
    k, v = gather_kv(K, V, rows, mask_n, stride_k, stride_v, offs_d, mask_d)
    allowed = mask_n[None, :]
    if CAUSAL:
        allowed = allowed & (n[None, :] <= offs_m[:, None])
    if WINDOWED:
        allowed = allowed & (n[None, :] > WINDOW_FROM[:, None] - window)
    return attend_tile(q, k, v, allowed, m_i, l_i, acc, qk_scale, MASKED, PRECISION, DOT_FP32, WINDOWED, softcap,
                       SOFTCAP)  # fmt: skip


# NOTE: num_splits is a plain (unspecialised) argument: one compiled kernel serves every split count
@triton.jit(do_not_specialize=["num_splits", "batch", "window", "softcap"])
def _extend_kernel(
    Q,
    K_new,
    V_new,
    K_cache,
    V_cache,
    Out,
    Mid_out,  # [T, Hq, num_splits, D] fp32, each split normalised by its own sum (SPLIT only)
    Mid_lse,  # [T, Hq, >= num_splits] fp32, log2(sum exp2(score)) of the split (SPLIT only)
    qo_indptr,
    kv_indptr,
    kv_indices,
    qk_scale,  # sm_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_ot,
    stride_oh,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    num_splits,  # the most prefix splits any request may use (SPLIT only)
    batch,  # requests (PACKED only)
    window,  # sliding window: keys a query sees, its own included (WINDOWED only)
    softcap,  # scores soft-capped: softcap * tanh(score / softcap) (SOFTCAP only)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    SPLIT: tl.constexpr,  # the prefix is split over programs; partials go to Mid_out / Mid_lse
    PACKED: tl.constexpr,  # grid (Hq, block slots, splits): query blocks found by locate_block
    BLOCK_R: tl.constexpr,  # >= the requests, a power of two (PACKED only)
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    WINDOWED: tl.constexpr,  # sliding-window attention: the query at position p sees p - window + 1 .. p
    SOFTCAP: tl.constexpr,
    Sinks=None,  # [Hq] attention sinks, natural-log scores of nothing (SINKS only; split: the merge's)
    SINKS: tl.constexpr = False,
    KScales=None,  # KV_SCALED: [Hkv] float32, an fp8 pool's codes stand for code x KScales[h] (K's of KV head h)
    VScales=None,  # and code x VScales[h] (V's)
    KV_SCALED: tl.constexpr = False,
):
    head = tl.program_id(0)
    if PACKED:
        req, m_block = locate_block(qo_indptr, batch, tl.program_id(1), BLOCK_M, BLOCK_R)
        if req >= batch:  # NOTE: a slot past the batch's last block
            return
        split = tl.program_id(2)
    else:
        m_block = tl.program_id(1)
        if SPLIT:
            req = tl.program_id(2) // num_splits
            split = tl.program_id(2) % num_splits
        else:
            req = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    q_len = (tl.load(qo_indptr + req + 1) - q_start).to(tl.int32)
    m_lo = m_block * BLOCK_M
    if m_lo >= q_len:  # NOTE: the grid covers the longest request; shorter ones exit here
        return
    prefix_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix_len = (tl.load(kv_indptr + req + 1) - prefix_start).to(tl.int32)
    p_lo = 0
    p_hi = prefix_len
    if SPLIT:
        n_splits = prefix_splits_of(prefix_len, num_splits, MIN_SPLIT_LEN)
        if split >= n_splits:  # the merge derives n_splits the same way and never reads this one
            return
        # NOTE: tile-aligned parts, so only the part holding the prefix's end has a partial tile; a part
        # past the end is empty (lse -inf, weight 0), and the last split also attends the new tokens
        chunk = tl.cdiv(tl.cdiv(prefix_len, n_splits), BLOCK_N) * BLOCK_N
        p_lo = tl.minimum(split * chunk, prefix_len)
        p_hi = tl.minimum(p_lo + chunk, prefix_len)

    offs_m = m_lo + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM

    rows = q_start + offs_m
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # NOTE: every valid row sees every key of its first tile but for padding (a part's first tile holds
    # at least one prefix key, the new tokens' first tile key 0), so m_i is finite after one tile and
    # masked scores (-inf) contribute exactly zero.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Stage 1: the cached prefix (this split's part of it), gathered slot by slot; every query sees every
    # prefix key. Whole tiles need no score mask; only the last, partial one does.
    K_c, V_c = K_cache + kv_head * stride_kch, V_cache + kv_head * stride_vch
    qk_prefix = qk_scale
    if KV_SCALED:  # NOTE: the prefix's keys are codes of K / k_scale: folded into its scores' multiplier
        qk_prefix = qk_scale * tl.load(KScales + kv_head)
    if WINDOWED:
        # NOTE: the block's first query (position prefix_len + m_lo) sees the prefix from
        # prefix_len + m_lo - window + 1 on; every tile from there is masked per query, and a query may
        # see nothing in a tile (or in this split's part at all: an empty partial, weight 0)
        p_lo = tl.maximum(p_lo, prefix_len + m_lo - window + 1)
        p_lo = tl.minimum(p_lo, p_hi)
    full_end = p_lo + ((p_hi - p_lo) // BLOCK_N) * BLOCK_N
    if WINDOWED:
        full_end = p_lo
    for n_lo in range(p_lo, full_end, BLOCK_N):
        n = n_lo + offs_n
        slots = tl.load(kv_indices + prefix_start + n).to(tl.int64)
        m_i, l_i, acc = _attend_rows(q, K_c, V_c, slots, n < p_hi, offs_m, n, stride_kcs, stride_vcs,
                                     offs_d, mask_d, m_i, l_i, acc, qk_prefix, False, False,
                                     PRECISION, DOT_FP32, 0, offs_m, False, softcap, SOFTCAP)  # fmt: skip
    for n_lo in range(full_end, p_hi, BLOCK_N):
        n = n_lo + offs_n
        mask_n = n < p_hi
        slots = tl.load(kv_indices + prefix_start + n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_rows(q, K_c, V_c, slots, mask_n, offs_m, n, stride_kcs, stride_vcs,
                                     offs_d, mask_d, m_i, l_i, acc, qk_prefix, True, False,
                                     PRECISION, DOT_FP32, window, prefix_len + offs_m, WINDOWED, softcap,
                                     SOFTCAP)  # fmt: skip
    if KV_SCALED:  # NOTE: the prefix's values were codes of V / v_scale: its sum times v_scale, once
        acc = acc * tl.load(VScales + kv_head)

    # Stage 2: the request's own new tokens, causal (new token j sees new tokens 0..j), in the last split.
    # Whole tiles left of this block's diagonal (keys < m_lo <= every query here, all < q_len) need no mask.
    diag_lo = (m_lo // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(q_len, m_lo + BLOCK_M)
    if SPLIT:  # NOTE: splits before the last attend no new tokens
        not_last = split < n_splits - 1
        diag_lo = tl.where(not_last, 0, diag_lo)
        n_end = tl.where(not_last, 0, n_end)
    K_n, V_n = K_new + kv_head * stride_knh, V_new + kv_head * stride_vnh
    n_lo0 = 0
    if WINDOWED:  # NOTE: every tile from the first query's window start is masked (causal and window)
        n_lo0 = tl.maximum(m_lo - window + 1, 0)
        diag_lo = tl.where(n_end > 0, n_lo0, 0)
    for n_lo in range(n_lo0, diag_lo, BLOCK_N):
        n = n_lo + offs_n
        m_i, l_i, acc = _attend_rows(q, K_n, V_n, q_start + n, n < q_len, offs_m, n, stride_knt, stride_vnt,
                                     offs_d, mask_d, m_i, l_i, acc, qk_scale, False, False,
                                     PRECISION, DOT_FP32, 0, offs_m, False, softcap, SOFTCAP)  # fmt: skip
    for n_lo in range(diag_lo, n_end, BLOCK_N):
        n = n_lo + offs_n
        m_i, l_i, acc = _attend_rows(q, K_n, V_n, q_start + n, n < q_len, offs_m, n, stride_knt, stride_vnt,
                                     offs_d, mask_d, m_i, l_i, acc, qk_scale, True, True,
                                     PRECISION, DOT_FP32, window, offs_m, WINDOWED, softcap, SOFTCAP)  # fmt: skip

    if SPLIT:
        part, lse = finish_split(acc, m_i, l_i)  # NOTE: an empty part (past the prefix's end): weight 0
        tl.store(
            Mid_out + rows[:, None] * stride_mt + head * stride_mh + split * stride_ms + offs_d[None, :],
            part,
            mask=mask_m[:, None] & mask_d[None, :],
        )
        tl.store(Mid_lse + rows * stride_lt + head * stride_lh + split, lse, mask=mask_m)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padded rows only; they are not stored
        if SINKS:  # NOTE: the sink's exp2 against the row max; a padded row's (m_i -inf) is inf: out 0
            l_safe = l_i + tl.exp2(tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634 - m_i)
        out = acc / l_safe[:, None]
        tl.store(
            Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


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
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """See the module docstring (its contracts included). ``window`` > 0: sliding-window attention (as
    kernels.reference.extend_attention's); ``softcap`` > 0: soft-capped scores (likewise); ``sinks`` [Hq]
    float32: attention sinks (likewise); ``kv_scales`` (K's, V's): an fp8 pool's codes scaled (likewise).
    ``max_extend_len`` (tokens) bounds the grid;
    when None it is read from qo_indptr, which costs one device-to-host sync. ``max_prefix_len``, with
    the new tokens in all (q's rows), picks the default tiles (``config`` overrides them) and bounds the
    prefix splits. ``num_splits`` caps the prefix splits (a CUDA graph fixes it; 1: none; None:
    prefix_split_cap's choice). ``out`` [T, Hq, D] may be preallocated. Raises ValueError on inconsistent
    shapes, dtypes or devices (metadata only, no sync)."""
    hkv = host_checks.check_attention(q, k_cache, v_cache, k_new, v_new, out)
    t, hq, d = q.shape
    host_checks.check_sinks(sinks, hq, q.device)
    scaled = host_checks.kv_scale_args(kv_scales, k_cache)
    qo_indptr = host_checks.index_tensor("qo_indptr", qo_indptr, q.device)
    batch = qo_indptr.numel() - 1
    kv_indptr = host_checks.index_tensor("kv_indptr", kv_indptr, q.device, numel=batch + 1)
    kv_indices = host_checks.index_tensor("kv_indices", kv_indices, q.device)
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or batch <= 0:
        return out
    if max_extend_len is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())
    else:
        host_checks.check_max_extend_len(qo_indptr, max_extend_len)
    if max_extend_len == 0:
        return out
    cfg = config or default_config(d, q.dtype, device_arch(q.device), max_prefix_len, t, k_cache.dtype)
    num_splits = prefix_split_cap(num_splits, t, hq, q.device, cfg, max_prefix_len)
    split = num_splits > 1
    scale = d**-0.5 if sm_scale is None else sm_scale
    block_d = max(16, triton.next_power_of_2(d))
    # NOTE: unsplit, the kernel never touches the partials: ``out`` stands in for both (no allocation)
    mid_out, mid_lse = split_partials(t, hq, num_splits, d, q.device) if split else (out, out)
    packed = cfg.packed_blocks and batch > 1
    if packed:  # NOTE: the blocks that exist, not every request x the longest request's blocks
        grid = (hq, packed_blocks(t, batch, max_extend_len, cfg.block_m), num_splits)
    else:
        grid = (hq, triton.cdiv(max_extend_len, cfg.block_m), batch * num_splits)
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        out,
        mid_out,
        mid_lse,
        qo_indptr,
        kv_indptr,
        kv_indices,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        num_splits,
        batch,
        max(window, 0),
        float(softcap),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        MIN_SPLIT_LEN=cfg.min_split_len,
        SPLIT=split,
        PACKED=packed,
        BLOCK_R=request_lanes(batch, packed),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
        Sinks=None if split else sinks,  # NOTE: split, the merge adds them
        SINKS=sinks is not None and not split,
        **scaled,
        enable_fp_fusion=True,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        merge_rows(mid_out, mid_lse, out, qo_indptr, kv_indptr, num_splits, max_extend_len, MERGE_TOKENS,
                   cfg.min_split_len, split_new_tokens=False, packed=packed, sinks=sinks)  # fmt: skip
    return out
