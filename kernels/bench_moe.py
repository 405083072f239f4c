"""`python -m kernels.bench_moe`: the mixture-of-experts MLP (kernels/moe.py) on a GPU, against the experts
run one at a time by torch (as transformers' eager MoE blocks run them) and against the GPU's own measured
copy bandwidth and matmul rate, in one run; JSON to --out, a markdown report beside it (same stem, .md), a
table printed last.

Shapes are real models' (random weights): Qwen3-30B-A3B (128 experts of 768, 8 a token, hidden 2048) and
Mixtral-8x7B (8 of 14336, 2 a token, hidden 4096) in bf16, and gpt-oss-20b (32 of 2880, 4 a token, hidden
2880) in MXFP4 as released (its biases and clamped activation left out: the rows time the GEMMs; beside
the packed experts, the same experts dequantized to bf16), over batches of 1 to 4,096 tokens with the
router's choice drawn at random (uniform logits: every expert about equally likely). For each row: the
kernel replayed in a CUDA graph (as a decode step runs it) and called eagerly (as a prefill runs it), the
torch loop, the bytes of the expert weights the batch touches over the copy bandwidth (the floor a
decode step's MLP cannot beat) and its FLOPs over the matmul rate; each candidate tile configuration
(kernels.moe.CANDIDATES) replayed too, from which the defaults' rule is set. Needs CUDA: without it, it measures
nothing and exits 2. Numbers are never estimated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels import reference, timing

TOKENS = (1, 16, 64, 256, 1024, 4096)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    experts: int
    top_k: int
    hidden: int
    inter: int  # one expert's intermediate units
    mxfp4: bool = False  # the weights as MXFP4 codes and scales (0.5 + 1/32 bytes a weight)

    def expert_bytes(self, elem_bytes: int = 2) -> int:
        """One expert's weights: gate, up and down (codes and scales when mxfp4)."""
        return (
            3 * self.hidden * self.inter * 17 // 32
            if self.mxfp4
            else 3 * self.hidden * self.inter * elem_bytes
        )


MODELS = {
    "qwen3-30b-a3b": MoeShape(experts=128, top_k=8, hidden=2048, inter=768),
    "mixtral-8x7b": MoeShape(experts=8, top_k=2, hidden=4096, inter=14336),
    "gpt-oss-20b": MoeShape(experts=32, top_k=4, hidden=2880, inter=2880, mxfp4=True),
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
    """w13 [E, 2I, H] and w2 [E, H, I], std 1/sqrt(fan-in), generated on the device; for an mxfp4 shape
    (w13, w2, w13_scales, w2_scales): random codes, each weight's scale giving an rms near 1/sqrt(fan-in)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if shape.mxfp4:
        e, h, n = shape.experts, shape.hidden, shape.inter
        codes = [
            torch.empty(e, rows, cols // 2, device=device, dtype=torch.uint8)
            for rows, cols in ((2 * n, h), (h, n))
        ]
        for c in codes:
            c.random_(0, 256, generator=gen)
        scales = [torch.full((e, rows, cols // 32), 127 + round(-math.log2(2.93 * cols**0.5)), device=device,
                             dtype=torch.uint8) for rows, cols in ((2 * n, h), (h, n))]  # fmt: skip
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

    w13, w2 = weights13[:2]
    options = {"w13_scales": weights13[2], "w2_scales": weights13[3]} if shape.mxfp4 else {}
    dtype = torch.bfloat16 if shape.mxfp4 else w13.dtype
    x, weights, ids = inputs(shape, tokens, dtype, w13.device, gen)
    got, want = (
        moe.fused_moe(x, w13, w2, weights, ids, **options).float(),
        reference.fused_moe(x, w13, w2, weights, ids, **options).float(),
    )
    # NOTE: the torch loop (and, for MXFP4, the kernel beside it) on the experts dequantized to x's dtype
    dense = (
        [reference.dequantize_mxfp4(w, s, dtype) for w, s in ((w13, weights13[2]), (w2, weights13[3]))]
        if shape.mxfp4
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
    if shape.mxfp4:  # NOTE: packed against dequantized: --mxfp4-experts auto's choice on CUDA
        row["dequantized_graph_ms"] = timing.time_replay_ms(lambda: moe.fused_moe(x, *dense, weights, ids))
        row["packed_speedup"] = row["dequantized_graph_ms"] / row["triton_graph_ms"]
    default = moe.default_config(tokens * shape.top_k, shape.experts, mxfp4=shape.mxfp4)
    row["default"] = next((label for label, cfg in moe.CANDIDATES.items() if cfg == default), str(default))
    if candidates and not shape.mxfp4:  # NOTE: the candidates' deep steps are for 16-bit weights
        row["candidates_graph_ms"] = {
            label: timing.time_replay_ms(lambda cfg=cfg: moe.fused_moe(x, w13, w2, weights, ids, config=cfg))
            for label, cfg in moe.CANDIDATES.items()
        }
        row["best"] = min(row["candidates_graph_ms"], key=row["candidates_graph_ms"].get)
    return row


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
    packed = [r for r in result["rows"] if "packed_speedup" in r]
    if packed:
        lines += ["", "MXFP4 experts packed (decoded in the GEMMs) against the same experts dequantized to bf16, "
                  "graph replay us:", "", "| model | tokens | packed | dequantized | packed speedup |",
                  "|---|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['model']} | {r['tokens']} | {r['triton_graph_ms'] * 1e3:.1f} | "
                  f"{r['dequantized_graph_ms'] * 1e3:.1f} | {r['packed_speedup']:.2f}x |" for r in packed]  # fmt: skip
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

    from kernels.bench import gpu_slug, measure_copy_gbs, measure_matmul_tflops

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
    result["wall_s"] = round(time.time() - started, 1)
    out = args.out or Path("docs/benchmarks") / f"moe-{gpu_slug(gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(format_markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    print(format_markdown(result))
    return 130 if "interrupted" in result else 0


if __name__ == "__main__":
    sys.exit(main())
