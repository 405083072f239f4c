"""What penalties, ``logit_bias`` and ``min_tokens`` cost per decode step: worker.penalties.adjust_logits
over a batch of requests that each use all of them, with outputs already ``--outputs`` tokens long
and one token longer at every timed step (as decoding grows them).

``python -m worker.bench_penalties [--device cpu] [--vocab 128256] [--batches 1,16,64]
[--outputs 100,1000,4000] [--out results.json]``

Per step: the call's wall time (on CUDA the host's part: the kernels are only enqueued; with
overlapped steps that is what must stay below the device's step) and, on CUDA, the same call followed
by a synchronize (host and device). On the CPU the tensor ops run inside the call.
Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from worker.bench_report import machine_info, rows_markdown
from worker.penalties import adjust_logits
from worker.sampling import SamplingParams

PROMPT_TOKENS = 512
EVERYTHING = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                            logit_bias={5: 1.0, 17: -2.0}, min_tokens=1, max_tokens=1 << 20)  # fmt: skip


def measure(batch: int, outputs: int, vocab: int, device: torch.device, reps: int) -> dict:
    """Median ms per step of ``batch`` requests whose outputs start ``outputs`` tokens long."""
    rng = random.Random(batch * 7919 + outputs)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    histories = [
        ([rng.randrange(vocab) for _ in range(PROMPT_TOKENS + outputs)], PROMPT_TOKENS, frozenset({2}), {})
        for _ in range(batch)
    ]
    params = [EVERYTHING] * batch

    def step(sync: bool) -> float:
        for ids, *_ in histories:
            ids.append(rng.randrange(vocab))
        start = time.perf_counter()
        adjust_logits(logits, params, histories)
        if sync:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1000.0

    step(device.type == "cuda")  # NOTE: the first call fills each request's memo
    row = {"batch": batch, "output_tokens": outputs, "vocab": vocab,
           "call_ms": round(statistics.median(step(False) for _ in range(reps)), 3)}  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["call_and_device_ms"] = round(statistics.median(step(True) for _ in range(reps)), 3)
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker.bench_penalties", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--outputs", default="100,1000,4000", help="output tokens each request has at the start")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = [
        measure(b, n, args.vocab, device, args.reps)
        for b in (int(x) for x in args.batches.split(","))
        for n in (int(x) for x in args.outputs.split(","))
    ]
    env = machine_info(device.type)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    cols = ["batch", "output_tokens", "call_ms"] + (["call_and_device_ms"] if device.type == "cuda" else [])
    title = f"adjust_logits per decode step, vocabulary {args.vocab:,}, {env['device_name']}"
    print(rows_markdown(rows, cols, title))


if __name__ == "__main__":
    main()
