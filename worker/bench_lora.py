"""What LoRA adapters cost a forward: `python -m worker.bench_lora [--model tiny|llama3-8b-shape]`.

One model forward (a decode step of B requests at a context of C tokens, and a prefill of P new
tokens) with every request on the base, and with the requests spread over 1, 2, ... adapters of
rank r on all seven projections (random weights), median ms over repetitions. On a GPU the adapter
deltas are two Triton launches per projection whatever the adapters in the step (kernels/lora.py),
and the decode step is also timed as a replayed CUDA graph (no host launch cost); on the CPU they are
torch matmuls per adapter in the batch (kernels.reference.lora_add), so the cost grows with the
number of distinct adapters in a step. This measures by how much.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker.bench import bench_model
from worker.bench_report import add_step_bench_args, bench_device, machine_info, median_ms, write_results


def random_adapter(model: Any, name: str, rank: int, seed: int) -> Any:
    """A LoraAdapter on every projection of ``model`` (rank ``rank`` per q/k/v/o/gate/up/down part,
    stacked as worker.model.lora.load_adapter stacks them) with random weights (std 0.02)."""
    import torch

    from worker.model.lora import LoraAdapter

    c = model.config
    q, kv, inter, hidden = (
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
        c.intermediate_size,
        c.hidden_size,
    )
    # projection -> (in, out, parts)
    shapes = {"qkv": (hidden, q + 2 * kv, 3), "o": (q, hidden, 1), "gate_up": (hidden, 2 * inter, 2),
              "down": (inter, hidden, 1)}  # fmt: skip
    gen = torch.Generator(device=model.device).manual_seed(seed)
    adapter = LoraAdapter(name, rank, 2.0)
    for layer in range(c.num_layers):
        for proj, (fan_in, fan_out, parts) in shapes.items():
            a = torch.randn(rank * parts, fan_in, generator=gen, device=model.device) * 0.02
            b = torch.randn(fan_out, rank * parts, generator=gen, device=model.device) * 0.02
            adapter.weights[(layer, proj)] = (a.to(model.dtype), b.to(model.dtype))
    return adapter


def forward_ms(model: Any, pool: Any, fb: Any, reps: int, device: str) -> float:
    import torch

    def forward() -> None:
        with torch.inference_mode():
            model.forward(fb, pool)
        if device == "cuda":
            torch.cuda.synchronize()

    return median_ms(forward, reps)


def graph_ms(model: Any, pool: Any, fb: Any, reps: int) -> float:
    """Median ms of one replay of ``fb``'s forward captured in a CUDA graph (what a decode step costs
    the GPU, without the host's kernel launches)."""
    import torch

    from kernels.timing import capture
    from worker.bench_parts import cuda_median_ms

    with torch.inference_mode():
        graph = capture(lambda: model.forward(fb, pool))  # NOTE: one warm-up run first (Triton compiles)
    return cuda_median_ms(graph.replay, reps)


def run(
    model: Any, device: str, batch: int, context: int, prefill: int, adapters: list[int], reps: int
) -> list[dict]:
    from worker.forward_batch import ForwardBatch
    from worker.kv_pool import KVPool
    from worker.model.lora import lora_batch

    c, ps = model.config, 16
    span = -(-max(context + 1, prefill) // ps) * ps
    pool = KVPool(batch * span // ps, ps, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, device)
    slots = [list(range(i * span, (i + 1) * span)) for i in range(batch)]
    decode = ForwardBatch.build("decode", [[1]] * batch, [context] * batch, [s[context : context + 1] for s in slots],
                                [s[: context + 1] for s in slots], device)  # fmt: skip
    extend = ForwardBatch.build("extend", [[1] * prefill], [0], [slots[0][:prefill]], [[]], device)
    for i in range(max(adapters)):
        model.add_lora(random_adapter(model, f"a{i}", ADAPTER_RANK, i))
    rows = []
    for n in [0, *adapters]:
        per_request = [1 + i % n if n else 0 for i in range(batch)]  # requests spread over n adapters
        decode.lora = lora_batch(model.lora_stack, per_request, decode.qo_indptr, 1)
        extend.lora = lora_batch(model.lora_stack, [1 if n else 0], extend.qo_indptr, prefill)
        row = {"adapters": n, "decode_ms": forward_ms(model, pool, decode, reps, device),
               "prefill_ms": forward_ms(model, pool, extend, reps, device)}  # fmt: skip
        if device == "cuda":
            row["decode_graph_ms"] = graph_ms(model, pool, decode, reps)
        rows.append(row)
    for r in rows:
        r["decode_vs_base"] = round(r["decode_ms"] / rows[0]["decode_ms"], 3)
        if "decode_graph_ms" in r:
            r["decode_graph_vs_base"] = round(r["decode_graph_ms"] / rows[0]["decode_graph_ms"], 3)
        r["prefill_vs_base"] = round(r["prefill_ms"] / rows[0]["prefill_ms"], 3)
    return rows


ADAPTER_RANK = 16


def markdown(doc: dict) -> str:
    p = doc["params"]
    lines = [f"LoRA cost, {doc['model']} on {doc['machine']['device_name']}: decode step of {p['batch']} requests "
             f"at context {p['context']}, prefill of {p['prefill']} tokens; rank {p['rank']} on all projections, "
             f"median of {p['reps']}:", "",
             "| adapters in the step | decode ms (x base) | prefill ms (x base) |", "|---:|---:|---:|"]  # fmt: skip
    graphs = all("decode_graph_ms" in r for r in doc["rows"])
    if graphs:
        lines[-2:] = ["| adapters in the step | decode ms (x base) | decode graph replay ms (x base) | prefill ms (x base) |",
                      "|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["rows"]:
        graph = f"{r['decode_graph_ms']} ({r['decode_graph_vs_base']}x) | " if graphs else ""
        lines.append(f"| {r['adapters'] or 'none (base)'} | {r['decode_ms']} ({r['decode_vs_base']}x) | {graph}"
                     f"{r['prefill_ms']} ({r['prefill_vs_base']}x) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench_lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batch", type=int, default=16, help="decode requests")
    ap.add_argument("--context", type=int, default=1024, help="decode context tokens per request")
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (one request)")
    ap.add_argument("--adapters", default="1,2,4,8", help="distinct adapters in the step, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    add_step_bench_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    try:
        adapters = [int(x) for x in a.adapters.split(",")]
    except ValueError:
        ap.error("--adapters must be comma-separated integers")
    if a.quick:
        a.batch, a.context, a.prefill, a.reps, adapters = 4, 32, 32, 2, [1, 2]
    if min([a.batch, a.context, a.prefill, a.reps, *adapters]) <= 0 or max(adapters) > a.batch:
        ap.error("sizes must be positive and adapters at most --batch")
    device = bench_device(ap, a.device, a.model, a.cpu_threads)
    model = bench_model(a.model, device)
    t0 = time.perf_counter()
    rows = run(model, device, a.batch, a.context, a.prefill, adapters, a.reps)
    params = {"model": a.model, "device": device, "batch": a.batch, "context": a.context, "prefill": a.prefill,
              "adapters": adapters, "rank": ADAPTER_RANK, "reps": a.reps, "quick": a.quick}  # fmt: skip
    doc = {"benchmark": "lora", "command": " ".join(["python -m worker.bench_lora", *argv]), "model": a.model,
           "params": params, "machine": machine_info(device), "rows": rows,
           "wall_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    write_results(doc, a.out, a.markdown, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
