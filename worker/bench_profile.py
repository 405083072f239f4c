"""Where a model step's time goes: `python -m worker.bench_profile [--model tiny|llama3-8b-shape]`.

One decode step of B requests at a context of C tokens (or, with ``--new-tokens N``, a cache hit's
prefill: B requests of N new tokens each over C cached ones), three ways: its wall time run eagerly, its
CUDA graph replayed (on CUDA; how the engine runs decode steps and short prefills), and a profile of
eager steps (torch.profiler) whose kernels are grouped by what they do: weight matmuls, attention,
RMSNorm (with the residual add), RoPE with the KV store, SiLU-and-multiply, everything else. The
matmuls' time against the weight bytes a step must read gives the bandwidth they reach (and, against
their FLOPs, the rate); the other groups and the kernel count per step show what the small kernels
cost. On the CPU the groups are the leaf torch operators' own CPU time instead of kernels.
A prefill's replayed graph is captured as the engine's extend graphs are, over a prefix of unknown
length, in the configuration the engine replays for this prefix (worker.extend_graph's variants: the
default tiles, the long-prefix tiles or the prefix split); run eagerly it knows the prefix
(kernels.extend_attention.default_config): the result names both.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker.bench import bench_model
from worker.bench_parts import cuda_median_ms
from worker.bench_report import (
    add_step_bench_args,
    bench_device,
    decode_weight_bytes,
    machine_info,
    measure_copy_gbs,
    median_ms,
    write_results,
)

# NOTE: first match wins; names are CUDA kernel names (cuBLAS / CUTLASS / Triton) or, on the CPU, torch
# operator names. Triton kernels are named after their @triton.jit functions (kernels/*.py).
GROUPS = (
    (
        "attention",
        re.compile(
            r"decode_split|decode_merge|extend_kernel|short_split|merge_rows|attention|flash|sdpa", re.I
        ),
    ),
    ("matmul", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|aten::(mm|addmm|bmm|matmul)$", re.I)),
    ("rms_norm", re.compile(r"rms_norm", re.I)),  # with the residual add where fused (add_rms_norm)
    ("rope_kv_store", re.compile(r"rope|store_kv|index_put|index_copy", re.I)),  # one kernel on the GPU
    ("silu_mul", re.compile(r"silu", re.I)),
)
OTHER = "other"


def group_of(name: str) -> str:
    """The group a kernel or operator name belongs to (OTHER when none matches)."""
    return next((group for group, pattern in GROUPS if pattern.search(name)), OTHER)


def group_times(events: Sequence[tuple[str, float, int]], steps: int) -> list[dict]:
    """(name, self µs, calls) of profiled kernels over ``steps`` steps -> per-step µs and calls per
    group, every group listed (zeros included), largest first, with each group's share."""
    totals = {group: [0.0, 0] for group, _ in GROUPS} | {OTHER: [0.0, 0]}
    for name, us, calls in events:
        entry = totals[group_of(name)]
        entry[0] += us
        entry[1] += calls
    step_us = sum(us for us, _ in totals.values()) / steps
    rows = [{"group": g, "us_per_step": round(us / steps, 2), "calls_per_step": round(calls / steps, 2),
             "share": round(us / steps / step_us, 4) if step_us else 0.0}
            for g, (us, calls) in totals.items()]  # fmt: skip
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profiled_events(run: Any, steps: int, cuda: bool) -> list[tuple[str, float, int]]:
    """(name, self µs, calls) of every CUDA kernel (``cuda``) or leaf CPU operator that ``steps``
    calls of ``run`` launched, summed by name."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
    events = []
    for e in prof.key_averages():
        if cuda:
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                us = getattr(e, "self_device_time_total", None)
                events.append((e.key, float(us if us is not None else e.self_cuda_time_total), e.count))
        elif e.self_cpu_time_total > 0 and e.key.startswith("aten::"):
            events.append((e.key, float(e.self_cpu_time_total), e.count))
    return events


def matmul_flops(model: Any, tokens: int, logit_rows: int) -> int:
    """FLOPs of a step's weight matmuls: every layer's projections for ``tokens`` rows, the LM head for
    ``logit_rows`` (a prefill computes logits for each request's last token only)."""
    per_token = sum(
        w.numel()
        for layer in model.layers
        for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    )
    return 2 * (per_token * tokens + model.lm_head.numel() * logit_rows)


def extend_tiles(
    model: Any, device: str, max_prefix_len: int | None, new_tokens: int, config: Any = None
) -> str | None:
    """The extend attention tiles a prefill takes on ``device`` ("128x64/8w/3s", kernels.bench_report's
    form): ``config``'s, else the default's; None off CUDA (the reference path)."""
    if device != "cuda":
        return None
    import torch

    from kernels import extend_attention as ext
    from kernels.bench_report import tiles

    arch = ext.device_arch(torch.device("cuda"))
    cfg = config or ext.default_config(model.config.head_dim, model.dtype, arch, max_prefix_len, new_tokens)
    return tiles(dataclasses.asdict(cfg)) + (", prefix split" if cfg.split_prefix else "")


def graph_config(model: Any, device: Any, context: int, new_tokens: int) -> Any:
    """The extend configuration the worker's extend graphs replay on ``device`` (a torch.device) for a
    step of ``new_tokens`` over ``context`` cached tokens (worker.extend_graph's variant for the graph
    the step pads to); None: the default."""
    from worker.config import WorkerConfig
    from worker.extend_graph import graph_token_sizes, replayed_variant, variant_configs, variants_by_default

    sizes = [s for s in graph_token_sizes(WorkerConfig.cuda_graph_extend_tokens) if s >= new_tokens]
    # NOTE: past the largest graph the engine runs the step eagerly
    if not sizes or not variants_by_default(device):
        return None
    size = sizes[0]
    configs = variant_configs(
        model.config, model.dtype, device, model.dtype, size, size
    )  # a "last" graph's kernels
    return configs.get(replayed_variant(configs, context, size))


def replay_ms(forward: Any, reps: int) -> float:
    """Median ms of ``forward`` captured in a CUDA graph and replayed (CUDA events, no host work)."""
    from worker.cuda_graph import CudaGraphBackend

    replay, _ = CudaGraphBackend().capture(forward)
    return cuda_median_ms(replay, reps)


def run(model: Any, device: str, batch: int, context: int, reps: int, new_tokens: int = 0) -> dict:
    """Decode step (``new_tokens`` 0) or a prefill of ``new_tokens`` a request over ``context`` cached."""
    import torch

    from worker.forward_batch import ForwardBatch
    from worker.kv_pool import KVPool

    c, ps = model.config, 16
    new = max(new_tokens, 1)
    span = -(-(context + new) // ps) * ps
    pool = KVPool(batch * span // ps, ps, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, device)
    for cache in pool.k_cache + pool.v_cache:  # NOTE: random KV: no timing on zeros
        cache.copy_(torch.randn_like(cache, dtype=torch.float32).to(cache.dtype))
    slots = [list(range(i * span, (i + 1) * span)) for i in range(batch)]
    out_slots = [s[context : context + new] for s in slots]
    if new_tokens:  # NOTE: the prefix's K/V are already in the pool; the new tokens' are written by the step
        fb = ForwardBatch.build("extend", [[1] * new] * batch, [context] * batch, out_slots,
                                [s[:context] for s in slots], device)  # fmt: skip
    else:
        fb = ForwardBatch.build("decode", [[1]] * batch, [context] * batch, out_slots,
                                [s[: context + 1] for s in slots], device)  # fmt: skip
    cuda = device == "cuda"
    # the engine's extend graphs are captured over any prefix (max_prefix_len unknown), in the
    # configuration its extend graph replays for this one
    replayed = (
        graph_config(model, torch.device(device), context, batch * new) if new_tokens and cuda else None
    )
    graph_fb = dataclasses.replace(fb, max_prefix_len=None, extend_config=replayed) if new_tokens else fb

    def forward(b: Any = fb) -> Any:
        with torch.inference_mode():
            return model.forward(b, pool)

    def step() -> None:
        forward()
        if cuda:
            torch.cuda.synchronize()

    eager = median_ms(step, reps)
    groups = group_times(profiled_events(step, reps, cuda), reps)
    weight_bytes = decode_weight_bytes(model)
    copy_gbs = round(measure_copy_gbs(device), 1)
    matmul_us = next(g["us_per_step"] for g in groups if g["group"] == "matmul")
    flops = matmul_flops(model, batch * new, batch)
    doc = {
        "step": "prefill" if new_tokens else "decode",
        "eager_step_ms": eager,
        "replayed_step_ms": replay_ms(lambda: forward(graph_fb), reps) if cuda else None,
        "profiled_us_per_step": round(sum(g["us_per_step"] for g in groups), 2),
        "calls_per_step": round(sum(g["calls_per_step"] for g in groups), 2),
        "groups": groups,
        "weight_bytes": weight_bytes,
        "copy_gbs": copy_gbs,
        "floor_ms": round(weight_bytes / (copy_gbs * 1e9) * 1e3, 4),
        "matmul_gbs": round(weight_bytes / (matmul_us * 1e-6) / 1e9, 1) if matmul_us else None,
        "matmul_flops": flops,
        "matmul_tflops": round(flops / (matmul_us * 1e-6) / 1e12, 3) if matmul_us else None,
    }
    if new_tokens:
        doc["extend_tiles_eager"] = extend_tiles(model, device, fb.max_prefix_len, batch * new)
        doc["extend_tiles_replayed"] = extend_tiles(model, device, None, batch * new, replayed)
    return doc


def markdown(doc: dict) -> str:
    p, r = doc["params"], doc["result"]
    kind = "kernel" if p["device"] == "cuda" else "operator (CPU self time)"
    replayed = (
        "" if r["replayed_step_ms"] is None else f", replayed as a CUDA graph {r['replayed_step_ms']} ms"
    )
    if p.get("new_tokens"):
        what = (f"Prefill of {p['batch']} request(s), {p['new_tokens']} new tokens each over {p['context']} "
                f"cached, {doc['model']} on {doc['machine']['device_name']}")  # fmt: skip
        tiles = (f" Extend attention tiles: {r['extend_tiles_eager']} eager, {r['extend_tiles_replayed']} "
                 "replayed (captured over a prefix of unknown length in the configuration the engine's extend "
                 "graphs replay for it)."
                 if r.get("extend_tiles_eager") else "")  # fmt: skip
    else:
        what = f"Decode step of {p['batch']} request(s) at context {p['context']}, {doc['model']} on {doc['machine']['device_name']}"
        tiles = ""
    lines = [f"{what}: eager {r['eager_step_ms']} ms{replayed}; weight-read floor "
             f"{r['floor_ms']} ms ({r['weight_bytes'] / 1e9:.2f} GB / {r['copy_gbs']:,.0f} GB/s); weight matmuls "
             f"reach {r['matmul_gbs'] or '-'} GB/s, {'-' if r['matmul_tflops'] is None else r['matmul_tflops']} TFLOP/s.{tiles} Profiled {kind} "
             f"time per step, {r['profiled_us_per_step']} µs in {r['calls_per_step']} calls (the mean over "
             f"{p['reps']} profiled steps):", "",
             "| group | µs per step | share | calls per step |", "|---|---:|---:|---:|"]  # fmt: skip
    for g in r["groups"]:
        lines.append(
            f"| {g['group']} | {g['us_per_step']:,.1f} | {g['share']:.1%} | {g['calls_per_step']:g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batch", type=int, default=1, help="decode requests in the step")
    ap.add_argument("--context", type=int, default=512, help="context tokens per request")
    ap.add_argument("--reps", type=int, default=20, help="steps timed, and steps profiled")
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=0,
        help="profile a prefill of this many new tokens a request over --context cached ones "
        "(a cache hit) instead of a decode step (0)",
    )
    ap.add_argument("--split-prefix", action="store_true",
                    help="the extend kernel's prefix split on (kernels.extend_attention.SPLIT_PREFIX; off by "
                         "default until a GPU run says it pays)")  # fmt: skip
    add_step_bench_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    if a.quick:
        a.context, a.reps = 32, 3
    if min(a.batch, a.context, a.reps) <= 0:
        ap.error("--batch, --context and --reps must be positive")
    if a.new_tokens < 0:
        ap.error("--new-tokens must be 0 (a decode step) or positive")
    device = bench_device(ap, a.device, a.model, a.cpu_threads)
    from kernels import extend_attention

    model = bench_model(a.model, device)
    t0 = time.perf_counter()
    default = extend_attention.SPLIT_PREFIX
    extend_attention.SPLIT_PREFIX = default or a.split_prefix  # NOTE: every extend launch of the run takes it
    try:
        result = run(model, device, a.batch, a.context, a.reps, a.new_tokens)
    finally:
        extend_attention.SPLIT_PREFIX = default
    params = {"model": a.model, "device": device, "batch": a.batch, "context": a.context, "reps": a.reps,
              "new_tokens": a.new_tokens, "split_prefix": a.split_prefix, "quick": a.quick}  # fmt: skip
    doc = {"benchmark": "profile", "command": " ".join(["python -m worker.bench_profile", *argv]), "model": a.model,
           "params": params, "machine": machine_info(device), "result": result,
           "wall_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    write_results(doc, a.out, a.markdown, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
