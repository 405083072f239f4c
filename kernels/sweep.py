"""Sweeps that kernels.tune does not make, on a CUDA GPU; JSON and a markdown report.

- extend: sm_90's two tile choices at head dim 128 (64x32 with 4 warps and 2 stages, and the
  long-prefix tiles, 128x64 with 8 warps and 3 stages) over (longest cached prefix, requests x new
  tokens). kernels.extend_attention.default_config picks between them from the batch's longest prefix
  and its new tokens in all (long_prefix_batch); the report says which one it picks on each row.
- extend_graph: the same two tile choices replayed as the worker's extend graphs run them (a cache
  hit's few new tokens padded to the graph's token count, its grid over the graph's 32 request rows,
  all but one empty, or all but four for a step of four cache hits), the rows the worker's choice
  of capture (kernels.extend_attention.graph_variant) is checked against;
- in both extend sweeps, each tile choice also with its prefix split (ExtendConfig.split_prefix, off
  by default) wherever the call's grid is small enough that it splits;
- decode: batch 1 at 8k, 16k and 32k tokens of context over fixed split counts, each with and without
  PDL (programmatic dependent launch), and with the next tile's K/V prefetched into registers
  (decode_attention.PREFETCH_TILES), without and with PDL, beside the default split count;
- decode_tiles: decode's tile choices (tokens a tile, warps, pipeline stages) over batch x context, each
  at its default split count, and the default tiles at other split counts: the rows a batch-dependent
  tile or split rule would be set from; the report says what decode_tile_rule (set before the rows were
  measured) makes of them, from each tile's residency as loaded (the JSON's "compiled").

Timing as kernels.bench: kernels.timing's median after an L2 flush; extend as eager calls (as the
worker runs prefill), extend_graph and decode as CUDA-graph replays. Every extend row also records the
relative difference between the two tiles' outputs.
Usage: python -m kernels.sweep [--only extend extend_graph decode decode_tiles] [--out PATH] [--markdown PATH] [model options]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kernels import bench, compile_check, timing

KINDS = ("extend", "extend_graph", "decode", "decode_tiles")
# (longest cached prefix, requests, new tokens each): around where the long-prefix tiles stop winning
EXTEND_SHAPES = tuple(
    [(p, b, n) for p in (0, 1024, 2048, 4096) for b, n in ((1, 256), (2, 256), (4, 256), (8, 256), (1, 1024), (1, 2048))]
    + [(4096, 1, 128), (4096, 12, 256), (4096, 1, 3072)]
    + [(8192, 1, 256), (8192, 4, 256), (8192, 8, 256), (8192, 12, 256), (8192, 16, 256), (8192, 2, 1024), (8192, 4, 1024)]
    + [(16384, b, 256) for b in (1, 4, 8, 12, 16, 32)]
    + [(16384, 1, 512), (16384, 1, 1024), (16384, 2, 1024), (16384, 4, 1024), (16384, 8, 1024)]
    + [(16384, 2, 2048), (16384, 1, 4096)]
    + [(32768, 1, 128), (32768, 4, 256), (32768, 8, 256), (32768, 16, 256)]
)  # fmt: skip
# (longest cached prefix, new tokens a request, the graph's padded token count, requests): requests in a
# graph of GRAPH_ROWS request rows (worker.model_executor.EXTEND_GRAPH_REQUESTS); up to 16 new tokens
# a request go elsewhere. Four cache hits in one step: graph_variant's rule is from one request's rows.
GRAPH_SHAPES = tuple(
    [(p, new, size, 1) for p in (0, 512, 1024, 2048, 4096, 16384) for new, size in ((20, 32), (50, 64), (100, 128), (208, 256))]
    + [(p, new, size, 4) for p in (512, 2048, 4096, 16384) for new, size in ((20, 128), (50, 256))]
)  # fmt: skip
GRAPH_ROWS = 32
DECODE_CONTEXTS = (8192, 16384, 32768)
DECODE_SPLITS = (16, 24, 32, 48, 64)  # fixed split caps, beside the default one
# (requests, context): up to 512k tokens of K/V a call (2 GB at 8 KV heads of 128, 16-bit)
DECODE_TILE_SHAPES = tuple(
    (b, c) for b in (1, 4, 8, 16, 32, 64, 128) for c in (1024, 4096, 16384, 65536) if b * c <= 1 << 19
)
# (tokens a tile, warps, stages): sm_90's default at head dim 128 (128, 4, 2) and what kernels.tune ran
# fastest at 1 x 16k, 32 x 4k and 8 x 64k on the H100 and the H200 (docs/benchmarks/kernels-tune-*.json:
# 64-token tiles with 2 warps 1.07x / 1.18x the default at 32 x 4k; 128, 4 warps the best at 1 x 16k)
DECODE_TILES = ((128, 4, 2), (128, 4, 3), (64, 2, 2), (64, 2, 3), (64, 4, 3))


def extend_tiles() -> dict[str, Any]:
    """The two sm_90 extend tile choices at head dim 128: name -> ExtendConfig."""
    from kernels.extend_attention import LONG_PREFIX_TILES, SM90_TILES

    return {"small": SM90_TILES, "long_prefix": LONG_PREFIX_TILES}


def run_and_time(call: Any, out: torch.Tensor, kept: int, timer: Any) -> tuple[torch.Tensor, float]:
    """``call``'s first ``kept`` output rows (float32; poisoned first, so a row it leaves unwritten
    shows as NaN) and ``timer``'s time of it."""
    out[:kept].fill_(float("nan"))
    call()
    return out[:kept].float().clone(), timer(call)


def time_tiles(args: tuple, max_extend_len: int, out: torch.Tensor, kept: int, timer: Any,
               max_prefix_len: int | None = None) -> tuple[dict[str, float], float, dict[str, int], torch.Tensor]:  # fmt: skip
    """extend_attention on ``args`` with each tile choice, and each again with its prefix split
    (ExtendConfig.split_prefix) where the split cap for this call (q's rows, ``max_prefix_len``) is above
    1: ``timer``'s time of each (name, or name + "_split" -> its unit), the largest relative difference
    of an output's first ``kept`` rows from the 64x32 tiles', each split tile choice's cap, and the 64x32
    tiles' output rows (float32)."""
    from kernels import extend_attention as ext

    q = args[0]
    times, outs, caps = {}, {}, {}
    for name, tile in extend_tiles().items():
        for split in (False, True):
            cfg = dataclasses.replace(tile, split_prefix=split)
            if split:
                cap = ext.prefix_split_cap(None, q.shape[0], q.shape[1], q.device, cfg, max_prefix_len)
                if cap == 1:
                    continue
                caps[name] = cap

            def call(cfg: Any = cfg) -> None:
                ext.extend_attention(*args, max_extend_len=max_extend_len, max_prefix_len=max_prefix_len, out=out,
                                     config=cfg)  # fmt: skip

            key = f"{name}_split" if split else name
            outs[key], times[key] = run_and_time(call, out, kept, timer)
    ref = outs["small"]
    diff = max(bench._rel_err(o, ref) for key, o in outs.items() if key != "small")
    return times, diff, caps, ref


def sweep_extend(prefix: int, batch: int, new: int, model: bench.Model, device: torch.device,
                 gen: torch.Generator) -> dict:  # fmt: skip
    """One row: each tile choice's median ms (unsplit, and split where it splits), the long-prefix tiles'
    speedup, the outputs' largest difference."""
    torch.manual_seed(prefix * 1_000_003 + batch * 1009 + new)  # the device draws of extend_inputs
    args = bench.extend_inputs(bench.ExtendShape(batch, prefix, new), model, device, gen, on_device=True)
    out = torch.empty_like(args[0])
    ms, diff, caps, _ = time_tiles(args, new, out, out.shape[0], timing.time_ms, prefix)
    return {"prefix": prefix, "batch": batch, "new": new, "small_ms": ms["small"],
            "long_prefix_ms": ms["long_prefix"], "long_prefix_speedup": ms["small"] / ms["long_prefix"],
            "small_split_ms": ms.get("small_split"), "long_prefix_split_ms": ms.get("long_prefix_split"),
            "small_split_cap": caps.get("small"), "long_prefix_split_cap": caps.get("long_prefix"),
            "rel_diff": diff}  # fmt: skip


def sweep_extend_graph(prefix: int, new: int, size: int, requests: int, model: bench.Model, device: torch.device,
                       gen: torch.Generator, rows: int = GRAPH_ROWS) -> dict:  # fmt: skip
    """One row: each tile choice replayed as an extend graph of ``size`` tokens and ``rows`` request rows
    runs ``requests`` requests of ``new`` tokens each over ``prefix`` each (the padding tokens and the
    other rows own nothing), median us, unsplit and with the split cap such a graph takes (its prefix
    unknown); the 64x32 tiles again over the requests' rows alone (what the empty rows' programs cost);
    the long-prefix tiles' speedup; the outputs' largest difference on the requests' rows."""
    from kernels import extend_attention as ext

    if not 0 < requests * new <= size or requests > rows:
        raise ValueError(f"{requests} x {new} new tokens do not fit a graph of {size} tokens and {rows} rows")
    torch.manual_seed(prefix * 1_000_003 + new * 1009 + size * 7 + requests)
    shape = bench.ExtendShape(requests, prefix, size)  # NOTE: each request's prefix; q's first size rows
    q, k_new, v_new, k_cache, v_cache, _, _, kv_indices = bench.extend_inputs(
        shape, model, device, gen, on_device=True
    )
    q, k_new, v_new = q[:size], k_new[:size], v_new[:size]
    held = torch.arange(rows + 1, dtype=torch.int32, device=device).clamp(max=requests)
    qo_indptr, kv_indptr = held * new, held * prefix
    args = (q, k_new, v_new, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)
    out = torch.zeros_like(q)
    kept = requests * new

    def replay_us(call: Any) -> float:
        return timing.time_replay_ms(call) * 1e3

    us, diff, caps, ref = time_tiles(args, size, out, kept, replay_us)
    # NOTE: the graph's tiles (64x32) again, unsplit and split, over its requests' rows alone (what the
    # empty rows' programs cost) and with the packed grid (their programs mostly gone)
    one_row = (*args[:5], qo_indptr[: requests + 1], kv_indptr[: requests + 1], kv_indices)
    small, more = extend_tiles()["small"], {}
    for key, cfg in (("small", small), ("small_split", dataclasses.replace(small, split_prefix=True))):
        if key not in us:
            continue
        for variant, call_args, variant_cfg in (("one_row", one_row, cfg),
                                                ("packed", args, dataclasses.replace(cfg, packed_blocks=True))):  # fmt: skip

            def call(a: tuple = call_args, c: Any = variant_cfg) -> None:
                ext.extend_attention(*a, max_extend_len=size, out=out, config=c)

            rows_out, more[f"{key}_{variant}_us"] = run_and_time(call, out, kept, replay_us)
            diff = max(diff, bench._rel_err(rows_out, ref))
    return {"prefix": prefix, "new": new, "size": size, "rows": rows, "requests": requests, "small_us": us["small"],
            "long_prefix_us": us["long_prefix"], "long_prefix_speedup": us["small"] / us["long_prefix"],
            "small_split_us": us.get("small_split"), "long_prefix_split_us": us.get("long_prefix_split"),
            "small_split_cap": caps.get("small"), "long_prefix_split_cap": caps.get("long_prefix"),
            "small_one_row_us": more["small_one_row_us"], "small_split_one_row_us": more.get("small_split_one_row_us"),
            "small_packed_us": more["small_packed_us"], "small_split_packed_us": more.get("small_split_packed_us"),
            "rel_diff": diff}  # fmt: skip


def _new_cell(row: dict) -> str:
    """An extend-graph row's new tokens: "20", or "4 x 20" for four requests of 20."""
    requests = row.get("requests", 1)
    return f"{requests} x {row['new']}" if requests > 1 else str(row["new"])


def sweep_decode(context: int, model: bench.Model, device: torch.device, gen: torch.Generator) -> list[dict]:
    """Batch 1 at ``context``: the default split cap and each of DECODE_SPLITS, the default tiles without
    and with PDL, then dec.PREFETCH_TILES without and with PDL."""
    from kernels import decode_attention as dec

    shape = bench.DecodeShape(batch=1, context=context)
    args, _ = bench.decode_case(shape, model, device, gen)
    out = torch.empty_like(args[0])
    nbytes = bench.decode_bytes(shape, model)
    base = dec.default_config(model.head_dim, bench.DTYPES[model.dtype], dec.device_arch(device))
    default_splits = dec.split_cap(None, 1, model.num_kv_heads, device, base, context)
    rows = []
    prefetch = dataclasses.replace(base, **dec.PREFETCH_TILES)
    for cfg in (base, dataclasses.replace(base, pdl=True), prefetch, dataclasses.replace(prefetch, pdl=True)):
        for splits in (None, *DECODE_SPLITS):

            def call(cfg: Any = cfg, splits: int | None = splits) -> None:
                dec.decode_attention(*args, max_kv_len=context, out=out, config=cfg, num_splits=splits)

            us = timing.time_replay_ms(call) * 1e3
            rows.append({"context": context, "pdl": cfg.pdl, "prefetch": cfg.prefetch,
                         "splits": splits or default_splits, "default": splits is None, "us": us,
                         "gbs": nbytes / us / 1e3})  # fmt: skip
    return rows


def tile_label(block_n: int, warps: int, stages: int) -> str:
    """Decode tiles as the report names them: tokens a tile / warps / stages."""
    return f"{block_n}/{warps}/{stages}"


def config_label(cfg: Any) -> str:
    """A DecodeConfig's tile_label."""
    return tile_label(cfg.block_n, cfg.num_warps, cfg.num_stages)


def sweep_decode_tiles(batch: int, context: int, model: bench.Model, device: torch.device,
                       gen: torch.Generator) -> dict:  # fmt: skip
    """``batch`` requests of ``context`` tokens: each of DECODE_TILES (and the default's, where it is none of
    them) replayed at its own default split cap, then the default's tiles at other_split_caps; the largest
    relative difference of any output from the default's."""
    from kernels import decode_attention as dec

    shape = bench.DecodeShape(batch=batch, context=context)
    dt, hkv, d = bench.DTYPES[model.dtype], model.num_kv_heads, model.head_dim
    torch.manual_seed(batch * 1_000_003 + context)
    # NOTE: K/V drawn on the device: up to 10^9 values a row
    q, k_cache, v_cache, kv_indptr, kv_indices = bench.decode_inputs(
        shape, model, device, gen, on_device=True
    )
    nbytes = bench.decode_bytes(shape, model)
    base = dec.default_config(d, dt, dec.device_arch(device), batch)
    configs = {config_label(base): base}
    for block_n, warps, stages in DECODE_TILES:
        cfg = dataclasses.replace(base, block_n=block_n, num_warps=warps, num_stages=stages)
        configs.setdefault(config_label(cfg), cfg)
    row: dict[str, Any] = {"batch": batch, "context": context, "default": config_label(base), "us": {}, "gbs": {},
                           "splits": {}, "split_us": {}, "rel_diff": 0.0}  # fmt: skip
    want: list[torch.Tensor] = []  # the default's output

    def timed(cfg: Any, splits: int | None) -> float:
        out = torch.empty_like(q)

        def call() -> None:
            dec.decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, max_kv_len=context, out=out,
                                 config=cfg, num_splits=splits)  # fmt: skip

        us = timing.time_replay_ms(call) * 1e3
        call()
        if not want:
            want.append(out.float())
        else:
            diff = ((out.float() - want[0]).norm() / want[0].norm()).item()
            row["rel_diff"] = max(row["rel_diff"], diff)
        return us

    for label, cfg in configs.items():
        us = row["us"][label] = timed(cfg, None)
        row["gbs"][label] = nbytes / us / 1e3
        row["splits"][label] = dec.split_cap(None, batch, hkv, device, cfg, context)
    for splits in other_split_caps(row["splits"][row["default"]], context, base.min_split_len):
        row["split_us"][splits] = timed(base, splits)
    return row


def other_split_caps(default: int, context: int, min_split_len: int) -> list[int]:
    """Split caps to time the default tiles at besides ``default``: none (1), half and twice it, each as
    many as a request of ``context`` tokens takes (a cap past cdiv(context, min_split_len) changes nothing).
    NOTE: with the default's programs more than one wave of resident blocks (sm_90: 3 an SM at 128/4/2),
    fewer splits may fill the GPU better; the tuner's 32 x 4k row (512 programs) suggests it."""
    from kernels import decode_attention as dec

    most = min(dec.MAX_SPLITS, -(-context // min_split_len))
    caps = {min(max(1, c), most) for c in (1, default // 2, 2 * default)}
    return sorted(caps - {min(default, most)})


def decode_residency(doc: dict) -> dict[str, int]:
    """Resident blocks an SM of each decode tile choice's split kernel (tile label -> blocks), from the
    registers and shared memory it was loaded with on the sweep's GPU (doc["compiled"]) and its arch's
    limits (compile_check.blocks_per_sm); {} where either is missing. The plain split kernel only (no
    PDL, prefetch or fused merge), as the decode_tiles rows time it."""
    limits = compile_check.ARCHS.get(doc["device"].get("arch"))
    found: dict[str, int] = {}
    for k in doc.get("compiled", []) if limits else []:
        c = k["constants"]
        if k["kernel"] != "_decode_split_kernel" or k["regs"] is None:
            continue
        if c.get("PDL") or c.get("PREFETCH") or c.get("FUSED_MERGE"):
            continue
        found[tile_label(c["BLOCK_N"], k["num_warps"], k["num_stages"])] = compile_check.blocks_per_sm(
            limits, k["regs"], k["shared_bytes"], k["num_warps"]
        )
    return found


def _caps_us(row: dict) -> dict[int, float]:
    """The row's default tiles' time at each split cap a decode_tiles row timed them at."""
    return {row["splits"][row["default"]]: row["us"][row["default"]]} | {
        int(c): us for c, us in row.get("split_us", {}).items()
    }


def decode_tile_rule(
    rows: list[dict], sms: int, resident: dict[str, int], kv_heads: int, tolerance: float = 0.02,
    min_gain: float = 0.03,
) -> dict[str, Any]:  # fmt: skip
    """What the decode_tiles rows say to change, by the rule set before they were measured:
    1. where another tile choice beats the default tiles by more than ``tolerance``, if on every such row
       the default tiles at the split cap one wave of resident programs allows (SMs x resident blocks
       / (requests x KV heads), at least 1, at most the default cap) are within ``tolerance`` of the
       fastest, and that cap is no slower than the default's on the rows it changes, cap the split count
       by residency: {"change": "split_cap", "rows": [(batch, context, default cap, new cap)]};
    2. else the smallest swept batch B from which one tile choice X is within ``tolerance`` of the fastest
       on every row of B requests or more and beats the default by ``min_gain`` on their geomean (the best
       gain when several do): {"change": "tile", "tile": X, "from_batch": B, "gain": geomean speedup};
    3. else {"change": None, "why": ...}.
    Each row against its own default (a row records the tiles default_config took for its batch)."""
    slack = 1.0 + tolerance
    if not rows:
        return {"change": None, "why": "no decode_tiles rows"}

    def own(r: dict) -> float:
        return r["us"][r["default"]]

    lost = [r for r in rows if own(r) > slack * min(r["us"].values())]
    if not lost:
        return {
            "change": None,
            "why": f"the default tiles are within {tolerance:.0%} of the fastest on every row",
        }

    def wave_cap(r: dict) -> int:
        cap = r["splits"][r["default"]]
        return min(cap, max(1, sms * resident[r["default"]] // (r["batch"] * kv_heads)))

    if all(r["default"] in resident for r in rows):
        capped = [r for r in rows if wave_cap(r) != r["splits"][r["default"]]]

        def capped_us(r: dict) -> float:  # inf where the cap was not timed
            return _caps_us(r).get(wave_cap(r), float("inf"))

        # NOTE: a lost row whose cap stays fails the first test (its time is the default's)
        serves_lost = all(capped_us(r) <= slack * min(r["us"].values()) for r in lost)
        if serves_lost and all(capped_us(r) <= slack * own(r) for r in capped):
            return {"change": "split_cap",
                    "rows": [(r["batch"], r["context"], r["splits"][r["default"]], wave_cap(r)) for r in capped]}  # fmt: skip
    for batch in sorted({r["batch"] for r in rows}):
        over = [r for r in rows if r["batch"] >= batch]
        gains = {}
        for tile in dict.fromkeys(t for r in over for t in r["us"]):
            if all(tile == r["default"] for r in over) or any(tile not in r["us"] for r in over):
                continue  # already the default there, or not timed everywhere
            if all(r["us"][tile] <= slack * min(r["us"].values()) for r in over):
                gains[tile] = statistics.geometric_mean(own(r) / r["us"][tile] for r in over)
        best = max(gains, key=gains.get, default=None)
        if best is not None and gains[best] >= 1.0 + min_gain:
            return {"change": "tile", "tile": best, "from_batch": batch, "gain": gains[best]}
    return {"change": None, "why": f"another tile wins on {len(lost)} rows, but neither a residency cap nor "
                                   "one tile from some batch on serves them all"}  # fmt: skip


# how much slower than the fastest capture the one graph_variant replays may be on a swept row before its
# thresholds move to the measured crossings
VARIANT_SLACK = 0.05


def replayed_over_fastest(row: dict) -> tuple[str, float]:
    """The capture kernels.extend_attention.graph_variant replays for an extend_graph row (the worker's
    three: 64x32, 128x64, 64x32 split) and its time over the fastest of them."""
    from kernels import extend_attention as ext

    times = {"default": row["small_us"], "long_prefix": row["long_prefix_us"],
             "split": row.get("small_split_us") or float("inf")}  # fmt: skip
    variant = ext.graph_variant(row["prefix"], row["size"], ("long_prefix", "split"))
    return variant, times[variant] / min(times.values())


def picks_long_prefix(row: dict, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the worker's default (sm_90) takes the long-prefix tiles for this extend row."""
    from kernels import extend_attention as ext

    chosen = ext.default_config(head_dim, dtype, 90, row["prefix"], row["batch"] * row["new"])
    return dataclasses.replace(chosen, split_prefix=False) == extend_tiles()["long_prefix"]


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _split_cell(row: dict, tiles: str, unit: str, spec: str) -> str:
    """'0.051 (5)': a tile choice's split time and its cap; '-' where the row did not split it."""
    t = row.get(f"{tiles}_split_{unit}")
    return "-" if t is None else f"{format(t, spec)} ({row[f'{tiles}_split_cap']})"


def markdown(doc: dict) -> str:
    """The report: one table per sweep that ran."""
    dev, sw = doc["device"], doc["software"]
    lines = [
        f"# Sweeps on {dev['name']}",
        "",
        f"torch {sw['torch']}, triton {sw['triton']}; {doc['model']['num_q_heads']} query heads, "
        f"{doc['model']['num_kv_heads']} KV heads, head dim {doc['model']['head_dim']}, {doc['model']['dtype']}.",
        f"Command: `{doc['command']}`. Timing: {doc['timing']}.",
    ]
    if doc.get("runs"):
        lines.append(f"Runs: {doc['runs']}.")
    if doc.get("copy_gbs"):
        lines.append(
            f"Copy bandwidth, measured after the decode sweep: {doc['copy_gbs']:,.0f} GB/s (read + write)."
        )
    if doc.get("extend"):
        lines += [
            "",
            "## Extend: the two sm_90 tile choices",
            "",
            "64x32 (4 warps, 2 stages) against the long-prefix tiles 128x64 (8 warps, 3 stages), eager calls;"
            " the default column is what kernels.extend_attention.default_config takes for the row (from the"
            " longest prefix and the new tokens in all). The split columns time each tile choice with its"
            " prefix split (ExtendConfig.split_prefix, off by default; the most parts in brackets) where the"
            " grid is small enough to split.",
            "",
            "| prefix | requests x new | new tokens | 64x32 ms | 128x64 ms | 128x64 speedup | default takes "
            "| 64x32 split ms | 128x64 split ms | rel diff |",
            "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in sorted(doc["extend"], key=lambda r: (r["prefix"], r["batch"] * r["new"], r["new"])):
            lines.append(
                f"| {r['prefix']} | {r['batch']} x {r['new']} | {r['batch'] * r['new']} | {r['small_ms']:.3f} "
                f"| {r['long_prefix_ms']:.3f} | {r['long_prefix_speedup']:.2f} "
                f"| {'128x64' if picks_long_prefix(r) else '64x32'} | {_split_cell(r, 'small', 'ms', '.3f')} "
                f"| {_split_cell(r, 'long_prefix', 'ms', '.3f')} | {r['rel_diff']:.1e} |"
            )
    if doc.get("extend_graph"):
        lines += [
            "",
            "## Extend graphs: the two tile choices replayed",
            "",
            "One request of a cache hit's new tokens (or, where new says 4 x, four requests') in an extend"
            " graph of that many tokens (padding included) and 32 request rows, replayed; a graph captured"
            " over an unknown prefix takes 64x32, and the worker also captures 128x64 and 64x32 split, each"
            " replayed by the step's longest prefix (kernels.extend_attention.graph_variant). The split columns: each with the prefix split such a graph would take"
            " (its cap from the graph's tokens alone; the most parts in brackets). The one-row columns: 64x32"
            " unsplit and split over the request's row alone, without the 31 empty rows' programs. The packed"
            " columns: the same over all 32 rows with the packed grid (ExtendConfig.packed_blocks: programs for"
            " the query blocks that exist).",
            "",
            "| prefix | new | graph tokens | 64x32 us | 128x64 us | 128x64 speedup | 64x32 split us "
            "| 128x64 split us | one row: 64x32 us | split us | packed: 64x32 us | split us | rel diff "
            "| replayed: x fastest |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        slower = []
        for r in doc["extend_graph"]:
            variant, over = replayed_over_fastest(r)
            if over > 1.0 + VARIANT_SLACK:
                slower.append(f"{r['prefix']} + {_new_cell(r)} ({variant} {over:.2f}x)")
            lines.append(
                f"| {r['prefix']} | {_new_cell(r)} | {r['size']} | {r['small_us']:.1f} | {r['long_prefix_us']:.1f} "
                f"| {r['long_prefix_speedup']:.2f} | {_split_cell(r, 'small', 'us', '.1f')} "
                f"| {_split_cell(r, 'long_prefix', 'us', '.1f')} | {_fmt(r.get('small_one_row_us'))} "
                f"| {_fmt(r.get('small_split_one_row_us'))} | {_fmt(r.get('small_packed_us'))} "
                f"| {_fmt(r.get('small_split_packed_us'))} | {r['rel_diff']:.1e} | {variant} {over:.2f} |"
            )
        lines += [
            "",
            f"The capture graph_variant replays is within {VARIANT_SLACK:.0%} of the fastest of the three on "
            + ("every row." if not slower else f"all rows but {len(slower)}: {'; '.join(slower)}."),
        ]
    if doc.get("decode"):
        lines += [
            "",
            "## Decode: batch 1 over fixed split counts",
            "",
            "CUDA-graph replays of one call (split and merge kernels); * marks the default split count;"
            " prefetch: a split kernel that loads the next tile's K/V into registers before it computes each"
            " tile (64-token tiles, 4 warps, no Triton pipelining).",
            "",
            "| context | splits | us | GB/s | PDL us | PDL GB/s | prefetch us | prefetch GB/s "
            "| prefetch + PDL us | GB/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def cells(r: dict | None) -> str:  # a variant the run did not measure shows as -
            return f"{r['us']:.1f} | {r['gbs']:,.0f}" if r else "- | -"

        variants: dict[tuple[bool, bool], dict] = {}  # (pdl, prefetch) -> (context, splits, default) -> row
        for r in doc["decode"]:
            variants.setdefault((r["pdl"], r.get("prefetch", False)), {})[
                r["context"], r["splits"], r["default"]
            ] = r
        for key, r in variants.get((False, False), {}).items():
            others = " | ".join(
                cells(variants.get(v, {}).get(key)) for v in ((True, False), (False, True), (True, True))
            )
            lines.append(
                f"| {r['context']} | {r['splits']}{'*' if r['default'] else ''} | {cells(r)} | {others} |"
            )
    if doc.get("decode_tiles"):
        lines += _decode_tiles_report(doc)
    return "\n".join(lines) + "\n"


def _decode_tiles_report(doc: dict) -> list[str]:
    """The decode_tiles table, the tiles' residency on the sweep's GPU where recorded, and what
    decode_tile_rule says to change."""
    rows, copy = doc["decode_tiles"], doc.get("copy_gbs")
    labels = list(dict.fromkeys(label for r in rows for label in r["us"]))
    resident = decode_residency(doc)
    sms = doc["device"]["sm_count"]
    has_waves = all(r["default"] in resident for r in rows)  # every row's default tiles' residency known
    hkv = doc["model"]["num_kv_heads"]
    lines = [
        "",
        "## Decode: tile choices over batch x context",
        "",
        "CUDA-graph replays of one call at each configuration's default split count; columns: tokens a"
        " tile / warps / pipeline stages, in GB/s (* the default's); best: the fastest and its speedup"
        " over the default" + (", and its share of the copy bandwidth" if copy else "") + "; then the"
        " default tiles' time at its own split cap and at others (split cap: us)"
        + ("; waves: the default's programs (requests x KV heads x split cap) over the blocks resident at"
           " once on the GPU" if has_waves else "") + ".",
        "",
        "| batch | context | "
        + " | ".join(f"{x} GB/s" for x in labels)
        + " | best | speedup |"
        + (" of copy bw |" if copy else "")
        + " default tiles at other split caps: us |"
        + (" waves |" if has_waves else ""),
        "|---:|---:|" + "---:|" * len(labels) + "---|---:|" + ("---:|" if copy else "") + "---|"
        + ("---:|" if has_waves else ""),
    ]  # fmt: skip
    for r in rows:
        best = min(r["us"], key=r["us"].get)
        cells = " | ".join(
            f"{r['gbs'][x]:,.0f}{'*' if x == r['default'] else ''}" if x in r["gbs"] else "-" for x in labels
        )
        share = f" {r['gbs'][best] / copy:.0%} |" if copy else ""
        caps = ", ".join(f"{c}: {us:.1f}" for c, us in sorted(_caps_us(r).items()))
        waves = ""
        if has_waves:
            programs = r["batch"] * hkv * r["splits"][r["default"]]
            waves = f" {programs / (sms * resident[r['default']]):.2f} |"
        lines.append(
            f"| {r['batch']} | {r['context']} | {cells} | {best} | {r['us'][r['default']] / r['us'][best]:.2f} |"
            + share
            + f" {caps} |"
            + waves
        )
    if resident:
        lines += ["", "Resident blocks an SM (the split kernel as loaded here): "
                  + ", ".join(f"{label} {n}" for label, n in resident.items()) + "."]  # fmt: skip
    rule = decode_tile_rule(rows, sms, resident, hkv)
    if rule["change"] == "split_cap":
        said = "cap the split count at one wave of resident programs: " + ", ".join(
            f"{b} x {c}: {old} -> {new}" for b, c, old, new in rule["rows"]
        )
    elif rule["change"] == "tile":
        said = (
            f"take {rule['tile']} from {rule['from_batch']} requests ({rule['gain']:.2f}x the default there)"
        )
    else:
        said = f"no change: {rule['why']}"
    return [*lines, "", f"Rule (kernels.sweep.decode_tile_rule): {said}."]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                    help=f"sweeps to run, in the order given, of {' '.join(KINDS)} (default all)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default docs/benchmarks/kernels-sweep-<gpu>.json)")  # fmt: skip
    ap.add_argument("--markdown", type=Path, default=None, help="report path (default: the JSON's, .md)")
    bench.add_model_args(ap)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = bench.start_gpu_run("kernels.sweep", args)
    if run is None:
        return 2
    from kernels import decode_attention as dec

    device, gpu, model, gen = run.device, run.gpu, run.model, run.gen
    started = time.time()
    doc = bench.run_record(
        run,
        " ".join(["python -m kernels.sweep", *argv]),
        "kernels.timing median, L2 evicted by a read before each run; extend: eager calls; "
        "extend_graph and decode: CUDA-graph replays",
        arch=dec.device_arch(device),
    )
    doc |= {kind: [] for kind in KINDS}

    def long_prefix_speedup(r: dict) -> str:
        return f"128x64 {r['long_prefix_speedup']:.2f}x as fast as 64x32"

    sweeps = {  # kind: (shapes, the sweep of one shape, what it prints)
        "extend": (EXTEND_SHAPES, sweep_extend, long_prefix_speedup),
        "extend_graph": (GRAPH_SHAPES, sweep_extend_graph, long_prefix_speedup),
        "decode": ([(c,) for c in DECODE_CONTEXTS], sweep_decode, lambda rows: "done"),
        "decode_tiles": (DECODE_TILE_SHAPES, sweep_decode_tiles,
                         lambda r: "fastest " + min(r["us"], key=r["us"].get)),
    }  # fmt: skip
    try:
        for kind in dict.fromkeys(args.only):  # NOTE: in the order asked (a deadline may cut the last)
            shapes, sweep_one, said = sweeps[kind]
            for shape in shapes:
                r = sweep_one(*shape, model, device, gen)
                doc[kind] += r if isinstance(r, list) else [r]
                torch.cuda.empty_cache()
                print(f"{kind} {shape}: {said(r)}", file=sys.stderr)
        if "decode" in args.only or "decode_tiles" in args.only:
            doc["copy_gbs"] = bench.measure_copy_gbs(device)
    except KeyboardInterrupt:  # NOTE: gpu-bench's deadline: keep the rows measured so far
        doc["interrupted"] = True
        print("interrupted: writing the rows measured so far", file=sys.stderr)
    compile_check.record_loaded_kernels(doc)  # registers and shared memory: the decode tiles' residency
    doc["wall_s"] = round(time.time() - started, 1)
    out = args.out or Path("docs/benchmarks") / f"kernels-sweep-{bench.gpu_slug(gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    report = args.markdown or out.with_suffix(".md")
    report.write_text(markdown(doc))
    print(f"wrote {out} and {report}")
    print(markdown(doc))
    return 1 if doc.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
