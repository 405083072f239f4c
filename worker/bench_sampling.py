"""What sampling costs per decode step: worker.sampling.sample over a batch of logits with the
common settings (greedy, temperature, top-p, top-k, both), and the full-vocabulary sort that top-p
needs without the kernels on its own, for the share it takes (on CUDA also the threshold kernel that
replaces that sort above worker.sampling.SORT_MAX_ROWS rows, kernels/sampling.py, and the top-p mask
computed both ways at every batch).

``python -m worker.bench_sampling [--device cpu] [--vocab 128256] [--batches 1,16,64] [--out results.json]``

Per call: wall time (on CUDA the host's part: the kernels are only enqueued) and, on CUDA, the call
followed by a synchronize (host and device), medians over --reps calls after two untimed ones. Prints a
table, on CUDA followed by the largest batch up to which the sorted top-p mask is the faster one (what
SORT_MAX_ROWS is set from; also in the JSON); writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from worker.bench_report import machine_info, median_ms, rows_markdown
from worker.sampling import SORT_MAX_ROWS, SamplingParams, _mask_top_k_top_p, sample

MASK = "top-p 0.9 mask, "  # the rows timing the top-p mask both ways: MASK + "sorted" / "threshold kernel"
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top-k 50": SamplingParams(temperature=0.7, top_k=50),
    "top-k 50, top-p 0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
}


def measure(batch: int, vocab: int, device: torch.device, reps: int) -> list[dict]:
    """One row per setting, and one for the sort alone, at ``batch`` rows of ``vocab`` logits."""
    logits = (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3).to(device)
    calls: dict[str, Callable[[], object]] = {
        name: (lambda p=params: sample(logits, [p] * batch, [None] * batch))
        for name, params in SETTINGS.items()
    }
    calls["sort alone"] = lambda: logits.sort(dim=-1, descending=True)
    if device.type == "cuda":  # NOTE: what top-p alone takes instead of the sort on the kernels
        from kernels import ops

        probs, top_p = logits.softmax(dim=-1), torch.full((batch,), 0.9, device=device)
        calls["top-p threshold kernel alone"] = lambda: ops.top_p_threshold(probs, top_p)
        # the top-p 0.9 mask both ways, whatever the batch (sample() sorts up to SORT_MAX_ROWS rows)
        for name, most in (("sorted", batch), ("threshold kernel", 0)):
            calls[MASK + name] = lambda most=most: _mask_top_k_top_p(
                logits, [-1] * batch, [0.9] * batch, sort_max_rows=most
            )
    rows = []
    for name, fn in calls.items():
        row = {"batch": batch, "vocab": vocab, "setting": name, "call_ms": median_ms(fn, reps)}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            row["call_and_device_ms"] = median_ms(lambda f=fn: (f(), torch.cuda.synchronize(device)), reps)
        rows.append(row)
    return rows


def sorted_mask_wins_up_to(rows: list[dict]) -> int | None:
    """The largest batch up to which the sorted top-p mask beats the threshold kernel's at every batch
    measured (host and device time): what SORT_MAX_ROWS should be; 0 when the kernel wins at the
    smallest; None without both timed (not CUDA)."""
    times: dict[int, dict[str, float]] = {}
    for r in rows:
        if r["setting"].startswith(MASK) and "call_and_device_ms" in r:
            times.setdefault(r["batch"], {})[r["setting"].removeprefix(MASK)] = r["call_and_device_ms"]
    wins = 0
    for batch in sorted(b for b, t in times.items() if len(t) == 2):
        if times[batch]["sorted"] >= times[batch]["threshold kernel"]:
            return wins
        wins = batch
    return wins if times else None


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
    env = machine_info(device.type)
    wins = sorted_mask_wins_up_to(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows, "sorted_mask_wins_up_to": wins}, f, indent=1)
    cols = ["batch", "setting", "call_ms"] + (["call_and_device_ms"] if device.type == "cuda" else [])
    print(
        rows_markdown(rows, cols, f"sample per decode step, vocabulary {args.vocab:,}, {env['device_name']}")
    )
    if wins is not None:
        print(
            f"\nThe sorted top-p mask beats the threshold kernel up to {wins} rows (SORT_MAX_ROWS = {SORT_MAX_ROWS})."
        )


if __name__ == "__main__":
    main()
