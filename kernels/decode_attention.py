"""Triton decode attention (one query token per request) over a paged KV pool: split-K + merge.

Semantics are kernels.reference.decode_attention; this module must never change them.
Shapes (B = requests, S = slots in the pool, D = head dim):
  q [B, Hq, D]; k_cache, v_cache [S, Hkv, D] (one layer, fp16/bf16/fp32);
  kv_indptr [B+1], kv_indices [nnz] (int32/int64): request i's slots, the current token's included;
  with ``window`` > 0 only the last ``window`` of them are attended (sliding-window attention).
  Output [B, Hq, D] in q's dtype; a request with no slots gets zeros (as the reference does).
  One dtype for q and the pool; a preallocated ``out`` has q's shape and dtype. The wrapper checks this
  from metadata (ValueError) and passes the index tensors on contiguous.
CALLER CONTRACT, NOT CHECKED (it needs the index data: a device-to-host sync): kv_indptr is
  non-decreasing, kv_indptr[-1] <= len(kv_indices), and every kv_indices entry is a slot in [0, S);
  otherwise the kernel reads out of bounds.
Each program owns (request, KV head, split): it reads that KV head once for all Hq // Hkv query heads
(stacked as the rows of one tl.dot), writes a partial output and its log2-sum-exp, and a second
kernel merges the splits. Scores, softmax and accumulation in fp32.
With DecodeConfig.fused_merge the split kernel merges too: each program counts itself done on a
per-(request, KV head) counter (an acq_rel atomic after a block barrier), and the program that counts
last merges every split of its heads (reading them past L1) and resets the counter, so one launch
does the step. The counters persist per device (zeros, reset by each call).
With DecodeConfig.pdl (Hopper and later, compiled only) both kernels are launched as programmatic
dependents (PDL): the GPU may launch a kernel while the one before it drains, and the kernel waits for
that one's grid (griddepcontrol.wait) before it reads anything the grid wrote. Each split program waits
first and then lets the merge launch; the merge reads kv_indptr (written before the split kernel
started), waits, and merges. Off by default until a GPU run says it pays (kernels.bench, kernels.tune).
With DecodeConfig.prefetch each program loads tile i + 1's K/V (and tile i + 2's slots) into registers
before it computes tile i, so a tile is always in flight. Triton's own pipelining cannot do that for a
gathered tile: it keeps one shared-memory buffer for K/V at any num_stages (the TTGIR for sm_90 shows
it), so a program waits for each tile before its dot and has nothing in flight while it computes. Meant
for num_stages 1 (nothing left for Triton to pipeline); off by default until kernels.tune / kernels.sweep
on a GPU say it pays.
With DecodeConfig.prefetch_slots each program loads tile i + 1's slots (4 bytes a token) before it waits on
tile i's K/V, so the next tile's K/V copies have their addresses when tile i is done. Without it, Triton's
pipelining (sm_90) issues the next tile's slot load after this tile's dots and the K/V copies behind it:
two memory round trips in a row between tiles, with nothing in flight while the slots come. Same registers
and shared memory as the default at batch 1, head dim 128 (python -m kernels.compile_check). On tiles of 3 or
more stages it also lets Triton buffer the K/V copies twice (PIPELINED_TILES). Ignored under prefetch (which
loads slots two tiles ahead already); off by default until kernels.bench on a GPU says it pays.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels import host_checks, interpret_requested
from kernels.extend_attention import device_arch
from kernels.online_softmax import attend_tile, gather_kv
from kernels.pdl import pdl_active, pdl_launch, wait_then_release
from kernels.split_merge import finish_split, merge_head, num_splits_of, sm_count, split_partials, splits_for

# NOTE: read at import; Triton decides interpreted vs compiled when @triton.jit runs (see kernels.ops).
INTERPRETED = interpret_requested()
_LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) == exp2(x * _LOG2E)
MAX_SPLITS = 64
MANY_REQUESTS = 16  # default_config: from this batch on sm_90 takes smaller tiles
# DecodeConfig.prefetch as kernels.bench and kernels.sweep try it beside the default: 64-token tiles, 4 warps,
# no Triton pipelining (sm_90, head dim 128, bf16: 209 registers, no spill, 2 blocks an SM; 128-token tiles
# with 4 warps spill; python -m kernels.compile_check --candidates)
PREFETCH_TILES = {"block_n": 64, "num_warps": 4, "num_stages": 1, "prefetch": True}
# DecodeConfig.prefetch_slots on 3-stage tiles as kernels.bench tries it beside the default: with the slots a
# tile ahead Triton's pipelining buffers the gathered K/V twice (without them, once at any num_stages), so a
# tile's copies are in flight while the one before is computed (sm_90, head dim 128, bf16, 4 warps: 70 KiB of
# shared memory, 3 blocks an SM, no spill; python -m kernels.compile_check)
PIPELINED_TILES = {"block_n": 64, "num_stages": 3, "prefetch_slots": True}


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile size (tokens), the shortest split worth its merge cost (tokens), launch shape, and how many
    waves of programs per SM the split count aims for (choose_num_splits)."""

    block_n: int
    min_split_len: int
    num_warps: int
    num_stages: int
    split_waves: int = 2
    fused_merge: bool = False  # the last split of each (request, KV head) merges: one launch, not two
    pdl: bool = False  # programmatic dependent launch on sm_90+ (compiled only; ignored elsewhere)
    prefetch: bool = False  # the next tile's K/V loaded before this one's dot (decode; extend_short: unused)
    prefetch_slots: bool = False  # the next tile's slots loaded a tile ahead (decode, extend_short)
    # an fp8 pool under a bf16 q: q taken to fp16 (saturated at +-65504) so the tiles widen to fp16, a pair
    # of values an instruction, not to bf16 through fp32 (decode; extend_short: unused)
    fp8_f16: bool = False


def widens_fp8_to_fp16(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> bool:
    """Whether DecodeConfig.fp8_f16 changes a call: an fp8 pool under a bf16 q (fp16 and fp32 queries widen
    the pool's tiles to their own dtype already)."""
    return q_dtype == torch.bfloat16 and pool_dtype in host_checks.FP8_POOL_DTYPES


# default_config's tiles over an fp8 pool on sm_90 (head dims 65-128, 16-bit q), below MANY_REQUESTS and from
# it, both widening to fp16 (fp8_f16); FP8_SHORT_TILES: the short extend's there (kernels.extend_short)
FP8_TILES = DecodeConfig(block_n=128, min_split_len=256, num_warps=4, num_stages=3, fp8_f16=True)
FP8_MANY_TILES = DecodeConfig(block_n=64, min_split_len=256, num_warps=2, num_stages=3, fp8_f16=True)
FP8_SHORT_TILES = DecodeConfig(block_n=64, min_split_len=256, num_warps=4, num_stages=2)


def takes_fp8_tiles(head_dim: int, dtype: torch.dtype, arch: int, pool_dtype: torch.dtype | None) -> bool:
    """Whether default_config takes the fp8 pools' tiles (FP8_TILES, FP8_MANY_TILES) when compiled: an fp8
    pool on sm_90 or later, head dims 65-128, a 16-bit q."""
    return (
        pool_dtype in host_checks.FP8_POOL_DTYPES
        and 64 < head_dim <= 128
        and arch >= 90
        and dtype != torch.float32
    )


def default_config(
    head_dim: int, dtype: torch.dtype, arch: int = 90, batch: int = 1, pool_dtype: torch.dtype | None = None
) -> DecodeConfig:
    """Defaults for compute capability ``arch`` (x10: 90 = H100/H200) and a call of ``batch`` requests
    (a decode graph's batch: each graph keeps one choice) over a pool of ``pool_dtype`` (None: ``dtype``);
    tiny tiles and splits in the interpreter so tests cross every boundary."""
    if INTERPRETED:
        return DecodeConfig(block_n=16, min_split_len=16, num_warps=1, num_stages=1)
    if takes_fp8_tiles(head_dim, dtype, arch, pool_dtype):
        # NOTE: python -m kernels.tune --kind decode --kv-dtype fp8 on an H200 (bf16 q, head dim 128; docs/
        # benchmarks/kernels-tune-fp8-decode-nvidia-h200-2026-11-29-2.json) widened each shape's fastest tile
        # to fp16: 1.25 -> 1.44x FP8_SHORT_TILES' time (the previous default) at batch 1 x 16k (128-token
        # tiles, 8 warps, 3 stages, PDL), 1.06 -> 1.41x at 32 x 4k (64, 2 warps, 3 stages, PDL), 1.41 ->
        # 2.08x at 8 x 64k (128, 4 warps, 3 stages, 8 waves, fused merge). Unwidened, 128 x 4 warps x 3
        # stages ran 1.20 / 0.97 / 1.40x there, 64 x 2 x 3 0.96 / 1.02 / 0.92x; widening FP8_SHORT_TILES
        # itself ran 0.61-1.00x (kernels.bench). FP8_TILES and FP8_MANY_TILES are those two tiles widened,
        # in the 16-bit pools' regimes (MANY_REQUESTS): kernels.bench times each beside FP8_SHORT_TILES.
        return FP8_MANY_TILES if batch >= MANY_REQUESTS else FP8_TILES
    if dtype == torch.float32:  # 4 warps spill at head_dim 128 on sm_90 (python -m kernels.compile_check)
        return DecodeConfig(block_n=32, min_split_len=256, num_warps=8, num_stages=2)
    # NOTE: on sm_90 (head_dim 128, bf16) python -m kernels.tune measured 128-token tiles 1.39x faster
    # than 64 over its three shapes (geomean of CUDA-graph replays; 1.5x at batch 1 x 16k, 1.7x at
    # 8 x 64k): docs/benchmarks/kernels-tune-nvidia-h200.json. Before Hopper 64 stays (less shared memory).
    # From MANY_REQUESTS requests 64-token tiles with 2 warps and 3 stages (5 blocks an SM against 3)
    # replayed 1.03x faster on an H100 (geomean over 16-128 requests x 1k-16k, up to 1.09x at 64 x 4k;
    # kernels.sweep's decode_tile_rule on docs/benchmarks/kernels-sweep-tiles-nvidia-h100-80gb-hbm3.md).
    if 64 < head_dim <= 128 and arch >= 90:
        if batch >= MANY_REQUESTS:
            return DecodeConfig(block_n=64, min_split_len=256, num_warps=2, num_stages=3)
        return DecodeConfig(block_n=128, min_split_len=256, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return DecodeConfig(block_n=64, min_split_len=256, num_warps=4, num_stages=3)
    return DecodeConfig(block_n=64, min_split_len=256, num_warps=4, num_stages=2)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    num_sms: int,
    max_kv_len: int | None = None,
    min_split_len: int = 256,
    waves: int = 2,
) -> int:
    """Most splits any request may use: enough (request, KV head, split) programs for ~``waves`` waves
    of SMs, never more than the longest request can fill with ``min_split_len``-token chunks.
    NOTE: inside the kernel each request further limits itself to cdiv(len, min_split_len) splits,
    so short requests in a long batch are not split needlessly (no host sync needed for that)."""
    return splits_for(batch * num_kv_heads, num_sms, waves, max_kv_len, min_split_len, MAX_SPLITS)


def split_cap(
    num_splits: int | None,
    batch: int,
    num_kv_heads: int,
    device: torch.device,
    cfg: DecodeConfig,
    max_kv_len: int | None = None,
) -> int:
    """The split cap a launch uses: ``num_splits`` when given (a CUDA graph fixes it), else
    choose_num_splits for ``batch`` (request, token block) rows on ``device``'s SMs; in 1..MAX_SPLITS."""
    if num_splits is None:
        sms = sm_count(device)
        num_splits = choose_num_splits(
            batch, num_kv_heads, sms, max_kv_len, cfg.min_split_len, cfg.split_waves
        )
    return int(min(max(num_splits, 1), MAX_SPLITS))


# NOTE: num_splits is a plain (unspecialised) argument: one compiled split kernel serves every split
# count, so capturing CUDA graphs for many batch sizes compiles it once, not once per count.
@triton.jit(do_not_specialize=["num_splits", "window", "softcap"])
def _decode_split_kernel(
    Q,
    K_cache,
    V_cache,
    kv_indptr,
    kv_indices,
    Mid_out,  # [B, Hq, num_splits, D] fp32, each split normalised by its own sum
    Mid_lse,  # [B, Hq, num_splits] fp32, log2(sum exp2(score)) of the split; -inf when empty
    Out,  # [B, Hq, D] (FUSED_MERGE only)
    Counters,  # int32 [>= B * Hkv], zeros (FUSED_MERGE only): splits of (request, KV head) done
    qk_scale,  # sm_scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,  # the most splits any request may use (the grid's third dimension)
    window,  # sliding window (keys a query sees, its own included; WINDOWED only)
    softcap,  # scores soft-capped: softcap * tanh(score / softcap) (SOFTCAP only)
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, so dot in fp32
    FUSED_MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= any num_splits, a power of two (FUSED_MERGE only)
    PDL: tl.constexpr,  # launched as a programmatic dependent (sm_90+)
    PREFETCH: tl.constexpr,  # load the next tile before computing this one
    PREFETCH_SLOTS: tl.constexpr,  # load the next tile's slots before waiting on this one's K/V
    WINDOWED: tl.constexpr,  # attend the last ``window`` slots of each request only
    SOFTCAP: tl.constexpr,
    Sinks=None,  # [Hq] attention sinks (SINKS, FUSED_MERGE only: otherwise the merge kernel's)
    SINKS: tl.constexpr = False,
    KScales=None,  # KV_SCALED: [Hkv] float32, an fp8 pool's codes stand for code x KScales[h] (K's of KV head h)
    VScales=None,  # and code x VScales[h] (V's)
    KV_SCALED: tl.constexpr = False,
    F16_DOT: tl.constexpr = False,  # DecodeConfig.fp8_f16 (an fp8 pool, a bf16 q)
):
    if PDL:
        # NOTE: past the wait, whatever the kernel before wrote (q, the pool, the indices) is visible; the
        # merge may launch once every program has waited, as it reads kv_indptr before its own wait
        wait_then_release()
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    kv_len = (tl.load(kv_indptr + req + 1) - kv_start).to(tl.int32)
    if WINDOWED:  # NOTE: the query is the last slot: it sees the last ``window`` (the merge trims alike)
        kv_start += tl.maximum(kv_len - window, 0)
        kv_len = tl.minimum(kv_len, window)
    n_splits = num_splits_of(kv_len, num_splits, MIN_SPLIT_LEN)
    if FUSED_MERGE:  # NOTE: a request with no slots still needs one program to write its zeros
        n_splits = tl.maximum(n_splits, 1)
    if split >= n_splits:  # the merge derives n_splits the same way and never reads this one
        return
    chunk = tl.cdiv(kv_len, n_splits)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if F16_DOT:  # NOTE: attend_tile widens the fp8 tiles to q's dtype: now fp16
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if DOT_FP32:
        q = q.to(tl.float32)

    K_head, V_head = K_cache + kv_head * stride_kch, V_cache + kv_head * stride_vch
    if KV_SCALED:  # NOTE: q . (codes x k_scale) = (q . codes) x k_scale: folded into the scores' multiplier
        qk_scale = qk_scale * tl.load(KScales + kv_head)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        # NOTE: tile i + 1's K/V and tile i + 2's slots are loaded (into registers) before tile i is
        # computed, so each program keeps a tile in flight while it computes; Triton's own pipelining
        # keeps one shared-memory buffer for gathered K/V and waits for it before each tile's dot
        indices = kv_indices + kv_start
        mask_n = (lo + offs_n) < hi
        slots = tl.load(indices + lo + offs_n, mask=mask_n, other=0).to(tl.int64)
        k, v = gather_kv(K_head, V_head, slots, mask_n, stride_kcs, stride_vcs, offs_d, mask_d)
        mask_next = (lo + BLOCK_N + offs_n) < hi
        slots_next = tl.load(indices + lo + BLOCK_N + offs_n, mask=mask_next, other=0).to(tl.int64)
        for n_lo in range(lo, hi, BLOCK_N):
            k_next, v_next = gather_kv(K_head, V_head, slots_next, mask_next, stride_kcs, stride_vcs, offs_d,
                                       mask_d)  # fmt: skip
            n_after = n_lo + 2 * BLOCK_N + offs_n
            mask_after = n_after < hi
            slots_after = tl.load(indices + n_after, mask=mask_after, other=0).to(tl.int64)
            m_i, l_i, acc = attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, True, PRECISION,
                                        DOT_FP32, False, softcap, SOFTCAP)  # fmt: skip
            k, v, mask_n = k_next, v_next, mask_next
            slots_next, mask_next = slots_after, mask_after
    else:
        # NOTE: PREFETCH_SLOTS loads the slots one tile ahead (see the module docstring): tile i + 1's K/V
        # copies, issued once tile i is computed, no longer wait on a slot load of their own
        indices = kv_indices + kv_start
        if PREFETCH_SLOTS:
            slots_next = tl.load(indices + lo + offs_n, mask=(lo + offs_n) < hi, other=0)
        for n_lo in range(lo, hi, BLOCK_N):
            n = n_lo + offs_n
            mask_n = n < hi
            if PREFETCH_SLOTS:
                slots = slots_next.to(tl.int64)
                slots_next = tl.load(indices + n + BLOCK_N, mask=(n + BLOCK_N) < hi, other=0)
            else:
                slots = tl.load(indices + n, mask=mask_n, other=0).to(tl.int64)
            k, v = gather_kv(K_head, V_head, slots, mask_n, stride_kcs, stride_vcs, offs_d, mask_d)
            m_i, l_i, acc = attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale, True, PRECISION,
                                        DOT_FP32, False, softcap, SOFTCAP)  # fmt: skip

    if KV_SCALED:  # NOTE: every value tile was codes of V / v_scale: the sum times v_scale, once
        acc = acc * tl.load(VScales + kv_head)
    # NOTE: a split that got no tokens (lo >= hi, possible when chunk * n_splits > kv_len) writes
    # lse = -inf and a zero partial, so the merge gives it weight 0 (finish_split)
    part, lse = finish_split(acc, m_i, l_i)
    tl.store(
        Mid_out + req * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :],
        part,
        mask=mask_h[:, None] & mask_d[None, :],
    )
    tl.store(Mid_lse + req * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
    if FUSED_MERGE:
        # NOTE: the barrier orders every thread's stores above before the release of the atomic; the
        # program that takes the last ticket acquires them and reads past L1 (.cg), as another SM wrote them
        tl.debug_barrier()
        counter = Counters + req * tl.num_programs(1) + kv_head
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:
            tl.store(counter, 0)  # NOTE: every split has counted: the next call starts from zero
            for h in range(GROUP):
                merge_head(Mid_out, Mid_lse, Out, req, kv_head * GROUP + h, n_splits, stride_mb, stride_mh,
                            stride_ms, stride_lb, stride_lh, stride_ob, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S,
                            ".cg", Sinks, SINKS)  # fmt: skip


@triton.jit(do_not_specialize=["num_splits", "window"])
def _decode_merge_kernel(
    Mid_out,
    Mid_lse,
    Out,
    kv_indptr,
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    window,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two
    MIN_SPLIT_LEN: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the split kernel (sm_90+)
    WINDOWED: tl.constexpr,
    Sinks=None,  # [Hq] attention sinks (SINKS only)
    SINKS: tl.constexpr = False,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    kv_len = (tl.load(kv_indptr + req + 1) - tl.load(kv_indptr + req)).to(tl.int32)
    if WINDOWED:
        kv_len = tl.minimum(kv_len, window)
    n_splits = num_splits_of(kv_len, num_splits, MIN_SPLIT_LEN)
    if PDL:  # NOTE: the split kernel's partials are visible only past the wait
        tl.extra.cuda.gdc_wait()
    merge_head(Mid_out, Mid_lse, Out, req, head, n_splits, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                stride_ob, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S, "", Sinks, SINKS)  # fmt: skip


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """The fused merge's per-(request, KV head) counters on ``device``: zeros, at least ``n`` (a call
    leaves them at zero). Grown outside CUDA-graph capture: the worker's capture warms up first."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode merge counters must be allocated before CUDA-graph capture")
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_scales: host_checks.KVScales | None = None,
) -> torch.Tensor:
    """See the module docstring. ``num_splits`` caps splits per request (fixed value for CUDA graphs);
    when None it comes from choose_num_splits(batch, Hkv, SM count, max_kv_len). ``window`` > 0: each
    request attends its last ``window`` slots only (sliding-window attention); ``softcap`` > 0 soft-caps the
    scores, ``sinks`` [Hq] float32 adds attention sinks, ``kv_scales`` (K's, V's) scale an fp8 pool's codes
    (kernels.reference.decode_attention). Never syncs. Raises ValueError on inconsistent shapes, dtypes or
    devices (from metadata)."""
    hkv = host_checks.check_attention(q, k_cache, v_cache, out=out)
    scaled = host_checks.kv_scale_args(kv_scales, k_cache)
    batch, hq, d = q.shape
    host_checks.check_sinks(sinks, hq, q.device)
    kv_indptr = host_checks.index_tensor("kv_indptr", kv_indptr, q.device, numel=batch + 1)
    kv_indices = host_checks.index_tensor("kv_indices", kv_indices, q.device)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    cfg = config or default_config(d, q.dtype, device_arch(q.device), batch, k_cache.dtype)
    if window > 0 and max_kv_len is not None:
        max_kv_len = min(max_kv_len, window)
    num_splits = split_cap(num_splits, batch, hkv, q.device, cfg, max_kv_len)
    group = hq // hkv
    block_d = max(16, triton.next_power_of_2(d))
    mid_out, mid_lse = split_partials(batch, hq, num_splits, d, q.device)
    scale = d**-0.5 if sm_scale is None else sm_scale
    block_s = max(2, triton.next_power_of_2(num_splits))
    counters = merge_counters(q.device, batch * hkv) if cfg.fused_merge else mid_lse  # NOTE: unused unfused
    pdl = pdl_active(cfg.pdl, device_arch(q.device))
    _decode_split_kernel[(batch, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        kv_indptr,
        kv_indices,
        mid_out,
        mid_lse,
        out,
        counters,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        max(window, 0),
        float(softcap),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        MIN_SPLIT_LEN=cfg.min_split_len,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        FUSED_MERGE=cfg.fused_merge,
        BLOCK_S=MAX_SPLITS if cfg.fused_merge else 2,  # NOTE: not the split count: one kernel serves all
        PDL=pdl,
        PREFETCH=cfg.prefetch,
        PREFETCH_SLOTS=cfg.prefetch_slots,
        WINDOWED=window > 0,
        SOFTCAP=softcap > 0,
        Sinks=sinks if cfg.fused_merge else None,  # NOTE: unfused, the merge kernel adds them
        SINKS=sinks is not None and cfg.fused_merge,
        **scaled,
        F16_DOT=cfg.fp8_f16 and widens_fp8_to_fp16(q.dtype, k_cache.dtype),
        enable_fp_fusion=True,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(pdl),
    )
    if cfg.fused_merge:
        return out
    _decode_merge_kernel[(batch, hq)](
        mid_out,
        mid_lse,
        out,
        kv_indptr,
        mid_out.stride(0),
        mid_out.stride(1),
        mid_out.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        max(window, 0),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        MIN_SPLIT_LEN=cfg.min_split_len,
        PDL=pdl,
        WINDOWED=window > 0,
        Sinks=sinks,
        SINKS=sinks is not None,
        enable_fp_fusion=True,
        num_warps=4 if block_d >= 128 else 2,
        **pdl_launch(pdl),
    )
    return out
