"""`python -m kernels.bench_moe`: the mixture-of-experts MLP (kernels/moe.py) on a GPU, against the experts
run one at a time by torch (as transformers' eager MoE blocks run them) and against the GPU's own measured
copy bandwidth and matmul rate, in one run; JSON to --out, a markdown report beside it (same stem, .md), a
table printed last.

Shapes are real models' (random weights): Qwen3-30B-A3B (128 experts of 768, 8 a token, hidden 2048) and
Mixtral-8x7B (8 of 14336, 2 a token, hidden 4096) in bf16, gpt-oss-20b (32 of 2880, 4 a token, hidden
2880) in MXFP4 as released (its biases and clamped activation left out: the rows time the GEMMs) and
Qwen3-30B-A3B's experts in fp8 as its FP8 release keeps them (e4m3, a float32 scale a 128 x 128 block);
beside quantized experts, the same experts dequantized to bf16. Over batches of 1 to 4,096 tokens with the
router's choice drawn at random (uniform logits: every expert about equally likely). For each row: the
kernel replayed in a CUDA graph (as a decode step runs it) and called eagerly (as a prefill runs it), the
torch loop, the bytes of the expert weights the batch touches over the copy bandwidth (the floor a
decode step's MLP cannot beat) and its FLOPs over the matmul rate; each candidate tile configuration
(kernels.moe.CANDIDATES) replayed too, from which the defaults' rule is set; fp8 experts also with fp8
activations (each GEMM's input quantized per token group, fp8 by fp8: --fp8-activations dynamic); the
summary holds each quantized format's least speed-up over its experts dequantized at decode, and fp8
activations' least over 16-bit ones at decode and at prefill; MXFP4 experts are also timed at each step
depth of MXFP4_STEPS (each checked against the reference), the summary holding each depth's least speed-up
over the default's at decode and at prefill. Needs CUDA: without it, it
measures nothing and exits 2. Numbers are never estimated.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import reference, timing
from kernels.bench_report import times as _times

TOKENS = (1, 16, 64, 256, 1024, 4096)
DECODE_TOKENS = 64  # a batch of at most this many tokens is a decode step (the summary's rule)
FP8_BLOCK = (128, 128)  # an fp8 expert's scale blocks (rows, columns), as Qwen3's FP8 releases have them
# the step depths (block_k) MXFP4 experts are timed at, on the default's other tiles: 32 (one block of scales
# a step, applied to its product; the default) and the deeper steps that decode each value with its scale
MXFP4_STEPS = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A format experts are kept in, timed beside the same experts dequantized to bf16."""

    speedup: str  # the row's field: the dequantized experts' replay time over the stored ones'
    stored: str  # the report's column for the experts as stored
    title: str  # the report's words for them
    dequantize: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]  # (w, scales, dtype)
    options: dict  # fused_moe's keywords beside the scales


FORMATS = {
    "mxfp4": Quantized(
        "packed_speedup", "packed", "MXFP4 experts packed (decoded in the GEMMs)",
        reference.dequantize_mxfp4, {},
    ),
    "fp8": Quantized(
        "fp8_speedup", "fp8", "fp8 experts (e4m3 in 128 x 128 blocks of scales, widened in the GEMMs)",
        lambda w, scales, dtype: reference.dequantize_fp8_weight(w, scales, FP8_BLOCK, dtype),
        {"fp8_block": FP8_BLOCK},
    ),
}  # fmt: skip


def fp8_scale_blocks(n: int, k: int) -> tuple[int, int]:
    """An fp8 [N, K] weight's FP8_BLOCK blocks down and across (the last of each may be partial)."""
    return -(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])


@dataclasses.dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int  # one expert's intermediate units
    quant: str | None = None  # the experts as stored: None (x's dtype) or a FORMATS key

    @property
    def dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """One expert's w13 and w2, each [N, K]."""
        return (2 * self.inter, self.hidden), (self.hidden, self.inter)

    def expert_bytes(self, elem_bytes: int = 2) -> int:
        """One expert's weights: gate, up and down (with their scales when quantized)."""
        weights = 3 * self.hidden * self.inter
        if self.quant == "mxfp4":  # half a byte a code and a byte a scale of 32
            return weights * 17 // 32
        if self.quant == "fp8":  # a byte a weight and 4 a block's scale
            return weights + 4 * sum(math.prod(fp8_scale_blocks(n, k)) for n, k in self.dims)
        return weights * elem_bytes


MODELS = {
    "qwen3-30b-a3b": MoeShape(experts=128, top_k=8, hidden=2048, inter=768),
    "mixtral-8x7b": MoeShape(experts=8, top_k=2, hidden=4096, inter=14336),
    "gpt-oss-20b": MoeShape(experts=32, top_k=4, hidden=2880, inter=2880, quant="mxfp4"),
    "qwen3-30b-a3b-fp8": MoeShape(experts=128, top_k=8, hidden=2048, inter=768, quant="fp8"),
}


def torch_per_expert(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The experts one at a time in x's dtype, each over the tokens that chose it (a host sync for the
    experts chosen and one per expert for its tokens)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tokens, choice = (ids == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * weights[tokens, choice, None])
    return out.to(x.dtype)


def inputs(
    shape: MoeShape, tokens: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> tuple:
    """x [tokens, H] and the router's choice for it (uniform random logits)."""
    x = torch.randn(tokens, shape.hidden, generator=gen).to(device, dtype)
    logits = torch.randn(tokens, shape.experts, generator=gen).to(device)
    weights, ids = reference.moe_route(logits, shape.top_k, renormalize=True)
    return x, weights, ids


def expert_weights(shape: MoeShape, dtype: torch.dtype, device: torch.device, seed: int) -> tuple:
    """w13 [E, 2I, H] and w2 [E, H, I], std 1/sqrt(fan-in), generated on the device; for a quantized shape
    (w13, w2, w13_scales, w2_scales): random codes, their scales giving an rms near 1/sqrt(fan-in). MXFP4:
    uint8 codes [E, N, K/2] and uint8 scales [E, N, K/32]; fp8: e4m3 values of std 64 (of at most 448)
    [E, N, K] and float32 scales [E, N/128, K/128] spread over a factor of 4 around 1 / (64 sqrt(K)), as
    kernels.bench_fp8_linear's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e, dims = shape.experts, shape.dims
    if shape.quant == "mxfp4":
        codes = [torch.empty(e, rows, cols // 2, device=device, dtype=torch.uint8) for rows, cols in dims]
        for c in codes:
            c.random_(0, 256, generator=gen)
        scales = [torch.full((e, rows, cols // 32), 127 + round(-math.log2(2.93 * cols**0.5)), device=device,
                             dtype=torch.uint8) for rows, cols in dims]  # fmt: skip
        return (*codes, *scales)
    if shape.quant == "fp8":
        codes = [torch.randn(e, rows, cols, device=device, generator=gen).mul_(64).clamp_(-440, 440)
                 .to(torch.float8_e4m3fn) for rows, cols in dims]  # fmt: skip
        scales = [torch.rand(e, *fp8_scale_blocks(rows, cols), device=device, generator=gen).mul_(2).sub_(1)
                  .exp2_().div_(64 * cols**0.5) for rows, cols in dims]  # fmt: skip
        return (*codes, *scales)
    w13 = torch.empty(shape.experts, 2 * shape.inter, shape.hidden, device=device, dtype=dtype)
    w2 = torch.empty(shape.experts, shape.hidden, shape.inter, device=device, dtype=dtype)
    w13.normal_(0.0, shape.hidden**-0.5, generator=gen)
    w2.normal_(0.0, shape.inter**-0.5, generator=gen)
    return w13, w2


def bench_row(
    name: str, shape: MoeShape, tokens: int, weights13: tuple, rates: dict, gen: torch.Generator,
    candidates: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One (model, tokens) row: times in ms, the floors, and the kernel's error against the reference;
    with ``candidates`` each of kernels.moe.CANDIDATES replayed too (the default's tiles are one of them)."""
    from kernels import moe

    w13, w2, *scales = weights13
    quantized = FORMATS[shape.quant] if shape.quant else None
    options = {"w13_scales": scales[0], "w2_scales": scales[1], **quantized.options} if quantized else {}
    dtype = torch.bfloat16 if quantized else w13.dtype
    x, weights, ids = inputs(shape, tokens, dtype, w13.device, gen)
    got, want = (
        moe.fused_moe(x, w13, w2, weights, ids, **options).float(),
        reference.fused_moe(x, w13, w2, weights, ids, **options).float(),
    )
    # NOTE: the torch loop (and, for quantized experts, the kernel beside it) on the experts in x's dtype
    dense = (
        [quantized.dequantize(w, s, dtype) for w, s in zip((w13, w2), scales, strict=True)]
        if quantized
        else [w13, w2]
    )
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    touched = int(torch.unique(ids).numel())  # experts whose weights the batch reads
    nbytes = touched * shape.expert_bytes(x.element_size()) + 2 * x.numel() * x.element_size()
    flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.inter
    row = {
        "model": name,
        "tokens": tokens,
        "experts_touched": touched,
        "bytes": nbytes,
        "flops": flops,
        "rel_err": err,
        "triton_graph_ms": timing.time_replay_ms(lambda: moe.fused_moe(x, w13, w2, weights, ids, **options)),
        "triton_ms": timing.time_ms(lambda: moe.fused_moe(x, w13, w2, weights, ids, **options), w13.device),
        "torch_ms": timing.time_ms(lambda: torch_per_expert(x, *dense, weights, ids), w13.device),
        "read_floor_ms": nbytes / (rates["copy_gbs"] * 1e6),
        "compute_floor_ms": flops / (rates["matmul_tflops"] * 1e9),
    }
    best = min(row["triton_graph_ms"], row["triton_ms"])
    row["pct_of_copy_bw"] = 100 * row["read_floor_ms"] / best
    row["pct_of_matmul"] = 100 * row["compute_floor_ms"] / best
    row["speedup_vs_torch"] = row["torch_ms"] / row["triton_ms"]
    if quantized:  # NOTE: as stored against dequantized: --mxfp4-experts auto's (--fp8-weights auto's) choice
        row["dequantized_graph_ms"] = timing.time_replay_ms(lambda: moe.fused_moe(x, *dense, weights, ids))
        row[quantized.speedup] = row["dequantized_graph_ms"] / row["triton_graph_ms"]
    if shape.quant == "fp8":  # NOTE: and with fp8 activations (--fp8-activations dynamic), checked first
        w8a8 = {**options, "fp8_activations": True}
        got = moe.fused_moe(x, w13, w2, weights, ids, **w8a8).float()
        want = reference.fused_moe(x, w13, w2, weights, ids, **w8a8).float()
        row["w8a8_rel_err"] = float((got - want).norm() / want.norm().clamp_min(1e-30))
        row["w8a8_graph_ms"] = timing.time_replay_ms(lambda: moe.fused_moe(x, w13, w2, weights, ids, **w8a8))
        row["w8a8_vs_fp8"] = row["triton_graph_ms"] / row["w8a8_graph_ms"]
        for where, fuse in (
            ("inside", True),
            ("first", False),
        ):  # NOTE: the inputs quantized in the GEMMs or not
            row[f"w8a8_quantized_{where}_graph_ms"] = timing.time_replay_ms(
                lambda fuse=fuse: moe.fused_moe(x, w13, w2, weights, ids, **w8a8, fuse_quantization=fuse)
            )
    default = moe.default_config(tokens * shape.top_k, shape.experts, mxfp4=shape.quant == "mxfp4")
    row["default"] = next((label for label, cfg in moe.CANDIDATES.items() if cfg == default), str(default))
    if shape.quant == "mxfp4":  # NOTE: each depth's output checked against the reference first
        steps = {f"k{k}": dataclasses.replace(default, block_k=k) for k in MXFP4_STEPS}
        errors = []
        for cfg in steps.values():
            out = moe.fused_moe(x, w13, w2, weights, ids, **options, config=cfg).float()
            errors.append(float((out - want).norm() / want.norm().clamp_min(1e-30)))
        row["mxfp4_steps_rel_err"] = max(errors)
        row["mxfp4_steps_graph_ms"] = {
            label: timing.time_replay_ms(
                lambda cfg=cfg: moe.fused_moe(x, w13, w2, weights, ids, **options, config=cfg)
            )
            for label, cfg in steps.items()
        }
        row["mxfp4_step"] = f"k{default.block_k}"
    if candidates and not quantized:  # NOTE: the candidates' deep steps are for 16-bit weights
        row["candidates_graph_ms"] = {
            label: timing.time_replay_ms(lambda cfg=cfg: moe.fused_moe(x, w13, w2, weights, ids, config=cfg))
            for label, cfg in moe.CANDIDATES.items()
        }
        row["best"] = min(row["candidates_graph_ms"], key=row["candidates_graph_ms"].get)
    return row


def summarize(rows: list[dict]) -> dict[str, float | None]:
    """Each quantized format's least speed-up over its experts dequantized to bf16 at decode (at most
    DECODE_TOKENS tokens), e.g. packed_speedup_min_decode: where it is at least 1, keeping the experts as
    stored on CUDA is right for decode steps; fp8 activations' least speed-up over 16-bit ones on fp8
    experts, at decode and above it (w8a8_vs_fp8_min_decode / _min_prefill); each MXFP4 step depth's least
    speed-up over the default's, at decode and above (mxfp4_k64_speedup_min_decode ...). None without such
    rows."""
    decode = [r for r in rows if r["tokens"] <= DECODE_TOKENS]
    prefill = [r for r in rows if r["tokens"] > DECODE_TOKENS]
    return {
        **{f"{q.speedup}_min_decode": min((r[q.speedup] for r in decode if q.speedup in r), default=None)
           for q in FORMATS.values()},
        "w8a8_vs_fp8_min_decode": min((r["w8a8_vs_fp8"] for r in decode if "w8a8_vs_fp8" in r), default=None),
        "w8a8_vs_fp8_min_prefill": min((r["w8a8_vs_fp8"] for r in prefill if "w8a8_vs_fp8" in r), default=None),
        **{f"mxfp4_k{k}_speedup_min_{regime}": _least_step_speedup(part, f"k{k}")
           for k in MXFP4_STEPS for regime, part in (("decode", decode), ("prefill", prefill))},
    }  # fmt: skip


def _least_step_speedup(rows: list[dict], label: str) -> float | None:
    """MXFP4 step depth ``label``'s least speed-up over the default's depth across ``rows`` (the default's
    time over its), None without MXFP4 rows."""
    timed = [r for r in rows if "mxfp4_steps_graph_ms" in r]
    return min(
        (r["mxfp4_steps_graph_ms"][r["mxfp4_step"]] / r["mxfp4_steps_graph_ms"][label] for r in timed),
        default=None,
    )


def format_markdown(result: dict) -> str:
    dev = result["device"]
    lines = [
        f"**Mixture-of-experts MLP (kernels/moe.py) on {dev['name']}** (copy {dev['copy_gbs']:.0f} GB/s, "
        f"bf16 matmul {dev['matmul_tflops']:.0f} TF/s, measured in this run)",
        "",
        "| model | tokens | experts read | graph replay us | eager us | torch per expert us | vs torch | "
        "% of copy bw | % of matmul | rel err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['experts_touched']} | {r['triton_graph_ms'] * 1e3:.1f} | "
            f"{r['triton_ms'] * 1e3:.1f} | {r['torch_ms'] * 1e3:.1f} | {r['speedup_vs_torch']:.2f}x | "
            f"{r['pct_of_copy_bw']:.0f}% | {r['pct_of_matmul']:.0f}% | {r['rel_err']:.1e} |"
        )
    timed = [r for r in result["rows"] if "candidates_graph_ms" in r]
    if timed:
        labels = list(timed[0]["candidates_graph_ms"])
        lines += ["", "Candidate tiles (kernels.moe.CANDIDATES), graph replay us; the default's in bold, the best marked *:",
                  "", "| model | tokens | " + " | ".join(labels) + " |", "|---|---:|" + "---:|" * len(labels)]  # fmt: skip
        for r in timed:
            cells = []
            for label in labels:
                cell = f"{r['candidates_graph_ms'][label] * 1e3:.1f}" + ("*" if label == r["best"] else "")
                cells.append(f"**{cell}**" if label == r["default"] else cell)
            lines.append(f"| {r['model']} | {r['tokens']} | " + " | ".join(cells) + " |")
    summary = summarize(result["rows"])
    for q in FORMATS.values():
        stored = [r for r in result["rows"] if q.speedup in r]
        if not stored:
            continue
        least = summary[f"{q.speedup}_min_decode"]
        lines += ["", f"{q.title} against the same experts dequantized to bf16, graph replay us:", "",
                  f"| model | tokens | {q.stored} | dequantized | {q.stored} speedup |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['tokens']} | {r['triton_graph_ms'] * 1e3:.1f} | "
                  f"{r['dequantized_graph_ms'] * 1e3:.1f} | {r[q.speedup]:.2f}x |"
                  for r in stored]  # fmt: skip
        lines += ["", f"`{q.speedup}_min_decode`, the least at {DECODE_TOKENS} tokens or fewer: "
                  + _times(least)]  # fmt: skip
    steps = [r for r in result["rows"] if "mxfp4_steps_graph_ms" in r]
    if steps:
        labels = [f"k{k}" for k in MXFP4_STEPS]
        lines += ["", "MXFP4 experts by step depth (block_k; k32 scales each step's product, deeper steps each "
                  "value), graph replay us; the default's in bold:", "",
                  "| model | tokens | " + " | ".join(labels) + " | rel err |", "|---|---:|" + "---:|" * (len(labels) + 1)]  # fmt: skip
        for r in steps:
            cells = [f"{r['mxfp4_steps_graph_ms'][label] * 1e3:.1f}" for label in labels]
            cells = [
                f"**{c}**" if label == r["mxfp4_step"] else c for c, label in zip(cells, labels, strict=True)
            ]
            lines.append(
                f"| {r['model']} | {r['tokens']} | "
                + " | ".join(cells)
                + f" | {r['mxfp4_steps_rel_err']:.1e} |"
            )
        summary_steps = [f"`mxfp4_k{k}_speedup_min_{regime}` {_times(summary[f'mxfp4_k{k}_speedup_min_{regime}'])}"
                         for k in MXFP4_STEPS for regime in ("decode", "prefill")]  # fmt: skip
        lines += ["", "The least speed-up of each depth over the default's: " + ", ".join(summary_steps)]
    w8a8 = [r for r in result["rows"] if "w8a8_vs_fp8" in r]
    if w8a8:
        lines += [
            "",
            "fp8 experts with fp8 activations (W8A8: each GEMM's input quantized per 128-column group, "
            "the quantization included) against 16-bit activations, graph replay us:",
            "",
            "| model | tokens | fp8 | fp8 activations | x quantized inside | x quantized first | W8A8 vs fp8 | "
            "W8A8 rel err |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['model']} | {r['tokens']} | {r['triton_graph_ms'] * 1e3:.1f} | "
            f"{r['w8a8_graph_ms'] * 1e3:.1f} | {r['w8a8_quantized_inside_graph_ms'] * 1e3:.1f} | "
            f"{r['w8a8_quantized_first_graph_ms'] * 1e3:.1f} | {r['w8a8_vs_fp8']:.2f}x | {r['w8a8_rel_err']:.1e} |"
            for r in w8a8
        ]
        lines += ["", f"`w8a8_vs_fp8_min_decode` {_times(summary['w8a8_vs_fp8_min_decode'])}, "
                  f"`w8a8_vs_fp8_min_prefill` {_times(summary['w8a8_vs_fp8_min_prefill'])}"]  # fmt: skip
    lines += ["", f"Command: `{result['command']}`. {result['timing']}", ""]
    if "interrupted" in result:
        lines.insert(1, f"\nInterrupted {result['interrupted']}: the rows measured before are below.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m kernels.bench_moe", description=__doc__)
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default docs/benchmarks/moe-<gpu>.json)"
    )
    ap.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-candidates", action="store_true", help="time the default tiles only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels.bench_moe needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
              file=sys.stderr)  # fmt: skip
        return 2
    import platform

    import triton

    from kernels.bench import gpu_slug, measure_copy_gbs, measure_matmul_tflops, write_result

    device, started = torch.device("cuda"), time.time()
    gpu = torch.cuda.get_device_name(device)
    rates = {
        "copy_gbs": measure_copy_gbs(device),
        "matmul_tflops": measure_matmul_tflops(device, torch.bfloat16),
    }
    result = {
        "device": {
            "name": gpu,
            "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
            **rates,
        },
        "software": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "command": " ".join(["python -m kernels.bench_moe", *argv]),
        "timing": "kernels.timing median, L2 evicted by a read before each run; graph replay and eager calls of "
        "kernels.moe.fused_moe, eager calls of the torch loop",
        "rows": [],
    }
    gen = torch.Generator().manual_seed(args.seed)
    try:
        for name in args.models:
            shape = MODELS[name]
            w = expert_weights(shape, torch.bfloat16, device, args.seed)
            for tokens in args.tokens:
                result["rows"].append(
                    row := bench_row(name, shape, tokens, w, rates, gen, not args.no_candidates)
                )
                print(f"{name} t={tokens}: {row['triton_graph_ms'] * 1e3:.1f} us replayed, "
                      f"{row['torch_ms'] * 1e3:.1f} us torch", flush=True)  # fmt: skip
            del w
            torch.cuda.empty_cache()
    except KeyboardInterrupt:
        result["interrupted"] = f"during {name}"
    result["summary"] = summarize(result["rows"])
    result["wall_s"] = round(time.time() - started, 1)
    write_result(
        result, args.out or Path("docs/benchmarks") / f"moe-{gpu_slug(gpu)}.json", format_markdown(result)
    )
    print(format_markdown(result))
    return 130 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
