"""Route-decision latency: block hashing (as far as needed) + prefix-index match + cache_aware select.

Timed the way the router runs it (router/gateway.py): the decision reads block hashes lazily
(router.block_hash.PromptHashes with the router's span memo), and the rest of the hashing plus the
optimistic insert run after the request is sent; both parts are reported.

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

from loadtest.stats import percentile
from router.block_hash import PromptHashes, SpanMemo, block_hashes
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


def _ms(values_ns: list[int], q: float) -> float | None:
    """The q-th percentile (0..100, loadtest.report's) of timings in ns, in ms; None for none."""
    value = percentile(values_ns, q)
    return None if value is None else round(value / 1e6, 4)


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

    memo = SpanMemo()

    def decide(prompt: bytes) -> tuple[int, int, int, int]:
        """One decision as the router makes it, timed in parts (ns): the decision (block hashes
        computed as far as the match reads them, index match, cache_aware select), then what runs
        once the request is on its way (hashing the rest of the prompt, insert on route, eviction);
        plus the number of blocks hashed before the decision."""
        cands = candidates()
        t0 = time.perf_counter_ns()
        hashes = PromptHashes(prompt, BLOCK_SIZE, "", memo)
        req = RouteRequest(hashes, len(prompt), BLOCK_SIZE)
        decision = policy.select(req, cands)
        t1 = time.perf_counter_ns()
        hashed = hashes.computed()
        policy.on_routed(req, decision.url)
        t2 = time.perf_counter_ns()
        return t1 - t0, t2 - t1, hashed, len(hashes)

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
    decision_ns, after_ns, total_ns, hashed_share = [], [], [], []
    by_kind: dict[str, list[int]] = {"warm": [], "cold": []}
    for kind, prompt in zip(kinds, prompts, strict=True):
        d, a, hashed, blocks = decide(prompt)
        decision_ns.append(d)
        after_ns.append(a)
        total_ns.append(d + a)
        hashed_share.append(hashed / blocks)
        by_kind[kind].append(d)

    return {
        "workers": workers,
        "budget_entries": budget,
        "iterations": iterations,
        "p50_ms": _ms(decision_ns, 50),  # what a request waits for before it is sent
        "p99_ms": _ms(decision_ns, 99),
        "mean_ms": round(statistics.fmean(decision_ns) / 1e6, 4),
        "max_ms": round(max(decision_ns) / 1e6, 4),
        "warm_p50_ms": _ms(by_kind["warm"], 50),  # conversation turn: prefix held, 32 new blocks
        "warm_p99_ms": _ms(by_kind["warm"], 99),
        "cold_p50_ms": _ms(by_kind["cold"], 50),  # brand-new prompt
        "cold_p99_ms": _ms(by_kind["cold"], 99),
        "after_send_p50_ms": _ms(after_ns, 50),  # rest of the hashing + insert + eviction
        "after_send_p99_ms": _ms(after_ns, 99),
        "cpu_total_p50_ms": _ms(total_ns, 50),  # decision + after-send: router CPU per request
        "cpu_total_p99_ms": _ms(total_ns, 99),
        "blocks_hashed_before_decision_mean": round(statistics.fmean(hashed_share), 3),
        "memo_spans": len(memo),
        "memo_hits": memo.hits,
        "memo_misses": memo.misses,
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


def measure_gc(budget: int, seed: int = 0) -> list[dict[str, Any]]:
    """A full garbage collection's pause over an index filled to ``budget`` entries, for two
    shapes: long conversations (few nodes, long runs) and short prompts under shared system
    prompts, half routed and half stored by worker events (many small nodes). The router pauses
    for this whenever Python runs a full collection."""
    rows = []
    for shape in ("long runs", "short prompts"):
        rng = random.Random(seed)
        index = PrefixIndex(max_entries=budget)
        workers = [f"http://worker-{i}:8000" for i in range(16)]
        systems = [list(_text(rng, 16 * BLOCK_SIZE)) for _ in range(64)]
        while index.num_entries < budget:
            worker = rng.choice(workers)
            if shape == "long runs":
                index.insert(worker, block_hashes(list(_text(rng, 2048 * BLOCK_SIZE)), BLOCK_SIZE))
                continue
            head = rng.choice(systems)[: rng.randrange(1, 17) * BLOCK_SIZE]
            hashes = block_hashes(head + list(_text(rng, rng.randrange(1, 8) * BLOCK_SIZE)), BLOCK_SIZE)
            if rng.random() < 0.5:
                index.insert(worker, hashes)
            else:
                cut = rng.randrange(len(hashes))
                index.apply_stored(worker, hashes[cut - 1] if cut else None, hashes[cut:])
        pauses = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            gc.collect()
            pauses.append((time.perf_counter_ns() - t0) / 1e6)
        rows.append({
            "shape": shape,
            "entries": index.num_entries,
            "blocks": index.num_nodes,
            "nodes": index._nodes,
            "full_gc_ms_median": round(statistics.median(pauses), 1),
            "full_gc_ms_max": round(max(pauses), 1),
        })  # fmt: skip
        del index
        gc.collect()
    return rows


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
    parser.add_argument(
        "--gc-budget",
        type=int,
        default=2_000_000,
        help="time a full garbage collection over an index filled to this many entries; 0 = skip",
    )
    parser.add_argument("--out", default="route-decision.json")  # NOTE: docs/benchmarks' only when named
    args = parser.parse_args(argv)

    load_at_start = os.getloadavg()[0]
    memory = measure_memory()
    cases = [run_case(int(w), args.iterations, args.seed) for w in args.workers.split(",")]
    if args.pressure_budget:
        cases.append(run_case(16, args.iterations, args.seed, budget=args.pressure_budget))
    gc_rows = measure_gc(args.gc_budget, args.seed) if args.gc_budget else []
    load_at_end = os.getloadavg()[0]
    header = (
        f"{'workers':>8} {'budget':>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'warm p99':>8} "
        f"{'cold p99':>8} {'after-send p50/p99':>19} {'cpu p50/p99':>13} {'hashed':>7} {'entries':>8}"
    )
    print(f"route decision, {PROMPT_BYTES // 1024} KiB prompt, block {BLOCK_SIZE}, cache_aware, warm index")
    print(header)
    for c in cases:
        print(
            f"{c['workers']:>8} {c['budget_entries']:>9} {c['p50_ms']:>7.3f} {c['p99_ms']:>7.3f} "
            f"{c['max_ms']:>7.2f} {c['warm_p99_ms']:>8.3f} {c['cold_p99_ms']:>8.3f} "
            f"{c['after_send_p50_ms']:>12.3f}/{c['after_send_p99_ms']:.3f} "
            f"{c['cpu_total_p50_ms']:>7.3f}/{c['cpu_total_p99_ms']:.3f} "
            f"{c['blocks_hashed_before_decision_mean']:>7.2f} {c['index_entries']:>8}"
        )
    print(
        f"load average (1 min): {load_at_start:.2f} at start, {load_at_end:.2f} at end, {os.cpu_count()} CPUs"
    )
    print(
        f"memory: {memory['bytes_per_entry_first_worker']} B/entry (first worker on a block), "
        f"{memory['bytes_per_entry_extra_worker']} B/entry (each extra worker)"
    )
    for row in gc_rows:
        print(
            f"full gc over a full index ({row['shape']}: {row['entries']} entries, {row['nodes']} nodes): "
            f"{row['full_gc_ms_median']} ms median, {row['full_gc_ms_max']} max"
        )
    report = {
        "benchmark": "route_decision",
        "what": "one routing decision (block hashes as far as the match reads them + prefix index match "
        "+ cache_aware select), and the work after the request is sent (rest of the hashes + insert)",
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
        "full_gc": gc_rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
