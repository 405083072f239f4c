"""`python -m worker.bench_cpu_attention`: the CPU decode attention path on batches of equal and of
mixed context lengths, as one padded computation against grouped by length (worker.attention).

Times one layer of the tiny model's shape (8 query heads, 2 KV heads, head dim 32, float32) over a
pool of random slots; median of repeated runs, after the process settings a CPU worker uses
(worker.assembly.tune_cpu_process). Prints a markdown table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from worker.assembly import tune_cpu_process
from worker.attention import attend_padded, decode_grouped, decode_groups

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32


def batches(seed: int, scale: float) -> dict[str, list[int]]:
    """Context lengths per request of each scenario (``scale`` shrinks them for a quick run)."""
    gen = torch.Generator().manual_seed(seed)

    def n(x: int) -> int:
        return max(1, int(x * scale))

    return {
        "32 x 512 (equal)": [n(512)] * 32,
        "32 x U(100, 4000)": [n(x) for x in torch.randint(100, 4000, (32,), generator=gen).tolist()],
        "1 x 4000 + 31 x 200": [n(4000)] + [n(200)] * 31,
        "64 x U(50, 600)": [n(x) for x in torch.randint(50, 600, (64,), generator=gen).tolist()],
    }


def median_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(pool_slots: int, reps: int, seed: int, scale: float) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(pool_slots, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(pool_slots, KV_HEADS, HEAD_DIM, generator=gen)
    rows = []
    for name, lengths in batches(seed, scale).items():
        indices = torch.randperm(pool_slots, generator=gen)[: sum(lengths)]
        indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=gen)
        starts, lens = indptr[:-1], indptr[1:] - indptr[:-1]

        padded = functools.partial(attend_padded, q, k_cache, v_cache, starts, lens, indices, HEAD_DIM**-0.5)
        grouped = functools.partial(decode_grouped, q, k_cache, v_cache, indptr, indices, HEAD_DIM**-0.5)

        ref = padded()
        err = ((ref - grouped()).norm() / ref.norm()).item()
        rows.append({
            "batch": name, "requests": len(lengths), "tokens": sum(lengths), "padded_tokens":
            len(lengths) * max(lengths), "groups": len(decode_groups(lengths)),
            "padded_ms": round(median_ms(padded, reps), 3), "grouped_ms": round(median_ms(grouped, reps), 3),
            "rel_diff": err,
        })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | context tokens | padded to | groups | one padded ms | grouped ms | speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tokens']:,} | {r['padded_tokens']:,} | {r['groups']} | "
                     f"{r['padded_ms']:.2f} | {r['grouped_ms']:.2f} | {r['padded_ms'] / r['grouped_ms']:.1f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.bench_cpu_attention", description=__doc__)
    ap.add_argument("--pool-slots", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="lengths / 10, 3 repetitions (tests)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path")
    args = ap.parse_args(argv)
    tune_cpu_process(1)
    reps, scale = (3, 0.1) if args.quick else (args.reps, 1.0)
    rows = run(args.pool_slots, reps, args.seed, scale)
    doc = {"command": " ".join(["python -m worker.bench_cpu_attention", *(argv or sys.argv[1:])]),
           "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
           "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}, "rows": rows}  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
