"""Radix cache microbenchmark: match and insert latency (µs) for 1k- and 32k-token prompts, on CPU.

`python -m worker.bench_radix [--out PATH]` prints a table and writes JSON; it never touches a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache

PAGE_SIZE = 16
SIZES = (1024, 32768)  # tokens
OTHER_PROMPTS = 256  # unrelated cached prompts, so the tree is not a single path


def _time_us(fn: Callable[[], None], setup: Callable[[], None] | None, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def _base_cache(events: bool, rng: np.random.Generator) -> tuple[PageAllocator, RadixCache]:
    """A tree of prompts sharing a system prompt, all locked (as if their requests were running),
    so that ``flush()`` removes only what a measurement inserted."""
    alloc = PageAllocator(16384)
    cache = RadixCache(alloc, PAGE_SIZE, "bench-model", enable_events=events)
    system = rng.integers(0, 128_000, size=512, dtype=np.int32)
    for _ in range(OTHER_PROMPTS):
        tokens = np.concatenate([system, rng.integers(0, 128_000, size=512, dtype=np.int32)])
        pages = alloc.alloc(tokens.size // PAGE_SIZE)
        done = cache.insert(tokens, pages) // PAGE_SIZE
        alloc.free(pages[:done])
        cache.lock(cache.match_prefix(np.append(tokens, np.int32(0))).last_node)
    cache.drain_events()
    return alloc, cache


def _stats(op: str, size: int, events: bool, samples: list[float]) -> dict:
    return {
        "op": op,
        "tokens": size,
        "events": events,
        "median_us": round(float(np.median(samples)), 2),
        "p90_us": round(float(np.percentile(samples, 90)), 2),
        "iters": len(samples),
    }


def _measure(
    alloc: PageAllocator, cache: RadixCache, size: int, events: bool, iters: int, rng: np.random.Generator
) -> list[dict]:
    prompt = rng.integers(0, 128_000, size=size, dtype=np.int32)
    query = np.append(prompt, np.int32(1))  # one token past the cached prompt
    miss = rng.integers(0, 128_000, size=size + 1, dtype=np.int32)
    held: list[np.ndarray] = []

    def fresh_pages() -> None:
        cache.flush()  # NOTE: only the measured prompt is unlocked, so only it goes
        cache.drain_events()
        held[:] = [alloc.alloc(size // PAGE_SIZE)]

    out = [
        _stats(
            "insert_new", size, events, _time_us(lambda: cache.insert(prompt, held[0]), fresh_pages, iters)
        ),
        _stats("insert_cached", size, events, _time_us(lambda: cache.insert(prompt, held[0]), None, iters)),
        _stats("match_hit", size, events, _time_us(lambda: cache.match_prefix(query), None, iters)),
        _stats("match_miss", size, events, _time_us(lambda: cache.match_prefix(miss), None, iters)),
    ]
    assert cache.match_prefix(query).num_tokens == size
    cache.check_invariants()
    cache.flush()
    return out


def run(iters: int, seed: int = 0) -> list[dict]:
    """insert_new: a prompt the tree has never seen (hashing included when events are on);
    insert_cached: the same prompt again; match_hit: prompt + 1 token; match_miss: unrelated."""
    rng = np.random.default_rng(seed)
    results = []
    for events in (True, False):
        alloc, cache = _base_cache(events, rng)
        for size in SIZES:
            results.extend(_measure(alloc, cache, size, events, iters, rng))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/benchmarks/radix-cache-cpu.json")
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    results = run(args.iters)
    print(f"{'op':<14}{'tokens':>8}{'events':>8}{'median µs':>12}{'p90 µs':>10}")
    for r in results:
        print(f"{r['op']:<14}{r['tokens']:>8}{r['events']!s:>8}{r['median_us']:>12.1f}{r['p90_us']:>10.1f}")
    doc = {
        "benchmark": "radix-cache-cpu",
        "command": "python -m worker.bench_radix",
        "page_size": PAGE_SIZE,
        "other_cached_prompts": OTHER_PROMPTS,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "results": results,
    }
    out_dir = os.path.dirname(args.out)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
