"""What sampling costs per decode step: worker.sampling.sample over a batch of logits with the
common settings (greedy, temperature, top-p, top-k, both), and the full-vocabulary sort that top-p
needs on its own, for the share it takes.

``python -m worker.bench_sampling [--device cpu] [--vocab 128256] [--batches 1,16,64] [--out results.json]``

Per call: wall time (on CUDA the host's part: the kernels are only enqueued) and, on CUDA, the call
followed by a synchronize (host and device), medians over --reps calls. Prints a table last; writes
JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

from worker.sampling import SamplingParams, sample

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50),
    "top-k 50, top-p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def timed(fn: Callable[[], object], device: torch.device, reps: int, sync: bool) -> float:
    """Median ms of ``fn``, with a synchronize inside the timed span when ``sync``."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000.0)
    return round(statistics.median(times), 3)


def measure(batch: int, vocab: int, device: torch.device, reps: int) -> list[dict]:
    """One row per setting, and one for the sort alone, at ``batch`` rows of ``vocab`` logits."""
    logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3).to(device)
    calls: dict[str, Callable[[], object]] = {
        name: (lambda p=params: sample(logits, [p] * batch, [None] * batch))
        for name, params in SETTINGS.items()
    }
    calls["sort alone"] = lambda: logits.sort(dim=-1, descending=True)
    rows = []
    for name, fn in calls.items():
        fn()  # NOTE: warm-up: the first call of each op allocates and picks its kernels
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"batch": batch, "vocab": vocab, "setting": name, "call_ms": timed(fn, device, reps, False)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            row["call_and_device_ms"] = timed(fn, device, reps, True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m worker.bench_sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows = [
        row
        for b in (int(x) for x in args.batches.split(","))
        for row in measure(b, args.vocab, device, args.reps)
    ]
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
           or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads()}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    cols = ["batch", "setting", "call_ms"] + (["call_and_device_ms"] if device.type == "cuda" else [])
    print(f"**sample per decode step, vocabulary {args.vocab:,}, {env['device']}**\n")
    print("| " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|" + "|".join("---" if c == "setting" else "---:" for c in cols) + "|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
