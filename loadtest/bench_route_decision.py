"""Route-decision latency: block hashing + prefix-index match + cache_aware select + insert.

``python -m loadtest.bench_route_decision`` times 32 KiB prompts (bytes tokenizer: token id =
UTF-8 byte) against a warm index for 16, 64 and 256 workers, plus 16 workers under a budget small
enough that every insert evicts; prints a table, writes JSON. It measures one process on this
machine's CPU; it must never be read as a fleet benchmark.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from router.block_hash import block_hashes
from router.policies import Candidate, RouteRequest, make_policy
from router.prefix_index import PrefixIndex

BLOCK_SIZE = 16  # tokens per block (the workers' default)
PROMPT_BYTES = 32 * 1024  # bytes = tokens with the bytes tokenizer
SYSTEM_BYTES = 4 * 1024  # shared system prompts at the head of every conversation
TURN_BYTES = 512  # the new user turn at the tail: the part no worker holds yet
COLD_SHARE = 0.1  # share of measured requests that are brand-new 32 KiB prompts


_PRINTABLE = bytes(32 + b % 95 for b in range(256))  # random bytes -> printable ASCII


def _text(rng: random.Random, n: int) -> bytes:
    return rng.randbytes(n).translate(_PRINTABLE)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_case(workers: int, iterations: int, seed: int, budget: int = 2_000_000) -> dict[str, Any]:
    """Warm an index with conversations routed by cache_aware, then time fresh decisions."""
    rng = random.Random(seed)
    urls = [f"http://worker-{i}:8000" for i in range(workers)]
    index = PrefixIndex(max_entries=budget)  # (block, worker) entries; the router's default is 2M
    policy = make_policy("cache_aware", index)
    systems = [_text(rng, SYSTEM_BYTES) for _ in range(4)]
    # Conversations: a system prompt + a long unique history; each request adds a new turn.
    histories = [
        rng.choice(systems) + _text(rng, PROMPT_BYTES - SYSTEM_BYTES - TURN_BYTES) for _ in range(2 * workers)
    ]

    def candidates() -> list[Candidate]:
        # Loads jitter inside cache_aware's default window (2.0): a holder is usually admissible.
        return [Candidate(u, float(rng.randrange(0, 3))) for u in urls]

    def decide(prompt: bytes) -> tuple[int, int, int, int]:
        """One decision, timed in parts (ns): hashing, select (its own match included), insert on
        route; plus a standalone match of the same hashes just before select (not in the total)."""
        cands = candidates()
        t0 = time.perf_counter_ns()
        tokens = list(prompt)
        hashes = block_hashes(tokens, BLOCK_SIZE)
        t1 = time.perf_counter_ns()
        index.match(hashes)
        t2 = time.perf_counter_ns()
        req = RouteRequest(hashes, len(tokens), BLOCK_SIZE)
        decision = policy.select(req, cands)
        t3 = time.perf_counter_ns()
        policy.on_routed(req, decision.url)
        t4 = time.perf_counter_ns()
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    for history in histories:  # warm: every conversation is held somewhere
        decide(history + _text(rng, TURN_BYTES))
    for _ in range(200):  # plus cold traffic so the index holds more than the conversations
        decide(_text(rng, PROMPT_BYTES))
    kinds = ["cold" if rng.random() < COLD_SHARE else "warm" for _ in range(iterations)]
    prompts = [
        _text(rng, PROMPT_BYTES) if kind == "cold" else rng.choice(histories) + _text(rng, TURN_BYTES)
        for kind in kinds
    ]
    gc.collect()
    hash_ns, match_ns, select_ns, insert_ns, rest_ns, total_ns = [], [], [], [], [], []
    by_kind: dict[str, list[int]] = {"warm": [], "cold": []}
    for kind, prompt in zip(kinds, prompts, strict=True):
        h, m, s, i = decide(prompt)
        hash_ns.append(h)
        match_ns.append(m)
        select_ns.append(s)
        insert_ns.append(i)
        rest_ns.append(s + i)
        total_ns.append(h + s + i)
        by_kind[kind].append(h + s + i)

    def ms(values: list[int], q: float) -> float:
        return round(_percentile(values, q) / 1e6, 4)

    return {
        "workers": workers,
        "budget_entries": budget,
        "iterations": iterations,
        "p50_ms": ms(total_ns, 0.50),
        "p99_ms": ms(total_ns, 0.99),
        "mean_ms": round(statistics.fmean(total_ns) / 1e6, 4),
        "max_ms": round(max(total_ns) / 1e6, 4),
        "warm_p50_ms": ms(by_kind["warm"], 0.50),  # conversation turn: prefix held, 32 new blocks
        "warm_p99_ms": ms(by_kind["warm"], 0.99),
        "cold_p50_ms": ms(by_kind["cold"], 0.50),  # brand-new prompt: 2048 new entries inserted
        "cold_p99_ms": ms(by_kind["cold"], 0.99),
        "hash_p50_ms": ms(hash_ns, 0.50),
        "hash_p99_ms": ms(hash_ns, 0.99),
        "match_p50_ms": ms(match_ns, 0.50),  # standalone, the same work select does first
        "match_p99_ms": ms(match_ns, 0.99),
        "select_p50_ms": ms(select_ns, 0.50),  # cache_aware select, its match included
        "select_p99_ms": ms(select_ns, 0.99),
        "insert_p50_ms": ms(insert_ns, 0.50),  # insert on route, eviction included
        "insert_p99_ms": ms(insert_ns, 0.99),
        "index_policy_p50_ms": ms(rest_ns, 0.50),
        "index_policy_p99_ms": ms(rest_ns, 0.99),
        "index_entries": index.num_entries,
        "index_blocks": index.num_nodes,
    }


def measure_memory(blocks: int = 100_000) -> dict[str, float]:
    """Bytes per (block, worker) entry: blocks held by one worker, then a second worker on them."""
    rng = random.Random(1)
    hashes = block_hashes(list(_text(rng, blocks * BLOCK_SIZE)), BLOCK_SIZE)
    tracemalloc.start()
    index = PrefixIndex(max_entries=10 * blocks)
    base = tracemalloc.get_traced_memory()[0]
    index.insert("http://a", hashes)
    one = tracemalloc.get_traced_memory()[0]
    index.insert("http://b", hashes)
    two = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "bytes_per_entry_first_worker": round((one - base) / blocks, 1),
        "bytes_per_entry_extra_worker": round((two - one) / blocks, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256", help="comma-separated worker counts")
    parser.add_argument("--iterations", type=int, default=1000, help="timed decisions per worker count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pressure-budget",
        type=int,
        default=250_000,
        help="extra 16-worker case with this (block, worker) budget, below its working set; 0 = skip",
    )
    parser.add_argument("--out", default="docs/benchmarks/route-decision.json")
    args = parser.parse_args(argv)

    load_at_start = os.getloadavg()[0]
    memory = measure_memory()
    cases = [run_case(int(w), args.iterations, args.seed) for w in args.workers.split(",")]
    if args.pressure_budget:
        cases.append(run_case(16, args.iterations, args.seed, budget=args.pressure_budget))
    load_at_end = os.getloadavg()[0]
    header = (
        f"{'workers':>8} {'budget':>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'cold p99':>8} "
        f"{'hash p50/p99':>13} {'match p50/p99':>14} {'select p50/p99':>15} {'insert p50/p99':>15} {'entries':>8}"
    )
    print(f"route decision, {PROMPT_BYTES // 1024} KiB prompt, block {BLOCK_SIZE}, cache_aware, warm index")
    print(header)
    for c in cases:
        parts = " ".join(
            f"{c[f'{p}_p50_ms']:>{w - 7}.3f}/{c[f'{p}_p99_ms']:.3f}"
            for p, w in (("hash", 14), ("match", 15), ("select", 16), ("insert", 16))
        )
        print(
            f"{c['workers']:>8} {c['budget_entries']:>9} {c['p50_ms']:>7.3f} {c['p99_ms']:>7.3f} "
            f"{c['max_ms']:>7.2f} {c['cold_p99_ms']:>8.3f} {parts} {c['index_entries']:>8}"
        )
    print(
        f"load average (1 min): {load_at_start:.2f} at start, {load_at_end:.2f} at end, {os.cpu_count()} CPUs"
    )
    print(
        f"memory: {memory['bytes_per_entry_first_worker']} B/entry (first worker on a block), "
        f"{memory['bytes_per_entry_extra_worker']} B/entry (each extra worker)"
    )
    report = {
        "benchmark": "route_decision",
        "what": "block hashing + prefix index match + cache_aware select + insert, one decision",
        "index": "radix tree with compressed edges (router/prefix_index.py)",
        "prompt_bytes": PROMPT_BYTES,
        "tokenizer": "bytes",
        "block_size": BLOCK_SIZE,
        "cold_share": COLD_SHARE,
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": round(load_at_start, 2),  # other processes share the CPUs
            "load_average_1m_at_end": round(load_at_end, 2),
        },
        "cases": cases,
        "memory": memory,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
