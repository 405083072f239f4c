"""`python -m kernels.bench`: Triton extend/decode attention vs torch SDPA (flash) and the GPU's own
measured copy bandwidth and matmul rate, the LoRA deltas (kernels/lora.py) vs torch ops per
adapter, and verify-step attention (kernels/extend_short.py vs the extend kernel), all in one run
(decode rows, and extend rows with a prefix, also over the same K/V in an fp8 pool); JSON to --out, a
markdown report beside it (same stem, .md), a table printed last.

Needs CUDA: without it, it measures nothing and exits non-zero. Numbers are never estimated.
Kinds are measured decode first (its long-context target is the one still open), then extend, LoRA and
verify; --only names a subset. Interrupted (SIGINT: scripts/gpu-bench's deadline), it writes the rows
measured so far, says so in the report, and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kernels import compile_check, reference, timing
from kernels.bench_report import (
    DECODE_CANDIDATES,
    KINDS,
    LORA_CANDIDATES,
    STACKED,
    format_markdown,
    format_table,
    summarize,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # fp32: CPU tests only
EXTEND_PREFIXES = (0, 1024, 4096, 16384)  # cached prefix per request (tokens)
EXTEND_NEWS = (256, 1024, 4096)  # new tokens per request
EXTEND_TOKENS_PER_CALL = 16384  # batch = this // new tokens, so each call does a similar amount of work
# cache hits: few new tokens over a long cached prefix (the long-prefix tiles' case), after the grid
EXTEND_CACHE_HITS = ((1, 4096, 256), (1, 16384, 1024), (4, 16384, 256))  # (batch, prefix, new)
DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (1024, 4096, 16384, 65536)  # KV length per request (tokens)
DECODE_MAX_TOKENS = 1 << 20  # cap on batch x context: 1M tokens x 8 heads x 128 x 2 B x 2 = 4 GiB of KV
TIMING = (
    "kernels.timing median, L2 evicted by a read before each run (clean lines, as a decode step's weight reads "
    "leave it); extend: eager calls (Python launch included, as the worker runs prefill); decode: CUDA-graph "
    "replays (as the worker runs decode steps), eager calls, replays after a writing flush (dirty L2) and "
    "per-layer replays of a layer stack also recorded"
)
PAGE_TOKENS = 16  # the pool is shuffled in pages of this many slots, as a paged allocator leaves it
# LoRA deltas (kernels/lora.py) on Llama-3-8B's gate/up projection (the largest): rank 16 per part
LORA_IN, LORA_OUT, LORA_RANK = 4096, 2 * 14336, 2 * 16
LORA_BATCHES = (1, 16, 64)  # decode rows, one per request
LORA_ADAPTERS = (1, 4)  # distinct adapters in the step, each on an equal run of neighbouring requests
# verify steps (speculative decoding): few new tokens per request over a long prefix, both extend kernels;
# (batch, prefix, new), the last the longest step the worker gives the short extend (worker.attention.SHORT_EXTEND)
VERIFY_SHAPES = ((1, 4096, 5), (1, 16384, 5), (16, 4096, 5), (32, 4096, 3), (4, 8192, 16))
# decode also timed as a model step runs it: one layer after another in a single CUDA graph, each over its
# own K/V (read once per replay, so L2 holds none of it), so one graph launch is shared by the stack
STACK_LAYERS = 8
TIMELINE_REPS = 20  # profiled replays of each batch-1 decode row and each LoRA row
STACK_BYTES = 8 << 30  # at most this much K/V in the stack's copies (the largest rows then stack fewer)


@dataclasses.dataclass(frozen=True)
class Model:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # key of DTYPES

    @property
    def elem_bytes(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8


@dataclasses.dataclass(frozen=True)
class ExtendShape:
    batch: int
    prefix: int  # tokens
    new: int  # tokens


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int  # tokens


def extend_grid(
    prefixes: Sequence[int] = EXTEND_PREFIXES,
    news: Sequence[int] = EXTEND_NEWS,
    tokens_per_call: int = EXTEND_TOKENS_PER_CALL,
) -> list[ExtendShape]:
    """Every (prefix, new) pair, batched so that each call carries ~tokens_per_call new tokens."""
    return [ExtendShape(max(1, tokens_per_call // n), p, n) for p in prefixes for n in news]


def decode_grid(
    batches: Sequence[int] = DECODE_BATCHES,
    contexts: Sequence[int] = DECODE_CONTEXTS,
    max_tokens: int = DECODE_MAX_TOKENS,
) -> list[DecodeShape]:
    """Every (batch, context) pair whose KV (batch x context tokens) fits under max_tokens."""
    return [DecodeShape(b, c) for b in batches for c in contexts if b * c <= max_tokens]


def extend_flops(shape: ExtendShape, model: Model) -> int:
    """Useful FLOPs: QK^T and PV (2 FLOP per MAC each) over the keys each query may see
    (its prefix, then new tokens causally: query j sees prefix + j + 1 keys)."""
    keys_per_request = shape.prefix * shape.new + shape.new * (shape.new + 1) // 2
    return 4 * model.num_q_heads * model.head_dim * shape.batch * keys_per_request


def decode_bytes(shape: DecodeShape, model: Model, index_bytes: int = 4, kv_bytes: int | None = None) -> int:
    """Bytes a decode call must move: each K and V row once per KV head (``kv_bytes`` a value: the pool's,
    default the model's), q in and out back, slot indices."""
    tokens = shape.batch * shape.context
    kv = 2 * tokens * model.num_kv_heads * model.head_dim * (kv_bytes or model.elem_bytes)
    q_and_out = 2 * shape.batch * model.num_q_heads * model.head_dim * model.elem_bytes
    return kv + q_and_out + tokens * index_bytes


def lora_bytes(batch: int, adapters: int, elem_bytes: int) -> int:
    """Bytes a LoRA delta must move at least: each distinct adapter's A and B once, x read, out read and
    written."""
    weights = adapters * (LORA_RANK * LORA_IN + LORA_OUT * LORA_RANK)
    return (weights + batch * LORA_IN + 2 * batch * LORA_OUT) * elem_bytes


def lora_case(
    batch: int, adapters: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> tuple:
    """x, out, a, b (adapters' weights at the scale of real ones), per-request indptr and slots."""
    x = torch.randn(batch, LORA_IN, generator=gen).to(device, dtype)
    out = torch.randn(batch, LORA_OUT, generator=gen).to(device, dtype)
    a = (torch.randn(adapters, LORA_RANK, LORA_IN, generator=gen) / LORA_IN**0.5).to(device, dtype)
    b = (torch.randn(adapters, LORA_OUT, LORA_RANK, generator=gen) / LORA_RANK**0.5).to(device, dtype)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device)
    # NOTE: each adapter's requests side by side, as worker.request.build_batch orders a decode step
    slots = (torch.arange(batch, dtype=torch.int32) * adapters // batch).to(device)
    return x, out, a, b, indptr, slots


def worker_segments(indptr: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_case's requests in the segments the worker passes a decode step (neighbouring requests of
    one adapter joined, up to LORA_BLOCK_ROWS rows: kernels.reference.lora_segments), int32 on their
    device."""
    segments = reference.lora_segments(slots.cpu().numpy(), indptr.cpu().numpy(), reference.LORA_BLOCK_ROWS)
    return tuple(torch.from_numpy(t).to(indptr.device, torch.int32) for t in segments)  # type: ignore[return-value]


def lora_per_adapter(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     rows: list[torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The deltas as torch ops per adapter (``rows[s]``: adapter s's rows), in the model's dtype: what
    the worker ran before kernels/lora.py, four kernels per adapter."""
    for s, r in enumerate(rows):
        out.index_add_(0, r, (x.index_select(0, r) @ a[s].t()) @ b[s].t())
    return out


def bench_lora(batch: int, adapters: int, model: Model, device: torch.device, gen: torch.Generator) -> dict:
    """kernels/lora.py against lora_per_adapter on one decode step's gate/up deltas, both replayed as
    CUDA graphs (how the worker runs decode steps) and eager."""
    from kernels import lora

    x, base, a, b, indptr, slots = lora_case(batch, adapters, DTYPES[model.dtype], device, gen)
    rows = [torch.nonzero(slots == s).flatten() for s in range(adapters)]
    out, ref = base.clone(), lora_per_adapter(x, base.clone(), a, b, rows)
    nbytes = lora_bytes(batch, adapters, model.elem_bytes)
    row: dict[str, Any] = {"batch": batch, "adapters": adapters, "bytes": nbytes}

    def timed(name: str, ms: float) -> None:
        row[f"{name}_ms"], row[f"{name}_gbs"] = ms, nbytes / (ms * 1e-3) / 1e9

    cap = reference.LORA_BLOCK_ROWS
    seg_indptr, seg_slots = worker_segments(indptr, slots)

    def triton_call() -> None:  # NOTE: out drifts over the runs (each adds its delta); the time does not
        lora.lora_add(x, out, a, b, seg_indptr, seg_slots, cap)

    graph = timing.capture(triton_call)
    out.copy_(base)
    graph.replay()
    row["rel_err_vs_torch"] = _rel_err(out - base, ref - base)  # NOTE: the deltas, not the sums
    timed("triton_graph", timing.time_ms(graph.replay))
    timed("triton", timing.time_ms(triton_call))
    row["segments"] = int((seg_slots >= 0).sum())
    # NOTE: the candidates (LORA_CANDIDATES), each failure in the row
    default = lora.default_config(x.dtype, lora.device_arch(device))
    graphs: dict[str, Any] = {"default": graph}
    for name, (_, change) in LORA_CANDIDATES.items():
        cfg = dataclasses.replace(default, **change)
        graphs[name] = None
        try:
            graphs[name] = timing.capture(
                lambda cfg=cfg: lora.lora_add(x, out, a, b, seg_indptr, seg_slots, cap, config=cfg)
            )
            out.copy_(base)
            graphs[name].replay()
            row[f"rel_err_{name}_vs_torch"] = _rel_err(out - base, ref - base)
            timed(f"triton_{name}_graph", timing.time_ms(graphs[name].replay))
        except Exception as exc:  # a compile, launch or capture error of the candidate
            row[f"triton_{name}_error"] = failure(exc)
    # NOTE: where the step's deltas take their time: shrink, gap, expand (as decode's), at every row: the
    # launch-bound one-request rows and the 64-request one-adapter row that torch's ops beat
    record_timeline(row, graphs, ("_shrink_kernel", "_expand_kernel"), device)
    # one segment per request, as the worker passed them before
    timed(
        "triton_per_request_graph",
        timing.time_replay_ms(lambda: lora.lora_add(x, out, a, b, indptr, slots, 1)),
    )
    torch_out = base.clone()
    timed("torch_graph", timing.time_replay_ms(lambda: lora_per_adapter(x, torch_out, a, b, rows)))
    timed("torch", timing.time_ms(lambda: lora_per_adapter(x, torch_out, a, b, rows)))
    return row


def write_result(result: dict[str, Any], out: Path, markdown: str) -> None:
    """A GPU command's result as JSON at ``out`` and its markdown report beside it (same stem, .md)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}")


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (for the default --out path)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def stack_layers(kv_bytes: int, layers: int = STACK_LAYERS, max_bytes: int = STACK_BYTES) -> int:
    """Layers in the decode stack for a call over ``kv_bytes`` of K/V: ``layers``, fewer when their
    copies would pass ``max_bytes``, never under 2."""
    return max(2, min(layers, 1 + max_bytes // max(kv_bytes, 1)))


def layer_stack(kernel_args: tuple, layers: int) -> list[tuple]:
    """decode_case's kernel_args for ``layers`` layers: the same q, indices and K/V values, each layer's
    K/V in its own memory (the first layer's are the originals)."""
    q, k_cache, v_cache, kv_indptr, kv_indices = kernel_args
    copies = [(q, k_cache.clone(), v_cache.clone(), kv_indptr, kv_indices) for _ in range(layers - 1)]
    return [kernel_args, *copies]


def shuffled_slots(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """A permutation of slots [0, tokens) made of PAGE_TOKENS-slot pages in random order (int32),
    the layout a paged allocator leaves behind after some churn."""
    pages = torch.randperm(math.ceil(tokens / PAGE_TOKENS), generator=generator)
    slots = (pages[:, None] * PAGE_TOKENS + torch.arange(PAGE_TOKENS)[None, :]).reshape(-1)
    return slots[slots < tokens].to(torch.int32)


# ---------------------------------------------------------------- GPU-only below: nothing runs on import


def measure_copy_gbs(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of nbytes: (read + write) bytes / time, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timing.time_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_graph_floor_us(device: torch.device) -> float:
    """An event-timed replay (after the same L2 flush as every replay here) of a CUDA graph of one kernel
    on one element: what a replay costs besides its kernels' work, µs."""
    x = torch.zeros(1, device=device)
    return timing.time_replay_ms(lambda: x.add_(1)) * 1e3


def measure_read_ms(nbytes: int, device: torch.device) -> float:
    """An event-timed replay (after the same L2 flush as every replay here) of a CUDA graph of one plain
    reading kernel (kernels.stream) over ``nbytes``: what a single kernel reading that much takes, ms."""
    from kernels import stream

    x = torch.arange(max(nbytes // 4, 1), dtype=torch.int32, device=device)
    out = torch.empty(stream.blocks(x.numel()), dtype=torch.int32, device=device)
    return timing.time_replay_ms(lambda: stream.block_max(x, out))


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timing.time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def extend_inputs(
    shape: ExtendShape, model: Model, device: torch.device, gen: torch.Generator, on_device: bool = False
) -> tuple:
    """The paged inputs of extend_attention: (q, k_new, v_new, k_cache, v_cache, qo_indptr, kv_indptr,
    kv_indices), random, the prefix slots shuffled in pages. The values come from ``gen`` on the host,
    or with ``on_device`` from the device's own generator (faster for pools of 10^9 values)."""
    dt, hq, hkv, d = DTYPES[model.dtype], model.num_q_heads, model.num_kv_heads, model.head_dim
    b, p, n = shape.batch, shape.prefix, shape.new

    def rand(*size: int) -> torch.Tensor:
        if on_device:
            return torch.randn(*size, device=device, dtype=dt)
        return torch.randn(*size, generator=gen).to(device=device, dtype=dt)

    q, k_new, v_new = rand(b * n, hq, d), rand(b * n, hkv, d), rand(b * n, hkv, d)
    k_cache, v_cache = rand(max(b * p, 1), hkv, d), rand(max(b * p, 1), hkv, d)
    kv_indices = shuffled_slots(b * p, gen).to(device)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * n
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * p
    return q, k_new, v_new, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices


def extend_case(shape: ExtendShape, model: Model, device: torch.device, gen: torch.Generator) -> tuple:
    """(kernel_args, sdpa_args): extend_inputs, and the same logical attention for SDPA (extend_sdpa_args)."""
    kernel_args = extend_inputs(shape, model, device, gen)
    return kernel_args, extend_sdpa_args(shape, model, kernel_args)


def extend_sdpa_args(shape: ExtendShape, model: Model, kernel_args: tuple) -> tuple:
    """The attention of extend ``kernel_args`` for SDPA: (q, k, v, attn_mask), contiguous per request with
    K/V heads expanded to Hq, the prefix's K/V widened to q's dtype (an fp8 pool's included)."""
    from torch.nn.attention.bias import causal_lower_right

    hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
    b, p, n = shape.batch, shape.prefix, shape.new
    q, k_new, v_new, k_cache, v_cache, _, _, kv_indices = kernel_args

    def dense(cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        prefix = cache[kv_indices.long()].to(new.dtype).view(b, p, hkv, d)
        full = torch.cat([prefix, new.view(b, n, hkv, d)], 1)
        return full.repeat_interleave(hq // hkv, 2).transpose(1, 2)

    # NOTE: lower-right causal: new token j sees all p prefix keys and new keys 0..j.
    mask = None if p == 0 else causal_lower_right(n, p + n)
    return q.view(b, n, hq, d).transpose(1, 2), dense(k_cache, k_new), dense(v_cache, v_new), mask


def verify_bytes(shape: ExtendShape, model: Model) -> int:
    """Fewest bytes a verify step's attention moves: every K/V of each request (prefix and new) read
    once, q read and the output written."""
    kv = shape.batch * (shape.prefix + shape.new) * model.num_kv_heads * model.head_dim * 2
    return (kv + 2 * shape.batch * shape.new * model.num_q_heads * model.head_dim) * model.elem_bytes


def bench_verify(shape: ExtendShape, model: Model, device: torch.device, gen: torch.Generator) -> dict:
    """The short-extend kernel (kernels/extend_short.py, the new K/V read from the pool) against the
    extend kernel on a verify step's shape, both replayed as CUDA graphs (how the worker runs them).
    Candidates beside the default, each where its rows a program (extend_short.block_rows) differ from the
    default's: "pdl" (launched as programmatic dependents, everywhere), "slots" (DecodeConfig.prefetch_slots,
    everywhere), "narrow" (16 rows: the KV read once per 16 // group tokens) and "wide" (64 rows, on 64-token
    tiles: 128-token ones compile to one block an SM there; see extend_short.MAX_ROWS)."""
    from kernels import extend_attention as ext
    from kernels import extend_short

    q, k_new, v_new, k_cache, v_cache, qo, kvp, kv_indices = extend_inputs(shape, model, device, gen)
    k_pool, v_pool = torch.cat([k_cache, k_new]), torch.cat([v_cache, v_new])
    out_slots = torch.arange(k_cache.shape[0], k_pool.shape[0], device=device)
    short_out, ext_out = torch.empty_like(q), torch.empty_like(q)
    # NOTE: also launched as programmatic dependents (DecodeConfig.pdl), as decode's candidate
    default = extend_short.default_config(q.shape[-1], q.dtype, ext.device_arch(device))
    pdl = dataclasses.replace(default, pdl=True)
    slots = dataclasses.replace(default, prefetch_slots=True)
    wide = extend_short.wide_tiles(default)

    def short_call(config: Any = None, max_rows: int | None = None) -> None:
        extend_short.extend_short_attention(q, k_pool, v_pool, qo, kvp, kv_indices, out_slots,
                                            max_extend_len=shape.new, out=short_out, config=config,
                                            max_rows=max_rows)  # fmt: skip

    def extend_call() -> None:
        ext.extend_attention(q, k_new, v_new, k_cache, v_cache, qo, kvp, kv_indices, max_extend_len=shape.new,
                             out=ext_out)  # fmt: skip

    nbytes = verify_bytes(shape, model)
    row: dict[str, Any] = {"batch": shape.batch, "prefix": shape.prefix, "new": shape.new, "bytes": nbytes}
    for name, call in (("short", short_call), ("extend", extend_call)):
        row[f"{name}_graph_ms"] = timing.time_replay_ms(call)
        row[f"{name}_graph_gbs"] = nbytes / (row[f"{name}_graph_ms"] * 1e-3) / 1e9
    row["rel_err_vs_extend"] = _rel_err(short_out, ext_out)
    group = model.num_q_heads // model.num_kv_heads
    row["block_rows"] = extend_short.block_rows(
        group, shape.new, extend_short.max_rows_for(q.dtype, q.shape[-1])
    )
    candidates = {"pdl": lambda: short_call(pdl), "slots": lambda: short_call(slots)}
    if extend_short.block_rows(group, shape.new, 16) != row["block_rows"]:
        candidates["narrow"] = lambda: short_call(max_rows=16)
    if extend_short.block_rows(group, shape.new, extend_short.WIDE_ROWS) != row["block_rows"]:
        candidates["wide"] = lambda: short_call(wide, max_rows=extend_short.WIDE_ROWS)
    for name, call in candidates.items():
        short_out.fill_(float("nan"))  # the candidate must write every element itself
        try:
            row[f"short_{name}_graph_ms"] = timing.time_replay_ms(call)
            row[f"rel_err_{name}_vs_extend"] = _rel_err(short_out, ext_out)
        except Exception as exc:  # a compile, launch or capture error of the candidate
            row[f"short_{name}_error"] = failure(exc)
    return row


def sdpa_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
    """SDPA over extend_case's sdpa_args, returned as [T, Hq, D] like the kernel's output."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])


def decode_inputs(
    shape: DecodeShape, model: Model, device: torch.device, gen: torch.Generator, on_device: bool = False
) -> tuple:
    """The paged inputs of decode_attention: (q, k_cache, v_cache, kv_indptr, kv_indices), random, the
    slots shuffled in pages; the values from ``gen`` on the host, or with ``on_device`` from the device's
    own generator (as extend_inputs)."""
    dt, hq, hkv, d = DTYPES[model.dtype], model.num_q_heads, model.num_kv_heads, model.head_dim
    b, c = shape.batch, shape.context

    def rand(*size: int) -> torch.Tensor:
        if on_device:
            return torch.randn(*size, device=device, dtype=dt)
        return torch.randn(*size, generator=gen).to(device=device, dtype=dt)

    q, k_cache, v_cache = rand(b, hq, d), rand(b * c, hkv, d), rand(b * c, hkv, d)
    kv_indices = shuffled_slots(b * c, gen).to(device)
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=device) * c
    return q, k_cache, v_cache, kv_indptr, kv_indices


def decode_case(shape: DecodeShape, model: Model, device: torch.device, gen: torch.Generator) -> tuple:
    """(kernel_args, sdpa_args): decode_inputs, and the same attention for SDPA (decode_sdpa_args)."""
    kernel_args = decode_inputs(shape, model, device, gen)
    return kernel_args, decode_sdpa_args(shape, model, kernel_args)


def decode_sdpa_args(shape: DecodeShape, model: Model, kernel_args: tuple) -> tuple:
    """(q, k, v) for SDPA over decode ``kernel_args``: contiguous per-request K/V keeping the native KV
    heads (SDPA's enable_gqa), widened to q's dtype (an fp8 pool's included)."""
    hq, hkv, d = model.num_q_heads, model.num_kv_heads, model.head_dim
    b, c = shape.batch, shape.context
    q, k_cache, v_cache, _, kv_indices = kernel_args
    k_dense, v_dense = (
        x[kv_indices.long()].to(q.dtype).view(b, c, hkv, d).transpose(1, 2) for x in (k_cache, v_cache)
    )
    return q.view(b, hq, 1, d), k_dense, v_dense


def in_pool(kernel_args: tuple, pool: torch.dtype, at: tuple[int, int]) -> tuple:
    """``kernel_args`` with the K/V pool at positions ``at`` stored as ``pool`` (kernels.reference.to_pool)."""
    return tuple(reference.to_pool(x, pool) if i in at else x for i, x in enumerate(kernel_args))


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over decode_case's sdpa_args (K/V may also be pre-expanded to Hq heads), as [B, Hq, D]."""
    gqa = k.shape[1] != q.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    return out.view(q.shape[0], q.shape[1], q.shape[3])


def bench_extend(shape: ExtendShape, model: Model, device: torch.device, gen: torch.Generator) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import extend_attention as ext

    kernel_args, sdpa_args = extend_case(shape, model, device, gen)
    out = torch.empty_like(kernel_args[0])

    def triton_call() -> None:  # NOTE: as the worker calls it: its longest prefix and q's rows pick tiles
        ext.extend_attention(*kernel_args, max_extend_len=shape.new, max_prefix_len=shape.prefix, out=out)

    def sdpa_call() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa_extend(*sdpa_args)

    flops = extend_flops(shape, model)
    row: dict[str, Any] = {"batch": shape.batch, "prefix": shape.prefix, "new": shape.new, "flops": flops}
    arch, q = ext.device_arch(device), kernel_args[0]
    chosen = ext.default_config(q.shape[-1], q.dtype, arch, shape.prefix, shape.batch * shape.new)
    row["config"] = dataclasses.asdict(chosen)
    triton_call()
    row["triton_ms"] = timing.time_ms(triton_call)
    row["triton_tflops"] = flops / (row["triton_ms"] * 1e-3) / 1e12
    others = {}  # candidate name -> its output
    blind = ext.default_config(q.shape[-1], q.dtype, arch)
    if blind != chosen:  # the prefix picked other tiles: time the ones a batch without the hint takes
        ms = timing.time_ms(lambda: ext.extend_attention(*kernel_args, max_extend_len=shape.new, out=out,
                                                         config=blind))  # fmt: skip
        row["triton_blind_tflops"] = flops / (ms * 1e-3) / 1e12
        row["config_blind"] = dataclasses.asdict(blind)
        others["blind"] = out.clone()
    # NOTE: a grid too small for the SMs (a cache hit's few new tokens): the worker's tiles with the prefix split
    # and without, one of them the default (default_config splits eager calls over a deep prefix)
    split = dataclasses.replace(chosen, split_prefix=True)
    cap = ext.prefix_split_cap(None, shape.batch * shape.new, q.shape[1], device, split, shape.prefix)
    if cap > 1:
        other = dataclasses.replace(chosen, split_prefix=not chosen.split_prefix)
        out.fill_(float("nan"))  # the candidate must write every element itself
        ms = timing.time_ms(lambda: ext.extend_attention(*kernel_args, max_extend_len=shape.new,
                                                         max_prefix_len=shape.prefix, out=out, config=other))  # fmt: skip
        tflops = {chosen.split_prefix: row["triton_tflops"], other.split_prefix: flops / (ms * 1e-3) / 1e12}
        row.update(split_cap=cap, triton_split_tflops=tflops[True], triton_unsplit_tflops=tflops[False])
        others["split" if other.split_prefix else "unsplit"] = out.clone()
    if others:
        triton_call()  # NOTE: out is the chosen tiles' again for the error below
    try:
        ref = sdpa_call()
        row["rel_err_vs_sdpa"] = _rel_err(out, ref)
        for name, other in others.items():
            row[f"rel_err_{name}_vs_sdpa"] = _rel_err(other, ref)
        row["sdpa_ms"] = timing.time_ms(sdpa_call)
        row["sdpa_tflops"] = flops / (row["sdpa_ms"] * 1e-3) / 1e12
        row["ratio_vs_sdpa"] = row["triton_tflops"] / row["sdpa_tflops"]
    except RuntimeError as exc:  # flash backend refused the shape: say so instead of timing another backend
        row["sdpa_error"] = str(exc).splitlines()[0][:200]
    if shape.prefix > 0:  # NOTE: the same prefix in an fp8 pool (--kv-cache-dtype): a cache hit's prefill
        try:
            extend_fp8_pool(row, shape, model, kernel_args, device)
        except Exception as exc:  # a compile or launch error: recorded, the run goes on
            row["triton_fp8_error"] = failure(exc)
    return row


def extend_fp8_pool(
    row: dict, shape: ExtendShape, model: Model, kernel_args: tuple, device: torch.device
) -> None:
    """The worker's extend over the same prefix stored in an fp8 pool (e4m3 from sm_89, e5m2 before), into
    ``row``: its time and TF/s, its speed-up over the 16-bit pool's call, its error against SDPA over the
    fp8 values widened back."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import extend_attention as ext
    from kernels.compile_cases import fp8_pool

    pool = fp8_pool(ext.device_arch(device))
    args = in_pool(kernel_args, pool, (3, 4))
    out = torch.full_like(args[0], float("nan"))  # every element must be written

    def call() -> None:
        ext.extend_attention(*args, max_extend_len=shape.new, max_prefix_len=shape.prefix, out=out)

    call()
    got = out.clone()
    ms = timing.time_ms(call)
    row.update({"fp8_pool": str(pool).removeprefix("torch."), "triton_fp8_ms": ms,
                "triton_fp8_tflops": row["flops"] / (ms * 1e-3) / 1e12, "fp8_speedup": row["triton_ms"] / ms})  # fmt: skip
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        row["rel_err_fp8_vs_sdpa"] = _rel_err(got, sdpa_extend(*extend_sdpa_args(shape, model, args)))


def bench_decode(shape: DecodeShape, model: Model, device: torch.device, gen: torch.Generator) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels import decode_attention as dec
    from kernels.extend_attention import device_arch

    kernel_args, sdpa_args = decode_case(shape, model, device, gen)
    out = torch.empty_like(kernel_args[0])
    nbytes = decode_bytes(shape, model, kernel_args[-1].element_size())

    def triton_call() -> None:
        dec.decode_attention(*kernel_args, max_kv_len=shape.context, out=out)

    def sdpa_call() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa_decode(*sdpa_args)

    row: dict[str, Any] = {"batch": shape.batch, "context": shape.context, "bytes": nbytes}

    def timed(name: str, ms: float) -> None:
        row[f"{name}_ms"], row[f"{name}_gbs"] = ms, nbytes / (ms * 1e-3) / 1e9

    out.fill_(float("nan"))  # every element must be written
    triton_call()
    eager_out = out.clone()
    timed("triton", timing.time_ms(triton_call))
    # NOTE: the worker replays decode steps as CUDA graphs, so the kernels' own time is the replay's;
    # eager calls above also pay Python's launch cost (~0.15 ms on an H200 host), which dominates short
    # contexts.
    graph, graph_out = replayed(triton_call, out)
    timed("triton_graph", timing.time_ms(graph.replay))
    # NOTE: also after a writing flush (triton.testing.do_bench's), which leaves L2 full of dirty lines
    # that this call then writes back: how these rows were measured before (kernels.timing).
    timed("triton_graph_dirty", timing.time_ms(graph.replay, flush="dirty"))
    # NOTE: per layer in a stack of layers replayed as one graph, as a model step runs them
    kv_bytes = kernel_args[1].numel() * kernel_args[1].element_size() * 2
    stack = layer_stack(kernel_args, stack_layers(kv_bytes))
    q = kernel_args[0]
    # NOTE: candidates beside the default, each a failure recorded in the row rather than the end of the
    # run: the merge in the split kernel (one launch, not two), both kernels launched as programmatic
    # dependents (each may launch while the kernel before drains), the next tile's K/V loaded into
    # registers before each tile is computed, the next tile's slots loaded before each tile's K/V are waited
    # on, and each of the last two with PDL; and the slots ahead on 3-stage tiles (K/V copies buffered twice)
    base = dec.default_config(q.shape[-1], q.dtype, device_arch(device), q.shape[0])
    variants = {
        "fused": dataclasses.replace(base, fused_merge=True),
        "pdl": dataclasses.replace(base, pdl=True),
        "prefetch": dataclasses.replace(base, **dec.PREFETCH_TILES),
        "prefetch_pdl": dataclasses.replace(base, pdl=True, **dec.PREFETCH_TILES),
        "slots": dataclasses.replace(base, prefetch_slots=True),
        "slots_pdl": dataclasses.replace(base, prefetch_slots=True, pdl=True),
        "pipelined": dataclasses.replace(base, **dec.PIPELINED_TILES),
    }
    if variants["pipelined"] == variants["slots"]:  # NOTE: from MANY_REQUESTS the default's tiles are those
        del variants["pipelined"]
    outs: dict[str, torch.Tensor] = {}
    graphs: dict[str, Any] = {"default": graph}

    def stack_call(config: Any = None) -> None:
        for args in stack:
            dec.decode_attention(*args, max_kv_len=shape.context, out=out, config=config)

    def candidate(name: str, call: Any, layers: int = 1) -> None:
        try:
            graphs[name], outs[name] = replayed(call, out)
            timed(f"triton_{name}_graph", timing.time_ms(graphs[name].replay) / layers)
        except Exception as exc:  # a compile, launch or capture error of the candidate
            row[f"triton_{name}_error"] = failure(exc)

    stack_graph, stack_out = replayed(stack_call, out)
    timed("triton_stack_graph", timing.time_ms(stack_graph.replay) / len(stack))
    row["stack_layers"] = len(stack)
    del stack_graph  # NOTE: before the copies it reads are freed
    # NOTE: each graph dropped before the next, and all before the copies are freed
    for name in [n for n in STACKED if n in variants]:
        candidate(f"{name}_stack", lambda c=variants[name]: stack_call(c), len(stack))
        graphs.pop(f"{name}_stack", None)
    stack.clear()
    torch.cuda.empty_cache()
    for name, config in variants.items():
        candidate(name, lambda c=config: dec.decode_attention(*kernel_args, max_kv_len=shape.context, out=out,
                                                               config=c))  # fmt: skip
    if shape.batch == 1:  # NOTE: where a batch-1 call's time goes: the split kernel, the gap, the merge
        pairs = {name: graphs.get(name) for name in ("default", "pdl", "prefetch", "prefetch_pdl", "slots", "slots_pdl",
                                                     "pipelined", "fused")}  # fmt: skip
        record_timeline(row, pairs, ("_decode_split_kernel", "_decode_merge_kernel"), device, ("fused",))
        try:  # NOTE: and what one plain reading kernel takes over the same bytes, replayed the same way
            timed("read_graph", measure_read_ms(nbytes, device))
        except Exception as exc:  # a yardstick: its failure must not end the run
            row["read_error"] = failure(exc)
    graphs.clear()
    try:
        measure_fp8_pool(row, shape, model, kernel_args, device)
    except Exception as exc:  # a compile, launch or capture error: recorded, the run goes on
        row["triton_fp8_error"] = failure(exc)
    torch.cuda.empty_cache()
    try:
        try:
            ref = sdpa_call()
        except RuntimeError:  # flash without GQA support: expand K/V (SDPA then reads group x the bytes)
            group = model.num_q_heads // model.num_kv_heads
            q_s, k_s, v_s = sdpa_args
            sdpa_args = (q_s, k_s.repeat_interleave(group, 1), v_s.repeat_interleave(group, 1))
            row["sdpa_kv_expanded"] = True
            ref = sdpa_call()
        row["rel_err_vs_sdpa"] = _rel_err(eager_out, ref)
        row["rel_err_graph_vs_sdpa"] = _rel_err(graph_out, ref)
        row["rel_err_stack_vs_sdpa"] = _rel_err(stack_out, ref)
        for name, cand_out in outs.items():
            row[f"rel_err_{name}_vs_sdpa"] = _rel_err(cand_out, ref)
        timed("sdpa", timing.time_ms(sdpa_call))
    except RuntimeError as exc:
        row["sdpa_error"] = str(exc).splitlines()[0][:200]
        return row
    try:
        timed("sdpa_graph", timing.time_replay_ms(sdpa_call))
    except RuntimeError as exc:  # SDPA could not be captured: the eager baseline stays
        row["sdpa_graph_error"] = str(exc).splitlines()[0][:200]
    return row


def measure_fp8_pool(
    row: dict, shape: DecodeShape, model: Model, kernel_args: tuple, device: torch.device
) -> None:
    """The default decode over the same K/V stored in an fp8 pool (--kv-cache-dtype: e4m3 from sm_89, e5m2
    before), replayed alone and per layer of a stack, into ``row``: its time, its GB/s over the bytes it
    reads (one a K/V value), its speed-up over the 16-bit pool's replay, and its error against SDPA over
    the fp8 values widened back (the same attention, computed another way). Then fp8_candidates, each
    replayed alone: its time, the default's speed-up over it (``fp8_default_over_<name>``) and its error."""
    from kernels import decode_attention as dec
    from kernels.compile_cases import fp8_pool
    from kernels.extend_attention import device_arch

    arch = device_arch(device)
    pool = fp8_pool(arch)
    args = in_pool(kernel_args, pool, (1, 2))
    q = args[0]
    nbytes = decode_bytes(shape, model, args[-1].element_size(), kv_bytes=1)
    out = torch.full_like(q, float("nan"))

    def call(fp8_args: tuple = args, config: Any = None) -> None:
        dec.decode_attention(*fp8_args, max_kv_len=shape.context, out=out, config=config)

    def timed(name: str, ms: float) -> None:
        row[f"{name}_ms"], row[f"{name}_gbs"] = ms, nbytes / (ms * 1e-3) / 1e9

    graph, got = replayed(call, out)
    ms = timing.time_ms(graph.replay)
    del graph
    row.update({"fp8_pool": str(pool).removeprefix("torch."), "fp8_bytes": nbytes})
    timed("triton_fp8_graph", ms)
    if "triton_graph_ms" in row:
        row["fp8_speedup"] = row["triton_graph_ms"] / ms
    stack = layer_stack(args, stack_layers(2 * args[1].numel()))
    stack_graph = timing.capture(lambda: [call(layer) for layer in stack])
    timed("triton_fp8_stack_graph", timing.time_ms(stack_graph.replay) / len(stack))
    del stack_graph
    stack.clear()
    ref = sdpa_decode(*decode_sdpa_args(shape, model, args))
    row["rel_err_fp8_vs_sdpa"] = _rel_err(got, ref)
    default = dec.default_config(q.shape[-1], q.dtype, arch, shape.batch, pool)
    for name, config in fp8_candidates(default, q.shape[-1], q.dtype, arch, pool).items():
        try:
            graph, cand_out = replayed(lambda cfg=config: call(config=cfg), out)
            row[f"rel_err_fp8_{name}_vs_sdpa"] = _rel_err(cand_out, ref)
            cand_ms = timing.time_ms(graph.replay)
            del graph
            timed(f"triton_fp8_{name}_graph", cand_ms)
            row[f"fp8_default_over_{name}"] = cand_ms / ms
        except Exception as exc:  # NOTE: a compile, launch or capture error: recorded, the run goes on
            row[f"triton_fp8_{name}_error"] = failure(exc)


def fp8_candidates(
    default: Any, head_dim: int, q_dtype: torch.dtype, arch: int, pool: torch.dtype
) -> dict[str, Any]:
    """What kernels.bench replays beside the ``default`` decode config over an fp8 pool: "flip_f16", the
    default with its widening to fp16 (DecodeConfig.fp8_f16) flipped, under a bf16 q; "short_tiles",
    decode_attention.FP8_SHORT_TILES (the previous default) where default_config takes the fp8 pools' tiles;
    "pdl", the default launched as programmatic dependents, from sm_90 (the tune's fastest rows over an fp8
    pool had it); "slots", the default with DecodeConfig.prefetch_slots flipped."""
    from kernels import decode_attention as dec

    candidates = {}
    if dec.widens_fp8_to_fp16(q_dtype, pool):
        candidates["flip_f16"] = dataclasses.replace(default, fp8_f16=not default.fp8_f16)
    if dec.takes_fp8_tiles(head_dim, q_dtype, arch, pool) and default != dec.FP8_SHORT_TILES:
        candidates["short_tiles"] = dec.FP8_SHORT_TILES
    if arch >= 90:
        candidates["pdl"] = dataclasses.replace(default, pdl=not default.pdl)
    candidates["slots"] = dataclasses.replace(default, prefetch_slots=not default.prefetch_slots)
    return candidates


def replayed(call: Any, out: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``call`` captured as a CUDA graph, and what one replay writes into ``out``, poisoned first."""
    graph = timing.capture(call)
    out.fill_(float("nan"))  # the replay must write every element itself
    graph.replay()
    return graph, out.clone()


def failure(exc: BaseException) -> str:
    """How a row records a candidate's or a diagnosis's failure (the run goes on)."""
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def record_timeline(
    row: dict,
    graphs: dict[str, Any],
    kernels: tuple[str, str],
    device: torch.device,
    one_kernel: tuple[str, ...] = (),
) -> None:
    """row["timeline"]: for each graph (None: that candidate failed, left out), split_merge_times of its
    replays as the CUDA profiler recorded them, over the launch pair ``kernels`` (the graphs named in
    ``one_kernel`` launch the first kernel alone: a merge fused into it); the event-timed replay minus the
    span is what the graph adds. A profiler failure goes in row["timeline_error"]: it is a diagnosis and
    must not end the run."""
    first, second = kernels
    try:
        row["timeline"] = {
            name: split_merge_times(timing.profile_kernels(g.replay, device, TIMELINE_REPS), first,
                                    None if name in one_kernel else second)
            for name, g in graphs.items() if g is not None
        }  # fmt: skip
    except Exception as exc:
        row["timeline_error"] = failure(exc)


def split_merge_times(
    spans: Sequence[tuple[str, float, float]], split: str, merge: str | None
) -> dict | None:
    """Medians (µs) over every ``split`` kernel that a ``merge`` kernel follows in ``spans`` (timing.
    device_spans; names matched as substrings): each kernel's time, the gap from the split's end to the
    merge's start (negative where the merge started first: a programmatic dependent launch), and the
    span from the split's start to the merge's end. None without such a pair. With ``merge`` None (the
    merge fused into the split kernel): every ``split`` kernel's time, which is also its span."""
    if merge is None:
        times = [end - start for name, start, end in spans if split in name]
        if not times:
            return None
        split_us = round(statistics.median(times), 3)
        return {
            "pairs": len(times),
            "split_us": split_us,
            "merge_us": None,
            "gap_us": None,
            "span_us": split_us,
        }
    pairs, last_split = [], None
    for name, start, end in spans:
        if split in name:
            last_split = (start, end)
        elif merge in name and last_split is not None:
            pairs.append((last_split, (start, end)))
            last_split = None
    if not pairs:
        return None

    def median(values: Any) -> float:
        return round(statistics.median(values), 3)

    return {
        "pairs": len(pairs),
        "split_us": median(s_end - s_start for (s_start, s_end), _ in pairs),
        "merge_us": median(m_end - m_start for _, (m_start, m_end) in pairs),
        "gap_us": median(m_start - s_end for (_, s_end), (m_start, _) in pairs),
        "span_us": median(m_end - s_start for (s_start, _), (_, m_end) in pairs),
    }


def measure_extend(rows: list, args: argparse.Namespace, model: Model, device: Any, gen: Any) -> None:
    """Every extend shape of the grid, then the cache hits (with --quick: the grid's 2x2 subset only),
    appended to ``rows`` as measured."""
    shapes = extend_grid(EXTEND_PREFIXES[1:3], EXTEND_NEWS[:2]) if args.quick else extend_grid()
    for shape in shapes + ([] if args.quick else [ExtendShape(*hit) for hit in EXTEND_CACHE_HITS]):
        rows.append(bench_extend(shape, model, device, gen))
        torch.cuda.empty_cache()  # each shape allocates its own pool; do not let them pile up
        print(f"extend {shape}: {rows[-1]['triton_tflops']:.1f} TF/s", file=sys.stderr)


def measure_decode(rows: list, args: argparse.Namespace, model: Model, device: Any, gen: Any) -> None:
    """Every decode shape of the grid, appended to ``rows`` as measured, with the candidates' rates."""
    for shape in decode_grid(DECODE_BATCHES[1:3], DECODE_CONTEXTS[1:3]) if args.quick else decode_grid():
        rows.append(row := bench_decode(shape, model, device, gen))
        torch.cuda.empty_cache()
        cands = ", ".join(
            f"{row[f'triton_{n}_graph_gbs']:.0f} {n}"
            if f"triton_{n}_graph_gbs" in row
            else f"{n}: {row.get(f'triton_{n}_error', '-')}"
            for n in DECODE_CANDIDATES
        )
        read = f", plain read {row['read_graph_gbs']:.0f}" if "read_graph_gbs" in row else ""
        if "triton_fp8_graph_gbs" in row:
            read += f", fp8 pool {row['triton_fp8_graph_gbs']:.0f} ({row.get('fp8_speedup', 0):.2f}x the 16-bit time)"
        print(f"decode {shape}: {row['triton_graph_gbs']:.0f} GB/s replayed{read}, "
              f"{row['triton_stack_graph_gbs']:.0f} per layer of {row['stack_layers']} replayed, "
              f"{row['triton_gbs']:.0f} eager; candidates {cands}", file=sys.stderr)  # fmt: skip


def measure_lora(rows: list, args: argparse.Namespace, model: Model, device: Any, gen: Any) -> None:
    """LoRA deltas at every batch and adapter count, appended to ``rows`` as measured."""
    for batch in LORA_BATCHES[1:] if args.quick else LORA_BATCHES:
        for adapters in LORA_ADAPTERS:
            rows.append(row := bench_lora(batch, adapters, model, device, gen))
            ms = row.get("triton_former_graph_ms")
            former = f"{ms * 1e3:.1f} us" if ms else row.get("triton_former_error", "-")
            print(f"lora b={batch} adapters={adapters}: {row['triton_graph_ms'] * 1e3:.1f} us replayed "
                  f"(128-column without PDL {former}), {row['torch_graph_ms'] * 1e3:.1f} us per-adapter torch",
                  file=sys.stderr)  # fmt: skip


def measure_verify(rows: list, args: argparse.Namespace, model: Model, device: Any, gen: Any) -> None:
    """Every verify shape, appended to ``rows`` as measured."""
    for batch, prefix, new_tokens in VERIFY_SHAPES[::2] if args.quick else VERIFY_SHAPES:
        rows.append(row := bench_verify(ExtendShape(batch, prefix, new_tokens), model, device, gen))
        torch.cuda.empty_cache()
        print(f"verify b={batch} prefix={prefix} new={new_tokens}: {row['short_graph_ms'] * 1e3:.1f} us short, "
              f"{row['extend_graph_ms'] * 1e3:.1f} us extend kernel", file=sys.stderr)  # fmt: skip


# NOTE: measured in KINDS' order; decode first, as its long-context target is the one still open
MEASURE = dict(zip(KINDS, (measure_decode, measure_extend, measure_lora, measure_verify), strict=True))


def measure_kinds(result: dict, kinds: Sequence[str], *args: Any) -> None:
    """Each of ``kinds`` measured in KINDS' order into result[kind] (every kind's list is there, empty
    when not asked for). Interrupted (scripts/gpu-bench's deadline sends SIGINT), it keeps the rows
    measured so far and says where it stopped (result["interrupted"])."""
    result.update({kind: [] for kind in KINDS})
    result["kinds"] = [kind for kind in KINDS if kind in kinds]
    kind = None
    try:
        for kind in result["kinds"]:
            MEASURE[kind](result[kind], *args)
    except KeyboardInterrupt:
        result["interrupted"] = f"during {kind}"
        print(f"interrupted {result['interrupted']}: writing the rows measured so far", file=sys.stderr)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The attention shape and dtype flags (Llama-3-8B's by default) and the input seed."""
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    ap.add_argument("--seed", type=int, default=0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__)
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/benchmarks/kernels-<gpu>.json)"
    )
    add_model_args(ap)
    ap.add_argument("--quick", action="store_true", help="a 2x2 subset of each grid")
    ap.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                    help=f"measure only these kinds ({', '.join(KINDS)}; default all)")  # fmt: skip
    return ap.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class GpuRun:
    """What a GPU command (kernels.bench, kernels.tune, kernels.sweep) measures with."""

    device: torch.device
    gpu: str  # the device's name
    model: Model
    gen: torch.Generator


def start_gpu_run(prog: str, args: argparse.Namespace) -> GpuRun | None:
    """The CUDA device, its name, the model of ``args`` (add_model_args) and a generator seeded by
    it; None, having said why on stderr, without a CUDA GPU."""
    if not torch.cuda.is_available():
        print(
            f"{prog} needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
            file=sys.stderr,
        )
        return None
    device = torch.device("cuda")
    model = Model(args.q_heads, args.kv_heads, args.head_dim, args.dtype)
    return GpuRun(device, torch.cuda.get_device_name(device), model, torch.Generator().manual_seed(args.seed))


def run_record(run: GpuRun, command: str, timing: str, **device: Any) -> dict[str, Any]:
    """The head of a GPU command's JSON: the device (with ``device``'s extra fields), the software, the
    command line, the model and how it timed."""
    import triton

    return {
        "device": {
            "name": run.gpu,
            "sm_count": torch.cuda.get_device_properties(run.device).multi_processor_count,
            **device,
        },
        "software": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "command": command,
        "model": dataclasses.asdict(run.model),
        "timing": timing,
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = start_gpu_run("kernels.bench", args)
    if run is None:
        return 2
    device, gpu, model, gen = run.device, run.gpu, run.model, run.gen
    started = time.time()
    result = run_record(
        run,
        " ".join(["python -m kernels.bench", *argv]),
        TIMING,
        copy_gbs=measure_copy_gbs(device),
        matmul_tflops=measure_matmul_tflops(device, DTYPES[args.dtype]),
        graph_floor_us=measure_graph_floor_us(device),
    )
    measure_kinds(result, args.only, args, model, device, gen)
    result["summary"] = summarize(result)
    compile_check.record_loaded_kernels(result)  # registers and spills as loaded on this GPU
    result["wall_s"] = round(time.time() - started, 1)
    write_result(result, args.out or Path("docs/benchmarks") / f"kernels-{gpu_slug(gpu)}.json",
                 format_markdown(result))  # fmt: skip
    print(format_table(result))
    return 130 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
