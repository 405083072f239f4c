"""`python -m kernels.bench_fp8_linear`: the fp8 linear layer (kernels/fp8_linear.py) on a GPU against
cuBLAS on the same weight dequantized to bf16 (torch F.linear: what the worker runs when it dequantizes an
fp8 checkpoint at load); JSON to --out, a markdown report beside it (same stem, .md), the tables (16-bit
then fp8 activations) printed last.

Shapes are Llama-3-8B's dense projections (qkv, o, gate_up, down; the attention's from --q-heads,
--kv-heads and --head-dim, the MLP's from --intermediate), random e4m3 weights in 128 x 128 blocks of
float32 scales (Qwen3's and DeepSeek's fp8 releases), over calls of 1 to 2,048 rows (decode steps to a
prefill chunk). Each row: the baseline, the kernel's default tiles, every candidate (kernels.fp8_linear.
CANDIDATES) and the default with one scale a row (llm-compressor's FP8-dynamic); then the same with the
activations quantized per token group and multiplied fp8 by fp8 (W8A8, `fp8_activations`: the
quantization kernel included in each time; the candidates on prefill rows only), beside cuBLAS's fp8 GEMM
(torch._scaled_mm, one scale a row of each operand) on the same quantized activations, and the per-row
W8A8 with one static input scale (a checkpoint's, --fp8-activations static) quantizing x first or inside. Each is replayed in
a CUDA graph after the output its replay wrote was checked against kernels.reference.fp8_linear (a failed
check marks the row). Needs CUDA: without it, it measures nothing and exits 2. Numbers are never estimated.
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
from kernels.bench_report import times as _times

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


def cublas_fp8(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """cuBLAS's fp8 GEMM (torch._scaled_mm) on x quantized per token (kernels.fp8_linear's kernel) by the
    weight with one scale a row: what the per-row W8A8 variant computes."""
    codes, scales = fp8_linear.quantize_fp8_groups(x, x.shape[-1])
    return torch._scaled_mm(codes, w.fp8.t(), scale_a=scales, scale_b=w.row_scale.reshape(1, -1),
                            out_dtype=x.dtype)  # fmt: skip


def bench_row(proj: Projection, rows: int, w: Fp8Weight, gen: torch.Generator) -> dict[str, Any]:
    """One (projection, rows) row: each variant's and candidate's time (us), weight GB/s and TF/s, its
    error against the reference; the variants and candidates whose check failed in row["wrong"] (never
    the best candidate), a candidate's or cuBLAS fp8's compile or launch failure in row["candidate_errors"]
    (its time None)."""
    x = torch.randn(rows, proj.k, generator=gen).to(w.fp8.device, w.dense.dtype)
    by_blocks = reference.fp8_linear(x, w.fp8, w.block_scale, BLOCK)
    by_rows = reference.fp8_linear(x, w.fp8, w.row_scale)
    w8a8_blocks = reference.fp8_linear(x, w.fp8, w.block_scale, BLOCK, fp8_activations=True)
    w8a8_rows = reference.fp8_linear(x, w.fp8, w.row_scale, fp8_activations=True)
    static = (x.float().abs().amax() / 448).reshape(1)  # NOTE: a calibration's scale: x's largest unclipped
    w8a8_static = reference.fp8_linear(x, w.fp8, w.row_scale, fp8_activations=True, input_scale=static)
    nk = proj.n * proj.k
    block_bytes = nk + w.block_scale.numel() * w.block_scale.element_size()
    row_bytes = nk + w.row_scale.numel() * w.row_scale.element_size()
    flops = 2 * rows * nk
    default = fp8_linear.default_config(rows)
    row: dict[str, Any] = {
        "shape": proj.name,
        "n": proj.n,
        "k": proj.k,
        "rows": rows,
        "default": _label(default),
        "flops": flops,
        "rel_err": {},
        "candidates_us": {},
        "w8a8_candidates_us": {},
        "candidate_errors": {},
    }

    def call(scale: torch.Tensor, block: tuple[int, int] | None = None, **options: Any) -> Callable:
        """The fp8 linear layer over this row's x and weight (``options``: fp8_linear's)."""
        return lambda: fp8_linear.fp8_linear(x, w.fp8, scale, block, **options)

    variants = {  # name: (the call, the reference output it must match, the weight bytes it reads)
        "bf16": (lambda: F.linear(x, w.dense), by_blocks, nk * w.dense.element_size()),
        "fp8": (call(w.block_scale, BLOCK), by_blocks, block_bytes),
        "fp8_per_row": (call(w.row_scale), by_rows, row_bytes),
        "w8a8": (call(w.block_scale, BLOCK, fp8_activations=True), w8a8_blocks, block_bytes),
        "w8a8_per_row": (call(w.row_scale, fp8_activations=True), w8a8_rows, row_bytes),
        "cublas_fp8": (lambda: cublas_fp8(x, w), w8a8_rows, row_bytes),
        # x quantized inside the product (the default for decode steps) and by its own kernel first (prefills')
        "w8a8_fused": (call(w.block_scale, BLOCK, fp8_activations=True, fuse_quantization=True), w8a8_blocks,
                       block_bytes),
        "w8a8_separate": (call(w.block_scale, BLOCK, fp8_activations=True, fuse_quantization=False),
                          w8a8_blocks, block_bytes),
        # one static input scale (per-row weights): quantized where the default puts it, and inside at any rows
        "w8a8_static": (call(w.row_scale, fp8_activations=True, input_scale=static), w8a8_static, row_bytes),
        "w8a8_static_fused": (call(w.row_scale, fp8_activations=True, input_scale=static, fuse_quantization=True),
                              w8a8_static, row_bytes),
    }  # fmt: skip
    for name, (timed, want, weight_bytes) in variants.items():
        row[f"{name}_weight_bytes"] = weight_bytes
        try:
            got, us = replayed(timed)
        except Exception as exc:  # NOTE: cuBLAS's fp8 GEMM refuses some shapes; ours must not
            if name != "cublas_fp8":
                raise
            row[f"{name}_us"] = row[f"{name}_gbs"] = row[f"{name}_tflops"] = None
            row["candidate_errors"][name] = bench.failure(exc)
            continue
        row["rel_err"][name] = bench._rel_err(got, want)
        row[f"{name}_us"] = us
        row[f"{name}_gbs"] = weight_bytes / (us * 1e-6) / 1e9
        row[f"{name}_tflops"] = flops / (us * 1e-6) / 1e12
    row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
    row["w8a8_speedup"] = row["bf16_us"] / row["w8a8_us"]
    row["w8a8_vs_fp8"] = row["fp8_us"] / row["w8a8_us"]
    row["static_vs_dynamic"] = row["w8a8_per_row_us"] / row["w8a8_static_us"]
    w8a8_default = fp8_linear.default_config(rows, fp8_activations=True)
    row["w8a8_default"] = _label(w8a8_default)
    for label, cfg in fp8_linear.CANDIDATES.items():
        by_cfg = call(w.block_scale, BLOCK, config=cfg)
        time_candidate(row, "candidates_us", label, cfg, default, "fp8", by_cfg, by_blocks)
        if rows >= PREFILL_ROWS:  # NOTE: W8A8 pays where the tensor cores are the cost
            by_cfg = call(w.block_scale, BLOCK, config=cfg, fp8_activations=True)
            time_candidate(row, "w8a8_candidates_us", label, cfg, w8a8_default, "w8a8", by_cfg, w8a8_blocks)
    row["wrong"] = [name for name, err in row["rel_err"].items() if bench_report.inaccurate(err)]
    for prefix, times, base in (("", "candidates_us", "fp8_us"), ("w8a8_", "w8a8_candidates_us", "w8a8_us")):
        usable = {
            label: us
            for label, us in row[times].items()
            if us is not None and f"{prefix}{label}" not in row["wrong"]
        }
        best = min(usable, key=usable.__getitem__, default=None)
        row[f"{prefix}best_candidate"] = best
        row[f"{prefix}best_speedup"] = row[base] / usable[best] if best else None
    return row


def _label(cfg: fp8_linear.Fp8LinearConfig) -> str:
    """A configuration's name in fp8_linear.CANDIDATES (its fields where it has none)."""
    return next((label for label, c in fp8_linear.CANDIDATES.items() if c == cfg), str(cfg))


def time_candidate(
    row: dict, times: str, label: str, cfg: fp8_linear.Fp8LinearConfig, default: fp8_linear.Fp8LinearConfig,
    variant: str, call: Callable[[], torch.Tensor], want: torch.Tensor,
) -> None:  # fmt: skip
    """One candidate's time into row[times][label] and its error into row["rel_err"] (its W8A8 form's under
    "w8a8_<label>"); the default's own tiles take ``variant``'s time, not a second (noisier) one; a compile,
    launch or capture error is recorded and the run goes on."""
    key = label if variant == "fp8" else f"{variant}_{label}"
    if cfg == default:
        row[times][label], row["rel_err"][key] = row[f"{variant}_us"], row["rel_err"][variant]
        return
    try:
        got, row[times][label] = replayed(call)
        row["rel_err"][key] = bench._rel_err(got, want)
    except Exception as exc:
        row[times][label] = None
        row["candidate_errors"][key] = bench.failure(exc)


def regime_candidate(rows: list[dict], min_gain: float = MIN_GAIN, variant: str = "fp8") -> str | None:
    """The candidate at least ``min_gain`` x as fast as the default on every one of ``rows``, its output
    right on each; of several, the one whose least gain is largest. None without rows or such a candidate.
    ``variant``: "fp8" (16-bit activations) or "w8a8" (its candidates' times and errors)."""
    times_key, prefix = ("candidates_us", "") if variant == "fp8" else ("w8a8_candidates_us", "w8a8_")
    least: dict[str, float] = {}
    for label in rows[0][times_key] if rows else ():
        times = [r[times_key].get(label) for r in rows]
        if all(t is not None for t in times) and not any(prefix + label in r["wrong"] for r in rows):
            least[label] = min(r[f"{variant}_us"] / t for r, t in zip(rows, times, strict=True))
    best = max(least, key=least.__getitem__, default=None)
    return best if best is not None and least[best] >= min_gain else None


def _geomean(values: list[float]) -> float | None:
    return statistics.geometric_mean(values) if values else None


def summarize(rows: list[dict]) -> dict[str, Any]:
    """The fp8 default (16-bit and fp8 activations) against bf16 cuBLAS by regime (decode: its least
    speed-up; prefill: the geometric mean), W8A8 against the 16-bit-activation default, the static input
    scale against the per-row dynamic W8A8 (and on prefills quantizing inside against first: above 1, inside
    is faster), cuBLAS's fp8 GEMM against the per-row W8A8 (its speed-up: above 1, cuBLAS is faster), each
    regime's candidate (regime_candidate), and the rows with a failed check."""
    decode = [r for r in rows if r["rows"] <= fp8_linear.DECODE_ROWS]
    prefill = [r for r in rows if r["rows"] >= PREFILL_ROWS]
    return {
        "fp8_speedup_min_decode": min((r["fp8_speedup"] for r in decode), default=None),
        "fp8_speedup_geomean_prefill": _geomean([r["fp8_speedup"] for r in prefill]),
        "w8a8_speedup_min_decode": min((r["w8a8_speedup"] for r in decode), default=None),
        "w8a8_speedup_geomean_prefill": _geomean([r["w8a8_speedup"] for r in prefill]),
        "w8a8_vs_fp8_min_decode": min((r["w8a8_vs_fp8"] for r in decode), default=None),
        "w8a8_vs_fp8_geomean_prefill": _geomean([r["w8a8_vs_fp8"] for r in prefill]),
        "static_vs_dynamic_min_decode": min((r["static_vs_dynamic"] for r in decode), default=None),
        "static_vs_dynamic_geomean_prefill": _geomean([r["static_vs_dynamic"] for r in prefill]),
        "static_inside_vs_first_min_prefill": min(
            (r["w8a8_static_us"] / r["w8a8_static_fused_us"] for r in prefill), default=None
        ),
        "cublas_fp8_vs_w8a8_per_row_geomean_prefill": _geomean(
            [r["w8a8_per_row_us"] / r["cublas_fp8_us"] for r in prefill if r["cublas_fp8_us"]]
        ),
        "best_candidate_per_regime": {
            "decode": regime_candidate(decode),
            "prefill": regime_candidate(prefill),
            "prefill_w8a8": regime_candidate(prefill, variant="w8a8"),
        },
        "inaccurate": [
            f"{r['shape']} x {r['rows']} rows: {', '.join(r['wrong'])}" for r in rows if r["wrong"]
        ],
    }


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


def w8a8_table(result: dict) -> str:
    """The rows with fp8 activations as a markdown table: the default block-scaled W8A8 (the activations'
    quantization included; x quantized inside the product and by its own kernel first), the per-row one,
    cuBLAS's fp8 GEMM, against bf16 cuBLAS and the 16-bit-activation default."""
    lines = [
        "| proj | rows | bf16 cuBLAS us | fp8 us | W8A8 us | x quantized inside us | x quantized first us | "
        "W8A8 per-row us | W8A8 static us | static inside us | cuBLAS fp8 per-row us | W8A8 TF/s | "
        "W8A8 vs bf16 | W8A8 vs fp8 | best W8A8 candidate | its gain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['rows']} | {r['bf16_us']:.1f} | {r['fp8_us']:.1f} | {r['w8a8_us']:.1f} | "
            f"{r['w8a8_fused_us']:.1f} | {r['w8a8_separate_us']:.1f} | {r['w8a8_per_row_us']:.1f} | "
            f"{r['w8a8_static_us']:.1f} | {r['w8a8_static_fused_us']:.1f} | "
            f"{bench_report._fmt(r['cublas_fp8_us'], '.1f')} | "
            f"{r['w8a8_tflops']:.1f} | {_times(r['w8a8_speedup'])} | {_times(r['w8a8_vs_fp8'])} | "
            f"{r['w8a8_best_candidate'] or '-'} | {_times(r['w8a8_best_speedup'])} |"
        )
    return "\n".join(lines)


def candidates_table(rows: list[dict], variant: str = "fp8") -> list[str]:
    """Markdown lines: every candidate's time on every row that timed them (``variant`` "w8a8": their fp8
    activation form); none without such rows."""
    times, prefix = ("candidates_us", "") if variant == "fp8" else ("w8a8_candidates_us", "w8a8_")
    rows = [r for r in rows if r[times]]
    if not rows:
        return []
    labels = list(rows[0][times])
    what = "16-bit activations" if variant == "fp8" else "fp8 activations, prefill rows"
    lines = [
        "",
        f"Candidate tiles (kernels.fp8_linear.CANDIDATES), {what}, us; the default's in bold, the fastest "
        "marked *, a failed check !:",
        "",
        "| proj | rows | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for r in rows:
        cells = []
        for label in labels:
            cell = bench_report._fmt(r[times][label], ".1f")
            cell += "*" if label == r[f"{prefix}best_candidate"] else ""
            cell += "!" if prefix + label in r["wrong"] else ""
            cells.append(f"**{cell}**" if label == r[f"{prefix}default"] else cell)
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
        "With fp8 activations (W8A8: each row's activations quantized per 128-column group, or per row for "
        "the per-row weights, by kernels.fp8_linear's kernel, inside every time):",
        "",
        w8a8_table(result),
        *candidates_table(result["rows"], "w8a8"),
        "",
        f"fp8 default against bf16 cuBLAS: least {_times(s['fp8_speedup_min_decode'])} at decode "
        f"(<= {fp8_linear.DECODE_ROWS} rows), geometric mean {_times(s['fp8_speedup_geomean_prefill'])} at "
        f"prefill (>= {PREFILL_ROWS} rows). A candidate {MIN_GAIN:.2f}x as fast as the default on every row "
        f"of its regime: decode {regimes['decode'] or 'none'}, prefill {regimes['prefill'] or 'none'}.",
        "",
        "fp8 activations (W8A8) against bf16 cuBLAS: least "
        f"{_times(s['w8a8_speedup_min_decode'])} at decode, geometric mean "
        f"{_times(s['w8a8_speedup_geomean_prefill'])} at prefill; against the 16-bit-activation default: "
        f"least {_times(s['w8a8_vs_fp8_min_decode'])} at decode, geometric mean "
        f"{_times(s['w8a8_vs_fp8_geomean_prefill'])} at prefill. cuBLAS's fp8 GEMM against the per-row "
        f"W8A8 at prefill: {_times(s['cublas_fp8_vs_w8a8_per_row_geomean_prefill'])} (above 1x: cuBLAS "
        "faster). "
        f"A W8A8 candidate {MIN_GAIN:.2f}x as fast as its default on every prefill row: "
        f"{regimes['prefill_w8a8'] or 'none'}.",
        "",
        "A static input scale against per-token scales (per-row weights): least "
        f"{_times(s['static_vs_dynamic_min_decode'])} at decode, geometric mean "
        f"{_times(s['static_vs_dynamic_geomean_prefill'])} at prefill; quantizing x inside the product against "
        f"first at prefill: least {_times(s['static_inside_vs_first_min_prefill'])} (above 1x: inside faster).",
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
    print()
    print(w8a8_table(result))
    return 130 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
