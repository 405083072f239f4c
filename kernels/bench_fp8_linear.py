"""`python -m kernels.bench_fp8_linear`: the fp8 linear layer (kernels/fp8_linear.py) on a GPU against
cuBLAS on the same weight dequantized to bf16 (torch F.linear: what the worker runs when it dequantizes an
fp8 checkpoint at load); JSON to --out, a markdown report beside it (same stem, .md), a table printed last.

Shapes are Llama-3-8B's dense projections (qkv, o, gate_up, down; the attention's from --q-heads,
--kv-heads and --head-dim, the MLP's from --intermediate), random e4m3 weights in 128 x 128 blocks of
float32 scales (Qwen3's and DeepSeek's fp8 releases), over calls of 1 to 2,048 rows (decode steps to a
prefill chunk). Each row: the baseline, the kernel's default tiles, every candidate (kernels.fp8_linear.
CANDIDATES) and the default with one scale a row (llm-compressor's FP8-dynamic), each replayed in a CUDA
graph after the output its replay wrote was checked against kernels.reference.fp8_linear (a failed check
marks the row). Needs CUDA: without it, it measures nothing and exits 2. Numbers are never estimated.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import bench, bench_report, fp8_linear, reference, timing

ROWS = (1, 16, 64, 256, 2048)  # tokens a call: decode steps of 1 and 16 requests up to a prefill chunk
QUICK_ROWS = (1, 16, 2048)
BLOCK = (128, 128)  # the weight's scale blocks (rows, columns)
# a call of this many rows or more is a prefill; of fp8_linear.DECODE_ROWS or fewer, a decode step
PREFILL_ROWS = 256
MIN_GAIN = 1.05  # a candidate replaces a regime's default only if this much faster on every row of it
TIMING = (
    "kernels.timing median of CUDA-graph replays (as the worker runs decode steps), L2 evicted by a read "
    "before each; every output checked, as the replay wrote it, against kernels.reference.fp8_linear first"
)


@dataclasses.dataclass(frozen=True)
class Projection:
    name: str
    n: int  # output columns
    k: int  # input columns


def projections(model: bench.Model, intermediate: int) -> list[Projection]:
    """A transformer layer's dense projections: the fused q/k/v, the attention output, the fused gate/up and
    the MLP's down projection."""
    hidden = model.num_q_heads * model.head_dim
    qkv = (model.num_q_heads + 2 * model.num_kv_heads) * model.head_dim
    return [
        Projection("qkv", qkv, hidden),
        Projection("o", hidden, hidden),
        Projection("gate_up", 2 * intermediate, hidden),
        Projection("down", hidden, intermediate),
    ]


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    fp8: torch.Tensor  # [N, K] float8_e4m3fn
    block_scale: torch.Tensor  # [ceil(N / 128), ceil(K / 128)] float32
    row_scale: torch.Tensor  # [N, 1] float32
    dense: torch.Tensor  # fp8 x block_scale in x's dtype: the baseline's weight


def fp8_weight(proj: Projection, dtype: torch.dtype, device: torch.device, seed: int) -> Fp8Weight:
    """Random e4m3 values (std 64 of at most 448) and scales spread over a factor of 4 around
    1 / (64 sqrt(K)), so the dequantized weight's std is near 1 / sqrt(K); generated on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(proj.n, proj.k, device=device, generator=gen).mul_(64).clamp_(-440, 440)

    def scales(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, device=device, generator=gen).mul_(2).sub_(1).exp2_() / (64 * proj.k**0.5)

    w = values.to(torch.float8_e4m3fn)
    del values
    block_scale = scales(-(-proj.n // BLOCK[0]), -(-proj.k // BLOCK[1]))
    dense = reference.dequantize_fp8_weight(w, block_scale, BLOCK, dtype)
    return Fp8Weight(w, block_scale, scales(proj.n, 1), dense)


def replayed(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """``call`` captured in a CUDA graph: the output a replay writes (poisoned with NaN before it, so an
    unwritten element shows) and the replay's median time, us."""
    result = {}
    graph = timing.capture(lambda: result.update(out=call()))
    result["out"].fill_(float("nan"))
    graph.replay()
    got = result["out"].clone()
    return got, timing.time_ms(graph.replay) * 1e3


def bench_row(proj: Projection, rows: int, w: Fp8Weight, gen: torch.Generator) -> dict[str, Any]:
    """One (projection, rows) row: each variant's and candidate's time (us), weight GB/s and TF/s, its
    error against the reference; the variants and candidates whose check failed in row["wrong"] (never
    the best candidate), a candidate's compile or launch failure in row["candidate_errors"]."""
    x = torch.randn(rows, proj.k, generator=gen).to(w.fp8.device, w.dense.dtype)
    by_blocks = reference.fp8_linear(x, w.fp8, w.block_scale, BLOCK)
    by_rows = reference.fp8_linear(x, w.fp8, w.row_scale)
    nk, scale_bytes = proj.n * proj.k, w.block_scale.numel() * w.block_scale.element_size()
    flops = 2 * rows * nk
    default = fp8_linear.default_config(rows)
    row: dict[str, Any] = {
        "shape": proj.name,
        "n": proj.n,
        "k": proj.k,
        "rows": rows,
        "default": next(
            (label for label, cfg in fp8_linear.CANDIDATES.items() if cfg == default), str(default)
        ),
        "flops": flops,
        "bf16_weight_bytes": nk * w.dense.element_size(),
        "fp8_weight_bytes": nk + scale_bytes,
        "fp8_per_row_weight_bytes": nk + w.row_scale.numel() * w.row_scale.element_size(),
        "rel_err": {},
        "candidates_us": {},
        "candidate_errors": {},
    }
    variants = {  # name: (the call, the reference output it must match)
        "bf16": (lambda: F.linear(x, w.dense), by_blocks),
        "fp8": (lambda: fp8_linear.fp8_linear(x, w.fp8, w.block_scale, BLOCK), by_blocks),
        "fp8_per_row": (lambda: fp8_linear.fp8_linear(x, w.fp8, w.row_scale), by_rows),
    }
    for name, (call, want) in variants.items():
        got, us = replayed(call)
        row["rel_err"][name] = bench._rel_err(got, want)
        row[f"{name}_us"] = us
        row[f"{name}_gbs"] = row[f"{name}_weight_bytes"] / (us * 1e-6) / 1e9
        row[f"{name}_tflops"] = flops / (us * 1e-6) / 1e12
    row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
    for label, cfg in fp8_linear.CANDIDATES.items():
        if cfg == default:  # NOTE: the default's own tiles: its time, not a second (noisier) one
            row["candidates_us"][label], row["rel_err"][label] = row["fp8_us"], row["rel_err"]["fp8"]
            continue
        try:
            got, row["candidates_us"][label] = replayed(
                lambda cfg=cfg: fp8_linear.fp8_linear(x, w.fp8, w.block_scale, BLOCK, config=cfg)
            )
            row["rel_err"][label] = bench._rel_err(got, by_blocks)
        except Exception as exc:  # a compile, launch or capture error of the candidate: the run goes on
            row["candidates_us"][label] = None
            row["candidate_errors"][label] = bench.failure(exc)
    row["wrong"] = [name for name, err in row["rel_err"].items() if bench_report.inaccurate(err)]
    usable = {
        label: us
        for label, us in row["candidates_us"].items()
        if us is not None and label not in row["wrong"]
    }
    row["best_candidate"] = min(usable, key=usable.__getitem__, default=None)
    row["best_speedup"] = row["fp8_us"] / usable[row["best_candidate"]] if usable else None
    return row


def regime_candidate(rows: list[dict], min_gain: float = MIN_GAIN) -> str | None:
    """The candidate at least ``min_gain`` x as fast as the default on every one of ``rows``, its output
    right on each; of several, the one whose least gain is largest. None without rows or such a candidate."""
    least: dict[str, float] = {}
    for label in rows[0]["candidates_us"] if rows else ():
        times = [r["candidates_us"].get(label) for r in rows]
        if all(t is not None for t in times) and not any(label in r["wrong"] for r in rows):
            least[label] = min(r["fp8_us"] / t for r, t in zip(rows, times, strict=True))
    best = max(least, key=least.__getitem__, default=None)
    return best if best is not None and least[best] >= min_gain else None


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The fp8 default against bf16 cuBLAS by regime (decode: its least speed-up; prefill: the geometric
    mean), each regime's candidate (regime_candidate), and the rows with a failed check."""
    decode = [r for r in rows if r["rows"] <= fp8_linear.DECODE_ROWS]
    prefill = [r for r in rows if r["rows"] >= PREFILL_ROWS]
    return {
        "fp8_speedup_min_decode": min((r["fp8_speedup"] for r in decode), default=None),
        "fp8_speedup_geomean_prefill": (
            statistics.geometric_mean(r["fp8_speedup"] for r in prefill) if prefill else None
        ),
        "best_candidate_per_regime": {
            "decode": regime_candidate(decode),
            "prefill": regime_candidate(prefill),
        },
        "inaccurate": [
            f"{r['shape']} x {r['rows']} rows: {', '.join(r['wrong'])}" for r in rows if r["wrong"]
        ],
    }


def _times(x: float | None) -> str:
    """'1.23x'; '-' when not measured."""
    return "-" if x is None else f"{x:.2f}x"


def format_table(result: dict) -> str:
    """The rows as a markdown table (the last thing the command prints)."""
    copy = result["device"]["copy_gbs"]
    lines = [
        "| proj | N x K | rows | bf16 cuBLAS us | fp8 us | fp8 per-row us | fp8 weight MB | fp8 GB/s | "
        "% of copy | bf16 GB/s | fp8 TF/s | bf16 TF/s | fp8 vs bf16 | best candidate | its gain | check |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in result["rows"]:
        check = "WRONG: " + ", ".join(r["wrong"]) if r["wrong"] else "ok"
        lines.append(
            f"| {r['shape']} | {r['n']} x {r['k']} | {r['rows']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | "
            f"{r['fp8_per_row_us']:.1f} | {r['fp8_weight_bytes'] / 1e6:.1f} | {r['fp8_gbs']:.0f} | "
            f"{100 * r['fp8_gbs'] / copy:.0f}% | {r['bf16_gbs']:.0f} | {r['fp8_tflops']:.1f} | "
            f"{r['bf16_tflops']:.1f} | {_times(r['fp8_speedup'])} | {r['best_candidate'] or '-'} | "
            f"{_times(r['best_speedup'])} | {check} |"
        )
    return "\n".join(lines)


def candidates_table(rows: list[dict]) -> list[str]:
    """Markdown lines: every candidate's time on every row; none without rows."""
    if not rows:
        return []
    labels = list(rows[0]["candidates_us"])
    lines = [
        "",
        "Candidate tiles (kernels.fp8_linear.CANDIDATES), us; the default's in bold, the fastest marked *, "
        "a failed check !:",
        "",
        "| proj | rows | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for r in rows:
        cells = []
        for label in labels:
            cell = bench_report._fmt(r["candidates_us"][label], ".1f")
            cell += ("*" if label == r["best_candidate"] else "") + ("!" if label in r["wrong"] else "")
            cells.append(f"**{cell}**" if label == r["default"] else cell)
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(cells) + " |")
    return lines


def format_markdown(result: dict) -> str:
    """The report: the table, the candidates' times, the summary, the command."""
    dev, s = result["device"], result["summary"]
    regimes = s["best_candidate_per_regime"]
    lines = [
        f"**fp8 linear (kernels/fp8_linear.py) on {dev['name']}** against bf16 cuBLAS on the dequantized "
        f"weight (copy {dev['copy_gbs']:.0f} GB/s, measured in this run); e4m3 weights in 128 x 128 blocks, "
        f"x {result['model']['dtype']}; GB/s: weight bytes read over the time (decode's rate)",
        "",
        format_table(result),
        *candidates_table(result["rows"]),
        "",
        f"fp8 default against bf16 cuBLAS: least {_times(s['fp8_speedup_min_decode'])} at decode "
        f"(<= {fp8_linear.DECODE_ROWS} rows), geometric mean {_times(s['fp8_speedup_geomean_prefill'])} at "
        f"prefill (>= {PREFILL_ROWS} rows). A candidate {MIN_GAIN:.2f}x as fast as the default on every row "
        f"of its regime: decode {regimes['decode'] or 'none'}, prefill {regimes['prefill'] or 'none'}.",
    ]
    if s["inaccurate"]:
        lines += ["", "Failed checks (relative error past kernels.bench_report.MAX_REL_ERR): "
                  + "; ".join(s["inaccurate"])]  # fmt: skip
    lines += ["", f"Command: `{result['command']}`. {result['timing']}", ""]
    if "interrupted" in result:
        lines.insert(1, f"\nInterrupted {result['interrupted']}: the rows measured before are below.")
    return "\n".join(lines)


def row_counts(text: str) -> list[int]:
    """'1,16,64' -> [1, 16, 64] (argparse type of --rows)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers expected, got {text!r}") from None
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"each row count must be at least 1, got {text!r}")
    return counts


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kernels.bench_fp8_linear", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/benchmarks/fp8-linear-<gpu>.json)"
    )
    ap.add_argument(
        "--rows", type=row_counts, default=None, help=f"rows a call (default {','.join(map(str, ROWS))})"
    )
    ap.add_argument("--quick", action="store_true", help=f"rows {','.join(map(str, QUICK_ROWS))} only")
    ap.add_argument(
        "--intermediate", type=int, default=14336, help="the MLP's width (Llama-3-8B's by default)"
    )
    bench.add_model_args(ap)
    args = ap.parse_args(argv)
    args.rows = args.rows or list(QUICK_ROWS if args.quick else ROWS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    run = bench.start_gpu_run("kernels.bench_fp8_linear", args)
    if run is None:
        return 2
    started = time.time()
    result = bench.run_record(
        run,
        " ".join(["python -m kernels.bench_fp8_linear", *argv]),
        TIMING,
        copy_gbs=bench.measure_copy_gbs(run.device),
    )
    result["intermediate"] = args.intermediate
    result["rows"] = []
    proj = None
    try:
        for proj in projections(run.model, args.intermediate):
            w = fp8_weight(proj, bench.DTYPES[args.dtype], run.device, args.seed)
            for rows in args.rows:
                result["rows"].append(row := bench_row(proj, rows, w, run.gen))
                print(f"{proj.name} {proj.n}x{proj.k} m={rows}: fp8 {row['fp8_us']:.1f} us, bf16 cuBLAS "
                      f"{row['bf16_us']:.1f} us, best {row['best_candidate']}", file=sys.stderr)  # fmt: skip
            del w
            torch.cuda.empty_cache()
    except KeyboardInterrupt:  # NOTE: gpu-bench's deadline: keep the rows measured so far
        result["interrupted"] = f"during {proj.name if proj else 'setup'}"
    result["summary"] = summarize(result["rows"])
    result["wall_s"] = round(time.time() - started, 1)
    out = args.out or Path("docs/benchmarks") / f"fp8-linear-{bench.gpu_slug(run.gpu)}.json"
    bench.write_result(result, out, format_markdown(result))
    print(format_table(result))
    return 130 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
