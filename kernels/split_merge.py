"""Split-K attention's shared pieces: the partials' layout, the split count, the sm count, the merge.

A split kernel gives each (row, query head) several programs, each over a part of the keys; each
writes its partial output (normalised by its own softmax sum) and that sum's log2-sum-exp, and a merge
weighs the partials by exp2(lse - max lse). Decode (kernels/decode_attention.py), the short extend
(kernels/extend_short.py) and the extend kernel's prefix splits (kernels/extend_attention.py) share
this layout: partials [rows, Hq, splits, D] and lse [rows, Hq, >= splits], float32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached); 4 elsewhere (the interpreter), so split choices stay small."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


def split_partials(
    rows: int, hq: int, num_splits: int, d: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The split kernel's outputs for the merge: each split's partial output [rows, Hq, splits, D] and
    its log2-sum-exp [rows, Hq, >= splits] (fp32).
    NOTE: the lse rows are padded to a multiple of 16 splits so that their strides, like the partials',
    keep their 16-divisibility for any split count: one compiled kernel pair serves them all."""
    mid_out = torch.empty((rows, hq, num_splits, d), dtype=torch.float32, device=device)
    mid_lse = torch.empty((rows, hq, triton.cdiv(num_splits, 16) * 16), dtype=torch.float32, device=device)
    return mid_out, mid_lse


def splits_for(
    programs: int, num_sms: int, waves: int, longest: int | None, min_split_len: int, most: int
) -> int:
    """A split cap, in 1..``most``: enough splits that ``programs`` programs per split make ~``waves``
    waves of ``num_sms`` SMs, never more than the longest sequence (``longest`` keys, when known) fills
    with ``min_split_len``-key parts. Inside the kernels each row then takes only the splits its own
    length fills (num_splits_of), so no host sync is needed for that."""
    splits = triton.cdiv(waves * num_sms, max(1, programs))
    if longest is not None:
        splits = min(splits, triton.cdiv(max(longest, 1), min_split_len))
    return int(min(max(splits, 1), most))


@triton.jit
def finish_split(acc, m_i, l_i):
    """A split's partial output (normalised by its own sum) and its log2-sum-exp from the running
    softmax state (log2 domain): a row that attended nothing gives a zero partial and lse -inf, which
    merge_head weighs 0 (the partial must be finite: merge_head loads it before it knows the weight)."""
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def num_splits_of(kv_len, max_splits, MIN_SPLIT_LEN: tl.constexpr):
    """Splits a sequence of ``kv_len`` keys takes under a cap of ``max_splits``: one per started
    MIN_SPLIT_LEN keys (0 for no keys)."""
    return tl.minimum(tl.cdiv(kv_len, MIN_SPLIT_LEN), max_splits)


@triton.jit
def block_kv_len(prefix_len, n_new, t0, TOKENS: tl.constexpr):
    """Positions a block of a request's new tokens t0 .. t0 + TOKENS - 1 sees at most: its last token's
    (the short extend splits all of them)."""
    return prefix_len + tl.minimum(t0 + TOKENS, n_new)


@triton.jit
def prefix_splits_of(prefix_len, max_splits, MIN_SPLIT_LEN: tl.constexpr):
    """Splits extend's prefix split gives a request: num_splits_of its prefix, at least one (the last
    split also takes the request's new tokens)."""
    return tl.maximum(num_splits_of(prefix_len, max_splits, MIN_SPLIT_LEN), 1)


@triton.jit
def locate_block(qo_indptr, batch, b, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    """(request, block within it) of the b-th block of BLOCK rows among the batch's requests, in request
    order (a request of n rows has cdiv(n, BLOCK) blocks, none when empty); request ``batch`` when b is
    past the last. One vector load of qo_indptr (BLOCK_R >= batch lanes) and a prefix sum: packed
    grids need no host sync to skip empty requests."""
    offs = tl.arange(0, BLOCK_R)
    inb = offs < batch
    starts = tl.load(qo_indptr + offs, mask=inb, other=0)
    n_blocks = tl.cdiv(tl.load(qo_indptr + offs + 1, mask=inb, other=0) - starts, BLOCK)
    ends = tl.cumsum(n_blocks, 0)
    req = tl.sum((ends <= b).to(tl.int32), 0)
    first = tl.sum(tl.where(offs == req, ends - n_blocks, 0), 0)
    return req, (b - first).to(tl.int32)


def packed_blocks(rows: int, batch: int, longest: int, block: int) -> int:
    """Block slots a packed grid needs for ``batch`` requests of at most ``longest`` rows each and
    ``rows`` rows in all: at most cdiv(rows, block) + (nonempty requests) - 1 blocks in all (each
    request's last block the only partial one), and never more than one grid row per request."""
    nonempty = min(batch, rows)
    return max(1, min(batch * triton.cdiv(longest, block), triton.cdiv(rows, block) + nonempty - 1))


def request_lanes(batch: int, packed: bool) -> int:
    """locate_block's BLOCK_R for a launch: the requests rounded up to a power of two when packed, else a
    constant 2, so an unpacked kernel compiles once for every batch size (CUDA graphs capture many)."""
    return max(2, triton.next_power_of_2(batch)) if packed else 2


@triton.jit
def merge_head(
    Mid_out, Mid_lse, Out, req, head, n_splits, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    CACHE: tl.constexpr, Sinks=None, SINKS: tl.constexpr = False,
):  # fmt: skip
    """Out[req, head] := the splits' partial outputs weighted by exp2 of their log2-sum-exps (an empty
    split, lse -inf, weighs 0; no split at all gives zeros). CACHE: the loads' cache modifier. SINKS:
    head h's attention sink Sinks[h] (a natural-log score) weighs in the sum as one more split whose
    partial is zero (attention that goes to no key).
    NOTE: every split below n_splits wrote a finite partial (zeros when empty), so the partials' load is
    masked by the split count alone: it does not wait for the lse load, and both are in flight at once.
    It stays after the weights in the source: placed first, the fused merge took 195 registers, not 162."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_splits
    lse = tl.load(Mid_lse + req * stride_lb + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"),
                  cache_modifier=CACHE)  # fmt: skip
    live = mask_s & (lse > float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634  # log2 domain, as lse
        m = tl.maximum(m, sink)
    m = tl.where(m > float("-inf"), m, 0.0)  # no live split at all: every weight is exp2(-inf) = 0
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    part = tl.load(
        Mid_out + req * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
        cache_modifier=CACHE,
    )
    total = tl.sum(w, 0)
    if SINKS:
        total += tl.exp2(sink - m)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        Out + req * stride_ob + head * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


# NOTE: num_splits is a plain (unspecialised) argument: one compiled kernel serves every split count
@triton.jit(do_not_specialize=["num_splits", "batch"])
def _merge_rows_kernel(
    Mid_out,
    Mid_lse,
    Out,
    qo_indptr,
    kv_indptr,
    stride_mt,
    stride_mh,
    stride_ms,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    num_splits,
    batch,  # requests (PACKED only)
    TOKENS: tl.constexpr,  # rows a program merges: a request's rows t0 .. t0 + TOKENS - 1
    SPLIT_TOKENS: tl.constexpr,  # rows of a block of the split kernel (SPLIT_NEW_TOKENS only)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits, a power of two
    MIN_SPLIT_LEN: tl.constexpr,
    SPLIT_NEW_TOKENS: tl.constexpr,  # see merge_rows
    PDL: tl.constexpr,  # launched as a programmatic dependent of the split kernel (sm_90+)
    PACKED: tl.constexpr,  # grid (block slots, Hq): blocks found by locate_block
    BLOCK_R: tl.constexpr,  # >= the requests, a power of two (PACKED only)
    Sinks=None,  # [Hq] attention sinks (SINKS only)
    SINKS: tl.constexpr = False,
):
    if PACKED:
        req, block = locate_block(qo_indptr, batch, tl.program_id(0), TOKENS, BLOCK_R)
        if req >= batch:
            return
        head = tl.program_id(1)
        t0 = block * TOKENS
    else:
        req = tl.program_id(0)
        head = tl.program_id(1)
        t0 = tl.program_id(2) * TOKENS
    q_start = tl.load(qo_indptr + req).to(tl.int64)
    n_new = (tl.load(qo_indptr + req + 1) - q_start).to(tl.int32)
    prefix_len = (tl.load(kv_indptr + req + 1) - tl.load(kv_indptr + req)).to(tl.int32)
    # NOTE: extend's prefix splits: the prefix alone, one split at least (which also takes the new tokens);
    # the short extend's are found per row below
    if not SPLIT_NEW_TOKENS:
        n_splits = prefix_splits_of(prefix_len, num_splits, MIN_SPLIT_LEN)
    if PDL:  # NOTE: the indptrs above were written before the split kernel began; its partials were not
        tl.extra.cuda.gdc_wait()
    for i in range(TOKENS):
        t = t0 + i
        if t < n_new:
            if SPLIT_NEW_TOKENS:  # the positions the last row of the split kernel's block of row t sees
                first = (t // SPLIT_TOKENS) * SPLIT_TOKENS
                n_splits = num_splits_of(block_kv_len(prefix_len, n_new, first, SPLIT_TOKENS), num_splits,
                                         MIN_SPLIT_LEN)  # fmt: skip
            merge_head(Mid_out, Mid_lse, Out, q_start + t, head, n_splits, stride_mt, stride_mh, stride_ms,
                       stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S, "", Sinks,
                       SINKS)  # fmt: skip


def merge_rows(
    mid_out: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_splits: int,
    max_extend_len: int,
    tokens: int,
    min_split_len: int,
    split_new_tokens: bool,
    pdl: bool = False,
    launch: dict | None = None,
    packed: bool = False,
    sinks: torch.Tensor | None = None,
    split_tokens: int | None = None,
) -> None:
    """out[T, Hq, D] := the splits of each request's new-token rows merged, ``tokens`` rows a program.
    A row has as many splits as the split kernel gave its block: one per started ``min_split_len``
    positions the block's last row sees (``split_new_tokens``: the short extend, whose blocks are
    ``split_tokens`` rows, ``tokens`` when None), or per started ``min_split_len`` prefix tokens, at
    least one (extend's prefix splits); at most ``num_splits``.
    ``launch``: extra launch options (PDL's). ``packed``: one program per block that exists (packed_blocks
    slots, found by locate_block) instead of one per (request, block of the longest request). ``sinks``
    [Hq] float32: attention sinks (merge_head's)."""
    t, hq, d = out.shape
    batch = qo_indptr.numel() - 1
    block_d = max(16, triton.next_power_of_2(d))
    blocks = triton.cdiv(max_extend_len, tokens)
    grid = (packed_blocks(t, batch, max_extend_len, tokens), hq) if packed else (batch, hq, blocks)
    _merge_rows_kernel[grid](
        mid_out, mid_lse, out, qo_indptr, kv_indptr, mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), num_splits, batch,
        TOKENS=tokens, SPLIT_TOKENS=split_tokens or tokens, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), MIN_SPLIT_LEN=min_split_len,
        SPLIT_NEW_TOKENS=split_new_tokens, PDL=pdl, PACKED=packed,
        BLOCK_R=request_lanes(batch, packed), Sinks=sinks, SINKS=sinks is not None, enable_fp_fusion=True,
        num_warps=4 if block_d >= 128 else 2, **(launch or {}),
    )  # fmt: skip
