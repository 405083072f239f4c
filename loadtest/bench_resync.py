"""`python -m loadtest.bench_resync`: the cost of re-syncing one worker from its cache snapshot in a
prefix index that many workers fill, and what routing waits meanwhile.

The index holds N workers' snapshots (B blocks each: shared system prompts, then conversations as
trees of runs, as a worker's radix cache exports them, each held by ``--holders`` workers). One
worker is re-synced from a snapshot that differs from what the index holds by a small share of its
blocks (leaf runs evicted, as many new blocks cached), yielding to the event loop every 128 runs as
router/event_subscriber.py does, two ways:
- **clear+apply**: ``clear_worker``, then every run's ``apply_stored`` (the router before; run
  from an older checkout with ``--ways clear+apply``, its ``clear_worker`` walks every node);
- **by difference**: ``PrefixIndex.resync_steps`` (the router now).
Reported: the re-sync's CPU alone (no probe); the longest step it held the loop without yielding;
how late a probe route decision (prefix match of a held conversation + ``cache_aware`` select),
due every ``--probe-ms`` on the same loop for ``--window-ms`` from the re-sync's start, answered;
garbage collections in that window. The snapshot's decode (in a thread in the router, for a large
one) is timed apart. One process on this machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.stats import percentile
from router.event_subscriber import _SNAPSHOT_SLICE
from router.kv_events import KVEventBatch, StoredBlocks, decode, encode
from router.policies import Candidate, RouteRequest, make_policy
from router.prefix_index import PrefixIndex

BLOCK_SIZE = 16  # tokens per block
ROOT = 1  # the runs' root parent hash (a namespace's root hash)
SYSTEM_BLOCKS = 64  # a shared system prompt: 1,024 tokens
SYSTEMS = 8


def _ms(values_s: list[float], q: float) -> float:
    """The q-th percentile (0..100, loadtest.report's) of timings in seconds, in ms; 0 for none."""
    value = percentile(values_s, q)
    return 0.0 if value is None else round(value * 1e3, 3)


class _Fleet:
    """Every worker's snapshot runs (parents before children), drawn at random: all system prompts,
    then conversations (trees of runs under a system prompt), each held by ``holders`` workers."""

    def __init__(self, workers: int, blocks: int, run_blocks: int, holders: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.run_blocks = run_blocks
        systems = [StoredBlocks(self._hashes(SYSTEM_BLOCKS), ROOT, []) for _ in range(SYSTEMS)]
        self.runs = {f"http://worker-{i}:8000": list(systems) for i in range(workers)}
        held = dict.fromkeys(self.runs, SYSTEMS * SYSTEM_BLOCKS)
        while min(held.values()) < blocks:
            conversation = [self._run(self.rng.choice(systems).block_hashes[-1])]
            while sum(len(r.block_hashes) for r in conversation) < 20 * run_blocks:  # a turn after a run
                conversation.append(self._run(self.rng.choice(conversation).block_hashes[-1]))
            first = min(held, key=held.__getitem__)
            others = self.rng.sample([u for u in self.runs if u != first], min(holders, workers) - 1)
            for url in [first, *others]:
                self.runs[url] += conversation
                held[url] += sum(len(r.block_hashes) for r in conversation)

    def _hashes(self, n: int) -> list[int]:
        return [self.rng.getrandbits(64) for _ in range(n)]

    def _run(self, parent: int) -> StoredBlocks:
        n = self.rng.randint(1, 2 * self.run_blocks - 1)  # mean run_blocks
        return StoredBlocks(self._hashes(n), parent, [])

    def changed(self, runs: list[StoredBlocks], share: float) -> list[StoredBlocks]:
        """``runs`` after the worker evicted leaf runs of about ``share`` of its blocks and cached as
        many new blocks (new turns)."""
        total = sum(len(r.block_hashes) for r in runs)
        parents = {r.parent_hash for r in runs}
        leaves = [i for i, r in enumerate(runs) if r.block_hashes[-1] not in parents and i >= SYSTEMS]
        self.rng.shuffle(leaves)
        gone: set[int] = set()
        dropped = 0
        for i in leaves:
            if dropped >= share * total:
                break
            gone.add(i)
            dropped += len(runs[i].block_hashes)
        kept = [r for i, r in enumerate(runs) if i not in gone]
        added = 0
        while added < dropped:
            kept.append(self._run(self.rng.choice(kept).block_hashes[-1]))
            added += len(kept[-1].block_hashes)
        return kept


def _conversation(runs: list[StoredBlocks], rng: random.Random) -> list[int]:
    """The block hashes from the root down to a random run of ``runs`` (a held prompt)."""
    by_last = {r.block_hashes[-1]: r for r in runs}
    run = rng.choice(runs)
    path = [run]
    while path[-1].parent_hash in by_last:
        path.append(by_last[path[-1].parent_hash])
    return [h for r in reversed(path) for h in r.block_hashes]


def _resync_steps(index: PrefixIndex, worker: str, runs: list[StoredBlocks], way: str):
    """The re-sync as the event subscriber runs it: yields between steps (where it awaits)."""
    if way == "by difference":
        yield from index.resync_steps(worker, runs, _SNAPSHOT_SLICE)
        return
    index.clear_worker(worker)
    for start in range(0, len(runs), _SNAPSHOT_SLICE):
        if start:
            yield
        for run in runs[start : start + _SNAPSHOT_SLICE]:
            index.apply_stored(worker, run.parent_hash, run.block_hashes)


class _GcWatch:
    """Garbage collections (count, total and longest pause, seconds) while active."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)

    def __enter__(self) -> _GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def _probed(index: PrefixIndex, steps, prompts: list[list[int]], urls: list[str], probe_s: float,
                  window_s: float) -> dict:  # fmt: skip
    """Run ``steps`` (None: nothing) beside a probe route decision due every ``probe_s``, for
    ``window_s`` from the re-sync's start or until it ends if later; returns how late each probe
    answered (s), the re-sync's wall time and its longest step (the event loop blocked, s)."""
    policy = make_policy("cache_aware", index)
    rng = random.Random(0)
    late: list[float] = []
    longest = wall = 0.0
    done = asyncio.Event()

    async def resync() -> None:
        nonlocal longest, wall
        t0 = step0 = time.perf_counter()
        for _ in steps or ():
            longest = max(longest, time.perf_counter() - step0)
            await asyncio.sleep(0)
            step0 = time.perf_counter()
        now = time.perf_counter()
        longest, wall = max(longest, now - step0), now - t0
        done.set()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + window_s
        while not done.is_set() or loop.time() < end:
            due = loop.time() + probe_s
            await asyncio.sleep(probe_s)
            hashes = rng.choice(prompts)
            cands = [Candidate(u, float(rng.randrange(3))) for u in urls]
            policy.select(RouteRequest(hashes, len(hashes) * BLOCK_SIZE, BLOCK_SIZE), cands)
            late.append(loop.time() - due)

    with _GcWatch() as watch:
        await asyncio.gather(probe(), resync())
    return {"late": late, "wall_s": wall, "longest_step_s": longest, "gc": watch.pauses}


def run_case(workers: int, blocks: int, run_blocks: int, holders: int, share: float, repeats: int, probe_ms: float,
             window_ms: float, seed: int, ways: list[str]) -> dict[str, Any]:  # fmt: skip
    fleet = _Fleet(workers, blocks, run_blocks, holders, seed)
    index = PrefixIndex()
    for url, runs in fleet.runs.items():
        for run in runs:
            index.apply_stored(url, run.parent_hash, run.block_hashes)
    urls = list(fleet.runs)
    target = urls[0]
    before = fleet.runs[target]
    after = fleet.changed(before, share)
    rng = random.Random(seed)
    prompts = [_conversation(fleet.runs[rng.choice(urls)], rng) for _ in range(256)]
    raw = encode(KVEventBatch(target, "e", 0, 0.0, BLOCK_SIZE, [
        StoredBlocks(r.block_hashes, r.parent_hash, [rng.randrange(150_000) for _ in range(len(r.block_hashes) * BLOCK_SIZE)])
        for r in after
    ]))  # fmt: skip
    decode_cpu, decode_gc = [], []
    for _repeat in range(3):
        gc.collect()
        with _GcWatch() as watch:
            t0 = time.process_time()
            decode(raw)
            decode_cpu.append(time.process_time() - t0)
        decode_gc.append(sum(watch.pauses))
    gc.collect()
    nodes = index._nodes
    window_s = window_ms / 1e3
    idle = asyncio.run(_probed(index, None, prompts, urls, probe_ms / 1e3, window_s))
    got: dict[str, dict[str, list[float]]] = {
        w: {"cpu": [], "late": [], "wall": [], "step": [], "gc": []} for w in ways
    }
    for _repeat in range(
        repeats
    ):  # NOTE: the ways take turns, so drift in the machine's load hits each alike
        for way in ways:
            # each repeat re-syncs to the changed snapshot and back, so both ways see the same states
            for runs in (after, before):
                gc.collect()
                t0 = time.process_time()
                for _ in _resync_steps(index, target, runs, way):
                    pass
                got[way]["cpu"].append(time.process_time() - t0)
            for runs in (after, before):
                gc.collect()
                probed = asyncio.run(_probed(index, _resync_steps(index, target, runs, way), prompts, urls,
                                             probe_ms / 1e3, window_s))  # fmt: skip
                got[way]["late"] += probed["late"]
                got[way]["wall"].append(probed["wall_s"])
                got[way]["step"].append(probed["longest_step_s"])
                got[way]["gc"] += probed["gc"]
    rows: dict[str, Any] = {}
    for way, g in got.items():
        rows[way] = {
            "resync_cpu_s_median": round(statistics.median(g["cpu"]), 4),
            "resync_cpu_s_min": round(min(g["cpu"]), 4),
            "resync_cpu_s_max": round(max(g["cpu"]), 4),
            "resync_wall_s_median_probed": round(statistics.median(g["wall"]), 4),
            "longest_step_ms_median": _ms(g["step"], 50),  # the event loop blocked by one step
            "longest_step_ms_max": _ms(g["step"], 100),
            "probes": len(g["late"]),
            "probe_late_p50_ms": _ms(g["late"], 50),
            "probe_late_p99_ms": _ms(g["late"], 99),
            "probe_late_max_ms": _ms(g["late"], 100),
            "gc_collections": len(g["gc"]),
            "gc_pause_total_ms": round(sum(g["gc"]) * 1e3, 2),
            "gc_pause_max_ms": round(max(g["gc"], default=0.0) * 1e3, 2),
        }
    changed = len({h for r in after for h in r.block_hashes} ^ {h for r in before for h in r.block_hashes})
    return {
        "workers": workers,
        "blocks_per_worker": blocks,
        "mean_run_blocks": run_blocks,
        "holders_per_conversation": holders,
        "snapshot_runs": len(after),
        "blocks_changed": changed,  # dropped + added, of the re-synced worker's blocks
        "index_entries": index.num_entries,
        "index_nodes": nodes,
        "snapshot_bytes": len(raw),
        "decode_cpu_s_median": round(statistics.median(decode_cpu), 4),  # gc pauses inside it included
        "decode_gc_ms_median": round(statistics.median(decode_gc) * 1e3, 2),
        "repeats": repeats,
        "idle_probe_late_p50_ms": _ms(idle["late"], 50),
        "idle_probe_late_p99_ms": _ms(idle["late"], 99),
        "idle_probe_late_max_ms": _ms(idle["late"], 100),
        "ways": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_resync", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--cases", default="32x20000,8x5000", help="WORKERSxBLOCKS per worker, comma-separated"
    )
    parser.add_argument("--run-blocks", type=int, default=4, help="mean blocks per snapshot run")
    parser.add_argument("--holders", type=int, default=2, help="workers holding each conversation")
    parser.add_argument(
        "--change", type=float, default=0.02, help="share of the worker's blocks evicted (and as many added)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="re-syncs to the changed snapshot and back, per way"
    )
    parser.add_argument(
        "--probe-ms", type=float, default=1.0, help="a probe route decision due every this many ms"
    )
    parser.add_argument(
        "--window-ms",
        type=float,
        default=200.0,
        help="probe for this long from a re-sync's start (or to its end)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ways",
        default="clear+apply,by difference",
        help="comma-separated; an older checkout has clear+apply only",
    )
    parser.add_argument("--out", default="resync.json")  # NOTE: docs/benchmarks' only when named
    args = parser.parse_args(argv)  # fmt: skip
    ways = args.ways.split(",")
    load_at_start = os.getloadavg()[0]
    cases = []
    for spec in args.cases.split(","):
        w, b = (int(x) for x in spec.lower().split("x"))
        case = (w, b, args.run_blocks, args.holders, args.change, args.repeats, args.probe_ms, args.window_ms)
        cases.append(run_case(*case, args.seed, ways))
    load_at_end = os.getloadavg()[0]
    report = {
        "benchmark": "resync",
        "what": "re-sync of one worker from its snapshot in a full prefix index: CPU, and a probe route "
        "decision's lateness on the same event loop meanwhile; clear+apply (before) vs by difference (now)",
        "snapshot_slice_runs": _SNAPSHOT_SLICE,
        "change_share": args.change,
        "probe_every_ms": args.probe_ms,
        "probe_window_ms": args.window_ms,
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": round(load_at_start, 2),
            "load_average_1m_at_end": round(load_at_end, 2),
        },
        "cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    print(
        f"load average (1 min): {load_at_start:.2f} at start, {load_at_end:.2f} at end, {os.cpu_count()} CPUs"
    )
    print()
    print("| workers x blocks | index nodes | blocks changed | way | re-sync CPU ms (median) | longest step ms "
          "(median / max) | probe late p50 / p99 / max ms | gc during re-syncs: count, total ms |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for c in cases:
        print(f"| {c['workers']} x {c['blocks_per_worker']} | {c['index_nodes']} | {c['blocks_changed']} | idle | | "
              f"| {c['idle_probe_late_p50_ms']} / {c['idle_probe_late_p99_ms']} / {c['idle_probe_late_max_ms']} | |")  # fmt: skip
        for way, r in c["ways"].items():
            print(
                f"| {c['workers']} x {c['blocks_per_worker']} | {c['index_nodes']} | {c['blocks_changed']} | {way} "
                f"| {r['resync_cpu_s_median'] * 1e3:.1f} | {r['longest_step_ms_median']} / {r['longest_step_ms_max']} "
                f"| {r['probe_late_p50_ms']} / {r['probe_late_p99_ms']} / {r['probe_late_max_ms']} "
                f"| {r['gc_collections']}, {r['gc_pause_total_ms']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
