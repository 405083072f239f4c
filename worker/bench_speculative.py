"""Speculative decoding's cost and gain: `python -m worker.bench_speculative [--model tiny|llama3-8b-shape]`.

Two measurements. (1) Step cost: one model forward of B requests at a context of C tokens, each
with one new token (a decode step) or with 1 + k new tokens and logits for all of them (a verify
step with k drafts), median over repetitions, including reading the argmax back. A verify step
pays off when its tokens per step (1 + kept drafts) exceed its cost relative to a decode step.
(2) End to end through the engine: the same greedy requests decoded with and without drafts;
output tokens/s, drafts kept, tokens per step, and whether the outputs are identical.

What (2) shows depends on how often the model repeats its context, which for random weights is a
property of the weights, not of language: (1) is the model-independent part.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

from worker.bench import LLAMA3_8B_SHAPE, REQUEST_TIMEOUT_S, Prompts, build_bench_engine
from worker.bench_report import bench_device, machine_info, median_ms, write_results
from worker.config import DTYPES, WorkerConfig
from worker.sampling import SamplingParams


def step_costs(
    model: Any, device: Any, batches: list[int], drafts: list[int], context: int, reps: int
) -> list[dict]:
    """Median ms of a decode step and of verify steps with k drafts, per batch size."""
    import torch

    from worker.forward_batch import ForwardBatch
    from worker.kv_pool import KVPool

    mc, ps = model.config, 16
    span = -(-(context + max(drafts) + 1) // ps) * ps  # slots per request
    pool = KVPool(
        max(batches) * span // ps, ps, mc.num_layers, mc.num_kv_heads, mc.head_dim, model.dtype, device
    )
    rows = []
    for b in batches:
        slots = [list(range(i * span, (i + 1) * span)) for i in range(b)]

        def step(k: int, slots: list[list[int]] = slots, b: int = b) -> ForwardBatch:
            if k == 0:
                return ForwardBatch.build("decode", [[1]] * b, [context] * b, [s[context : context + 1] for s in slots],
                                          [s[: context + 1] for s in slots], device)  # fmt: skip
            return ForwardBatch.build("extend", [[1] * (k + 1)] * b, [context] * b,
                                      [s[context : context + k + 1] for s in slots], [s[:context] for s in slots],
                                      device, return_all_logits=True, verify=True)  # fmt: skip

        row: dict[str, Any] = {"batch": b, "context": context, "replayed": device.type == "cuda"}
        for k in [0, *(k for k in drafts if k > 0)]:
            fb = step(k)
            run, logits = replayable(lambda fb=fb: model.forward(fb, pool), device)

            def forward(run: Any = run, logits: Any = logits) -> None:
                with torch.inference_mode():
                    run()
                    logits().argmax(dim=-1).tolist()  # NOTE: the read-back waits for the device

            row[f"k{k}_ms"] = median_ms(forward, reps)
            if k:
                row[f"k{k}_vs_decode"] = round(row[f"k{k}_ms"] / row["k0_ms"], 3)
        rows.append(row)
    return rows


def replayable(forward: Any, device: Any) -> tuple[Any, Any]:
    """(run, logits): on CUDA ``forward`` captured as a CUDA graph, as the engine replays decode and
    verify steps (run replays it, logits() is its output buffer); elsewhere run calls it eagerly."""
    if device.type != "cuda":
        last: list[Any] = [None]

        def run() -> None:
            last[0] = forward()

        return run, lambda: last[0]
    from worker.cuda_graph import CudaGraphBackend

    replay, logits = CudaGraphBackend().capture(forward)
    return replay, lambda: logits


# structured outputs: a record whose keys (forced by the grammar) are half of its bytes
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 16},
        "shipping_address": {"type": "string", "maxLength": 24},
        "order_status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "priority_level": {"type": "integer", "minimum": 0, "maximum": 9},
        "requires_signature": {"type": "boolean"},
    },
    "required": ["customer_name", "shipping_address", "order_status", "priority_level", "requires_signature"],
    "additionalProperties": False,
}


async def generate(engine: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """One request's output ids."""
    handle = engine.submit(prompt, params)
    ids: list[int] = []
    while True:
        out = await asyncio.wait_for(handle.outputs.get(), REQUEST_TIMEOUT_S)
        if out.error is not None:
            raise RuntimeError(f"request failed: {out.error}")
        ids.extend(out.token_ids)
        if out.finish_reason is not None:
            return ids


def end_to_end(
    cfg: WorkerConfig,
    model_config: Any,
    prompts: list[list[int]],
    max_tokens: int,
    k: int,
    schema: bool = False,
) -> dict:
    """The prompts decoded together, greedy, ``k`` drafts per step (0 = off), on a fresh engine
    after a warm-up request; ``schema``: under ORDER_SCHEMA (until it is complete), else exactly
    ``max_tokens`` each. The output ids are returned under "_outputs" for comparison."""
    from worker.guided import grammar_of

    cfg.speculative_tokens = k
    engine = build_bench_engine(cfg, model_config)
    engine.start()
    if schema:
        guide = engine.guides.compile(*grammar_of("json_schema", ORDER_SCHEMA))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, guide=guide)
    else:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def go() -> tuple[list[list[int]], float, Any, Any]:
        await generate(engine, prompts[0][: len(prompts[0]) // 2], params)
        await engine.flush_cache()

        def stats() -> Any:  # NOTE: run on the engine thread, which owns the counters
            return dataclasses.replace(engine.scheduler.stats)

        before, t0 = await engine.call(stats), time.perf_counter()
        outputs = await asyncio.gather(*(generate(engine, p, params) for p in prompts))
        return outputs, time.perf_counter() - t0, before, await engine.call(stats)

    try:
        outputs, elapsed, before, after = asyncio.run(go())
    finally:
        engine.stop()
    fields = ("verify_steps", "verify_requests", "draft_tokens", "accepted_tokens")
    steps, checks, drafted, kept = (getattr(after, f) - getattr(before, f) for f in fields)
    generated = sum(len(o) for o in outputs)
    return {"output": "json_schema" if schema else "free", "drafts_per_step": k, "requests": len(prompts),
            "output_tokens": generated,
            "elapsed_s": round(elapsed, 4), "tokens_per_s": round(generated / elapsed, 1),
            "verify_steps": steps, "draft_tokens": drafted, "accepted_tokens": kept,
            "accepted_fraction": round(kept / drafted, 3) if drafted else None,
            # NOTE: per request per verify step: its kept drafts + its own token
            "tokens_per_request_step": round((kept + checks) / checks, 2) if checks else None,
            "_outputs": outputs}  # fmt: skip


def markdown(doc: dict) -> str:
    p = doc["params"]
    ks = [k for k in p["drafts"] if k > 0]
    replayed = any(r.get("replayed") for r in doc["step_cost"])
    lines = [f"Step cost, {doc['model']} on {doc['machine']['device_name']} "
             f"(context {p['context']} tokens, median of {p['reps']}"
             f"{', each step replayed as a CUDA graph as the engine runs it' if replayed else ', eager steps'}):", "",
             "| batch | decode ms | " + " | ".join(f"k={k} ms (x decode)" for k in ks) + " |",
             "|---:|---:|" + "---:|" * len(ks)]  # fmt: skip
    for r in doc["step_cost"]:
        cells = " | ".join(f"{r[f'k{k}_ms']} ({r[f'k{k}_vs_decode']}x)" for k in ks)
        lines.append(f"| {r['batch']} | {r['k0_ms']} | {cells} |")
    lines += ["", f"End to end: {p['requests']} greedy requests together, {p['prompt_tokens']}-token random "
              f"prompts, {p['max_tokens']} tokens each (json_schema: until the record is complete):", "",
              "| output | drafts/step | tokens/s | verify steps | drafts kept | tokens per request per verify step | same output |",
              "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in doc["end_to_end"]:
        kept = "-" if r["accepted_fraction"] is None else f"{r['accepted_tokens']}/{r['draft_tokens']}"
        lines.append(f"| {r['output']} | {r['drafts_per_step']} | {r['tokens_per_s']} | {r['verify_steps']} | {kept} | "
                     f"{r['tokens_per_request_step'] or '-'} | {r.get('same_output_as_off', '-')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m worker.bench_speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", choices=["tiny", "llama3-8b-shape"], default="tiny",
                    help="tiny, or Llama-3-8B-shaped with random bf16 weights (CUDA only)")  # fmt: skip
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--batches", default="1,4,16", help="step cost: batch sizes, comma-separated")
    ap.add_argument("--drafts", default="2,4,8", help="step cost: drafts per request, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="step cost: context tokens per request")
    ap.add_argument("--reps", type=int, default=20, help="step cost: timed forwards per cell")
    ap.add_argument("--requests", type=int, default=4, help="end to end: requests decoded together")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="end to end: prompt length")
    ap.add_argument("--max-tokens", type=int, default=256, help="end to end: tokens generated per request")
    ap.add_argument("--spec-tokens", type=int, default=4, help="end to end: drafts per step when on")
    ap.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                    help="the model's dtype (auto: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    ap.add_argument("--cpu-threads", type=int, default=0, help="torch threads on CPU (0 = torch default)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--markdown", help="write the tables as markdown here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from worker.bench import bench_model

    ap = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batches.split(",")]
        drafts = [int(x) for x in a.drafts.split(",")]
    except ValueError:
        ap.error("--batches and --drafts must be comma-separated integers")
    if a.quick:
        batches, drafts, a.context, a.reps, a.requests, a.prompt_tokens, a.max_tokens = (
            [1, 2],
            [2],
            64,
            2,
            2,
            32,
            24,
        )
    sizes = [*batches, *drafts, a.context, a.reps, a.requests, a.prompt_tokens, a.max_tokens, a.spec_tokens]
    if min(sizes) <= 0:
        ap.error("sizes, counts, batch sizes and draft counts must be positive")
    device = bench_device(ap, a.device, a.model, a.cpu_threads)
    t0 = time.perf_counter()
    shape = None if a.model == "tiny" else LLAMA3_8B_SHAPE
    model = bench_model(a.model, device, a.dtype)
    costs = step_costs(model, torch.device(device), batches, drafts, a.context, a.reps)
    vocab = 256 if shape is None else model.config.vocab_size
    del model
    prompts = [Prompts(vocab, seed=i).make(a.prompt_tokens) for i in range(a.requests)]
    cfg = WorkerConfig(model="tiny", device=device, dtype=a.dtype, cpu_threads=a.cpu_threads, warmup_tokens=0,
                       served_model_name=None if shape is None else a.model,
                       kv_cache_tokens=a.requests * (a.prompt_tokens + a.max_tokens + 64) * 2)  # fmt: skip
    runs = []
    # NOTE: grammars need a tokenizer; the shape-only model has none
    for schema in (False, True) if shape is None else (False,):
        off, on = (end_to_end(cfg, shape, prompts, a.max_tokens, k, schema) for k in (0, a.spec_tokens))
        on["same_output_as_off"] = on.pop("_outputs") == off.pop("_outputs")
        runs += [off, on]
    params = {"model": a.model, "device": device, "batches": batches, "drafts": drafts, "context": a.context,
              "reps": a.reps, "requests": a.requests, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
              "spec_tokens": a.spec_tokens, "dtype": a.dtype, "cpu_threads": a.cpu_threads, "quick": a.quick}  # fmt: skip
    doc = {"benchmark": "speculative", "command": " ".join(["python -m worker.bench_speculative", *argv]),
           "model": a.model, "params": params, "machine": machine_info(device), "step_cost": costs,
           "end_to_end": runs, "wall_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    write_results(doc, a.out, a.markdown, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
