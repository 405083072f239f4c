"""worker.bench's measurements of the machine and its report: the batch-1 decode step against weight
bytes / measured bandwidth, machine facts, and the markdown table."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

# ---------------------------------------------------------------------------- the decode floor
# an extend graph's capture (worker.extend_graph) as a TTFT row names it
GRAPH_VARIANT_NAMES = {"long_prefix": "long-prefix tiles", "split": "prefix split"}
DECODE_FLOOR_TARGET = 1.3  # a batch-1 decode step within this many times the weight-read floor


def decode_weight_bytes(model: Any) -> int:
    """Weight bytes a batch-1 decode step must read: every parameter except the embedding table, of which a
    step reads one row per token (a tied table is read whole as the LM head, so then it counts), and of a
    sparse layer's experts only the experts_per_token its token takes."""
    total = sum(x.numel() * x.element_size() for x in model.parameters())  # a tied tensor counts once
    if not model.config.tie_word_embeddings:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    c = model.config
    for layer in (layer for layer in model.layers if layer.sparse):
        per_expert = (
            layer.experts_gate_up,
            layer.experts_down,
            layer.experts_gate_up_bias,
            layer.experts_down_bias,
            layer.experts_gate_up_scales,
            layer.experts_down_scales,
        )
        experts = sum(w.numel() * w.element_size() for w in per_expert if w is not None)
        total -= experts * (c.num_experts - c.experts_per_token) // c.num_experts
    return total


def measure_copy_gbs(device: str, nbytes: int = 256 << 20) -> float:
    """Memory bandwidth of ``device`` as a large copy moves it: (read + write) bytes / time, GB/s."""
    import torch

    if device == "cuda":
        from kernels.bench import measure_copy_gbs as gpu_copy_gbs

        return gpu_copy_gbs(torch.device("cuda"))
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def decode_floor(
    model: Any, decode: list[dict], copy_gbs: float, replay_ms: float | None = None
) -> dict | None:
    """The batch-1 decode step against weight bytes / measured bandwidth (None without a batch-1 row);
    with ``replay_ms`` (the step's captured forward replayed alone) also the GPU's share of it."""
    row = next((d for d in decode if d["batch"] == 1), None)  # NOTE: the engine as configured (overlap)
    if row is None:
        return None
    weight_bytes = decode_weight_bytes(model)
    copy_gbs = round(copy_gbs, 1)  # NOTE: the floor comes from the bandwidth as reported
    floor_ms = weight_bytes / (copy_gbs * 1e9) * 1e3
    ratio = row["step_ms"] / floor_ms
    floor = {"weight_bytes": weight_bytes, "copy_gbs": copy_gbs, "floor_ms": round(floor_ms, 4),
             "step_ms": row["step_ms"], "ratio": round(ratio, 3), "target": DECODE_FLOOR_TARGET,
             "met": ratio <= DECODE_FLOOR_TARGET}  # fmt: skip
    if replay_ms is not None:
        floor["replay_ms"], floor["replay_ratio"] = replay_ms, round(replay_ms / floor_ms, 3)
    return floor


# ---------------------------------------------------------------------------- machine and report
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        models = []
    return models[0] if models else platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    return {"device": device, "device_name": name, "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}  # fmt: skip


def rows_markdown(rows: list[dict], cols: list[str], title: str) -> str:
    """A bold title and a markdown table of ``rows``' ``cols`` (numbers right-aligned)."""
    lines = [f"**{title}**", "", "| " + " | ".join(c.replace("_", " ") for c in cols) + " |"]
    lines.append(
        "|" + "|".join("---:" if isinstance(rows[0][c], (int, float)) else "---" for c in cols) + "|"
    )
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def markdown_table(doc: dict) -> str:
    p, m = doc["params"], doc["machine"]
    rows = [(f"prefill, {p['prefill_prompts']} x {p['prompt_tokens']}-token prompts, no cache",
             f"{doc['prefill']['tokens_per_s']:,.0f}", "tokens/s")]  # fmt: skip
    for d in doc["decode"]:
        how = (
            ""
            if d.get("overlap", True) or not any(x.get("overlap") for x in doc["decode"])
            else ", one step at a time"
        )
        rows.append((f"decode, batch {d['batch']} ({p['decode_prompt_tokens']}-token prompts{how})",
                     f"{d['tokens_per_s']:,.0f}", f"tokens/s ({d['step_ms']:.2f} ms/step)"))  # fmt: skip
    adj = doc.get("decode_adjusted")
    if adj:
        rows.append((f"decode, batch {adj['batch']}, every request with penalties, bias and top-5 logprobs",
                     f"{adj['tokens_per_s']:,.0f}", f"tokens/s ({adj['step_ms']:.2f} ms/step)"))  # fmt: skip
    sampled = doc.get("decode_sampled")
    if sampled:
        how = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampled["sampling"].items())
        rows.append((f"decode, batch {sampled['batch']}, every request sampled ({how}, unseeded)",
                     f"{sampled['tokens_per_s']:,.0f}", f"tokens/s ({sampled['step_ms']:.2f} ms/step)"))  # fmt: skip
    for t in doc["ttft"]:
        where = " in host memory" if t.get("from") == "host" else ""
        where += ", prefill launched eagerly" if t.get("eager") else ""
        if t.get("extend_graph_steps"):
            variants = [GRAPH_VARIANT_NAMES.get(v, v) for v in t.get("graph_variants", {}) if v != "default"]
            where += ", prefill replayed as a CUDA graph" + "".join(f" ({v})" for v in variants)
        where += ", default graphs only" if t.get("prefix_variants") is False else ""
        length = t.get("prompt_tokens", p["prompt_tokens"])
        # NOTE: labelled by the share the hit reached: whole pages only, so 90% of 256 tokens is 224
        what = (f"follow-up turn, {t['cached_tokens']:,} of {length:,} tokens cached" if t.get("follow_up")
                else f"{t['cached_tokens'] / length:.0%} of {length} tokens cached")  # fmt: skip
        if t["cached_tokens"] < t.get("warmed_pages_tokens", 0):
            where += f", **hit short of the {t['warmed_pages_tokens']:,} tokens warmed**"
        rows.append((f"TTFT, {what}{where} ({t['computed_tokens']} computed)", f"{t['ttft_ms_median']:.2f}",
                     f"ms (median of {p['reps']})"))  # fmt: skip
    copies = doc.get("host_copies")
    if copies:
        rows.append((f"host tier copies, {copies['tokens']} tokens ({copies['bytes'] / 2**20:,.1f} MiB, one run "
                     "of pages: the best case): device to host / host to device", f"{copies['save_gbs']:,.1f} / {copies['load_gbs']:,.1f}",
                     f"GB/s ({copies['save_ms']:.1f} / {copies['load_ms']:.1f} ms)"))  # fmt: skip
    floor = doc.get("decode_floor")
    if floor:
        rows.append(("decode batch 1 step / weight-read floor", f"{floor['ratio']:.2f}",
                     f"x ({floor['weight_bytes'] / 1e9:.2f} GB / {floor['copy_gbs']:,.0f} GB/s = "
                     f"{floor['floor_ms']:.2f} ms; target <= {floor['target']})"))  # fmt: skip
        if "replay_ms" in floor:
            rows.append(("decode batch 1 forward alone (graph replay, no host work) / floor",
                         f"{floor['replay_ratio']:.2f}", f"x ({floor['replay_ms']:.2f} ms)"))  # fmt: skip
    # NOTE: the engine's cache publishes KV events, so its radix costs are the events=True rows
    for r in doc["radix"]:
        if r["events"] and r["op"] in ("match_hit", "insert_new"):
            rows.append((f"radix {r['op']}, {r['tokens']} tokens", f"{r['median_us']:.1f}", "µs (median)"))
    model = f"{doc['model']['name']} ({precision(doc['model'])})"
    head = f"**{model} on {m['device_name']}, {m['torch_threads']} torch threads**"
    graphs = (f", CUDA graphs up to batch {p['cuda_graph_max_bs']} ({doc['decode_graph_steps']} decode steps "
              "replayed)" if doc.get("decode_graph_steps") else "")  # fmt: skip
    if doc.get("extend_graph_steps"):
        graphs += (f", extend graphs up to {p['cuda_graph_extend_tokens']} new tokens "
                   f"({doc['extend_graph_steps']} steps replayed)")  # fmt: skip
    lines = [f"{head} (block {p['block_size']}, chunked prefill {p['chunked_prefill_tokens']}{graphs})", "",
             "| measurement | value | unit |", "|---|---:|---|"]  # fmt: skip
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def precision(model: dict) -> str:
    """The weights' and the KV pool's dtypes as a report's title names them, e.g. "bfloat16, KV float8_e4m3fn"
    or "fp8 projections (128x128 blocks, inputs fp8 per token), bfloat16 elsewhere, KV bfloat16"; an fp8
    pool over a checkpoint's KV scales "KV float8_e4m3fn over KV scales"."""
    dtype, config = model["dtype"], model.get("config") or {}
    weights = dtype
    if config.get("fp8_projections"):
        block = config.get("fp8_weight_block")
        scales = f"{block[0]}x{block[1]} blocks" if block else "one scale a row"
        scales += ", inputs fp8 per token" if config.get("fp8_activations") else ""
        weights = f"fp8 projections ({scales}), {dtype} elsewhere"
    kv_scales = " over KV scales" if config.get("kv_scales") else ""
    return f"{weights}, KV {model.get('kv_dtype', dtype)}{kv_scales}"


def write_results(doc: dict, json_path: str | None, markdown_path: str | None, table: str) -> None:
    """A benchmark's JSON document and markdown table to the paths asked for (each optional), then
    the table on stdout, last."""
    import orjson

    for path, data in ((json_path, orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"),
                       (markdown_path, table.encode())):  # fmt: skip
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            print(f"wrote {path}")
    print(table)


def add_step_bench_args(parser: Any) -> None:
    """The flags every model-step benchmark shares: model, device, CPU threads, --quick, outputs."""
    parser.add_argument("--model", choices=["tiny", "llama3-8b-shape"], default="tiny")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--cpu-threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the table(s) as markdown here")


def bench_device(parser: Any, device: str, model: str, cpu_threads: int) -> str:
    """The device a benchmark CLI runs on (``auto``: CUDA when there is one); usage errors for a
    CUDA request without a GPU and for a shape-only model off CUDA; CPU threads set for the CPU."""
    import torch

    from worker.assembly import tune_cpu_process

    resolved = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if resolved == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if model != "tiny" and resolved != "cuda":
        parser.error(f"--model {model} needs a CUDA GPU; use --model tiny on CPU")
    if resolved == "cpu":
        tune_cpu_process(cpu_threads)
    return resolved


def median_ms(run: Any, reps: int, warmup: int = 2) -> float:
    """Median wall ms of ``run()`` over ``reps`` calls after ``warmup`` untimed ones (they warm
    allocators and kernels); ``run`` returns only once its work is done (it reads a result back or
    synchronises the device)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)
