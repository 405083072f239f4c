"""The engine's host time per decode step: `python -m worker.bench_host`.

The real scheduler, radix cache, detokenizers, metrics and output delivery around a forward that
costs nothing (``--engine sim`` with every cost at 0): B requests with C-token prompts decode together,
and once every request has its first token, the wall time per decode step is what the engine's own
Python spends per step. One step at a time (``--overlap off``), a GPU decode step pays it on top of
its kernels (worker.bench's step time against its graph replay shows the same gap).
Sampling is not included (the sim picks tokens without logits).

``--forward-ms F`` models a device that takes F ms per decode step (the sim queues a chained step
behind the running one, as a CUDA stream does); with ``--overlap on`` the engine schedules each
decode step while the one before runs, so a step takes max(F, host) instead of F + host.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from worker.bench_report import machine_info, write_results
from worker.config import WorkerConfig
from worker.sampling import SamplingParams

WARM_TOKENS = 4  # decode tokens before the timed window (allocator growth, first pages)
WINDOW_TRIES = 3  # timed runs per row, the steps doubled after each that left no window (timed_window)


class NoWindow(RuntimeError):
    """Every decode step ran before this loop saw the warm tokens (a busy host): no step was left to time."""


def prompt(i: int, context: int, seed: int) -> list[int]:
    """Request ``i``'s ``context`` prompt tokens: distinct for every request, so nothing is cached."""
    return [(j * 7 + i * 13 + seed) % 250 + 1 for j in range(context)]


async def decode_window(
    engine: Any, batch: int, context: int, steps: int, seed: int, timed: bool = True
) -> dict:
    """B requests of ``context`` prompt tokens, ``WARM_TOKENS + steps`` tokens each; the wall time of
    the decode steps after every request has its first WARM_TOKENS tokens ({} untimed: a warm-up).
    Raises NoWindow when every step ran before the window opened."""
    params = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS + steps, ignore_eos=True)
    warm = asyncio.Event()
    ready = 0

    async def one(i: int) -> None:
        nonlocal ready
        handle = engine.submit(prompt(i, context, seed), params)
        got, counted = 0, False
        while True:
            out = await handle.outputs.get()
            if out.error is not None:
                raise RuntimeError(out.error)
            got += len(out.token_ids)
            if not counted and got >= WARM_TOKENS:
                counted, ready = True, ready + 1
                if ready == batch:
                    warm.set()
            if out.finish_reason is not None:
                return

    def decoded() -> tuple[int, float]:  # NOTE: read on the engine thread, which owns the counters
        return engine.scheduler.stats.decode_tokens, time.perf_counter()

    tasks = [asyncio.ensure_future(one(i)) for i in range(batch)]
    if not timed:
        await asyncio.gather(*tasks)
        return {}
    waiting = asyncio.ensure_future(warm.wait())
    await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if not warm.is_set():  # NOTE: a request ended (or failed) before every one had its warm tokens
        waiting.cancel()
        await asyncio.gather(*tasks)  # raises a request's error
        raise RuntimeError("a request finished before the others' warm-up tokens")
    # NOTE: the window opens when the engine thread reads its counter, which may be some steps after the
    # warm tokens (this loop sees outputs late), and closes once every request has ended
    d0, t0 = await engine.call(decoded)
    await asyncio.gather(*tasks)
    d1, t1 = await engine.call(decoded)
    elapsed, window = t1 - t0, (d1 - d0) / batch  # NOTE: in lockstep: one token each per step
    if window < 1:
        raise NoWindow(f"every decode step ran before the window opened ({steps} steps): raise --steps")
    return {"batch": batch, "context": context, "steps": round(window, 1), "steps_run": steps,
            "ms_per_step": round(elapsed / window * 1e3, 4), "us_per_request_step": round(elapsed / window / batch * 1e6, 2)}  # fmt: skip


def timed_window(engine: Any, batch: int, context: int, steps: int, seed: int) -> dict:
    """decode_window's row, run again with twice the steps after one that left no window (this loop saw the
    warm tokens only after the last step: a busy host), up to WINDOW_TRIES runs; the row's ``steps_run``
    says how many steps each request decoded past its warm tokens."""
    # NOTE: new prompts each try (seed + 1 is the warm-up's): nothing cached
    for attempt in range(WINDOW_TRIES - 1):
        with contextlib.suppress(NoWindow):
            return asyncio.run(decode_window(engine, batch, context, steps << attempt, seed + 2 * attempt))
    last = WINDOW_TRIES - 1
    return asyncio.run(decode_window(engine, batch, context, steps << last, seed + 2 * last))


@contextlib.contextmanager
def sim_engine(forward_ms: float, overlap: str, **cfg: Any) -> Iterator[Any]:
    """A started sim engine whose only cost is ``forward_ms`` per decode step (``cfg``: more
    WorkerConfig fields); stopped on exit."""
    from worker.sim_engine import build_sim_engine

    engine = build_sim_engine(WorkerConfig(engine="sim", sim_prefill_ms_per_token=0.0, sim_decode_base_ms=forward_ms,
                                           sim_decode_ms_per_seq=0.0, sim_host_copy_ms_per_token=0.0,
                                           overlap_schedule=overlap, **cfg))  # fmt: skip
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def run(
    batches: list[int], contexts: list[int], steps: int, seed: int, forward_ms: float = 0.0,
    overlaps: Sequence[str] = ("off",),
) -> list[dict]:  # fmt: skip
    rows = []
    first = True  # NOTE: the first engine also pays imports and first-use setup: run it once untimed
    for context in contexts:
        for batch in batches:
            for overlap in overlaps:
                longest = steps << (WINDOW_TRIES - 1)  # NOTE: timed_window's last try
                size = context + WARM_TOKENS + longest + 64
                with sim_engine(forward_ms, overlap, kv_cache_tokens=batch * size + 4096, sim_context_tokens=size,
                                max_running=max(256, batch), chunked_prefill_tokens=8192) as engine:  # fmt: skip
                    if first:
                        warm_up = decode_window(engine, batch, context, min(steps, 20), seed + 1, timed=False)
                        asyncio.run(warm_up)
                        first = False
                    row = timed_window(engine, batch, context, steps, seed)
                    stats = engine.scheduler.stats  # NOTE: the engine thread is idle now
                    rows.append(
                        row | {"overlap": overlap, "forward_ms": forward_ms, "ahead_steps": stats.ahead_steps}
                    )
                print(rows[-1], file=sys.stderr)
    return rows


async def saturate(engine: Any, requests: int, context: int, output: int, seed: int) -> float:
    """``requests`` distinct ``context``-token prompts sent at once, ``output`` tokens each; seconds
    until the last one finishes."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)

    async def one(i: int) -> None:
        handle = engine.submit(prompt(i, context, seed), params)
        while True:
            out = await handle.outputs.get()
            if out.error is not None:
                raise RuntimeError(out.error)
            if out.finish_reason is not None:
                return

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    return time.perf_counter() - started


def run_saturated(
    requests: int, context: int, output: int, forward_ms: float, max_running: int, kv_tokens: int | None,
    overlaps: Sequence[str], seed: int,
) -> list[dict]:  # fmt: skip
    """A queue deeper than the engine serves at once (``max_running`` or the KV pool): its wall time
    against the modelled device's busy time, one step at a time and overlapped."""
    rows = []
    for overlap in overlaps:
        with sim_engine(forward_ms, overlap, max_running=max_running, kv_cache_tokens=kv_tokens,
                        max_waiting=max(1024, requests)) as engine:  # fmt: skip
            wall = asyncio.run(saturate(engine, requests, context, output, seed))
            stats = engine.scheduler.stats  # NOTE: the engine thread is idle now
            rows.append({"requests": requests, "context": context, "output": output, "max_running": max_running,
                         "kv_cache_tokens": engine.capacity_tokens, "overlap": overlap, "forward_ms": forward_ms,
                         "wall_s": round(wall, 4), "device_s": round(engine.executor.simulated_s, 4),
                         "decode_tokens": stats.decode_tokens, "ahead_steps": stats.ahead_steps})  # fmt: skip
        print(rows[-1], file=sys.stderr)
    return rows


def markdown_saturated(doc: dict) -> str:
    m, rows = doc["machine"], doc["rows"]
    lines = [f"Saturated engine, {rows[0]['requests']} requests at once ({rows[0]['context']}-token prompts, "
             f"{rows[0]['output']} output tokens each; a modelled {rows[0]['forward_ms']} ms device step; "
             f"{m['cpu_model']}, {m['cpu_count']} cores):", "",
             "| max running | KV tokens | overlap | wall s | device s | wall / device | chained steps |",
             "|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['max_running']} | {r['kv_cache_tokens']} | {r['overlap']} | {r['wall_s']} | {r['device_s']} "
                     f"| {r['wall_s'] / r['device_s']:.2f} | {r['ahead_steps']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def markdown(doc: dict) -> str:
    m = doc["machine"]
    rows = doc["rows"]
    contexts = sorted({r["context"] for r in rows})
    keys = sorted({(r["batch"], r.get("overlap", "off")) for r in rows})
    cell = {(r["batch"], r.get("overlap", "off"), r["context"]): r["ms_per_step"] for r in rows}
    forward = max((r.get("forward_ms", 0.0) for r in rows), default=0.0)
    what = f"a modelled {forward} ms device step" if forward else "zero-cost forward"
    lines = [f"Engine time per decode step, ms ({what}; {m['cpu_model']}, {m['cpu_count']} cores, Python {m['python']}):", "",
             "| batch | overlap | " + " | ".join(f"context {c}" for c in contexts) + " |",
             "|---:|---|" + "---:|" * len(contexts)]  # fmt: skip
    for b, o in keys:
        lines.append(f"| {b} | {o} | " + " | ".join(f"{cell.get((b, o, c), '-')}" for c in contexts) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.bench_host", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64,128", help="requests decoding together, comma-separated")
    p.add_argument("--contexts", default="256,2048,8192", help="prompt tokens per request, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps")
    p.add_argument("--forward-ms", type=float, default=0.0, help="modelled device time per decode step (ms)")
    p.add_argument("--overlap", choices=["off", "on", "both"], default="off",
                   help="schedule each decode step while the one before runs (--overlap-schedule)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--saturate", type=int, metavar="REQUESTS",
                   help="instead: REQUESTS prompts (the first --contexts, --steps output tokens each) sent at once "
                        "to an engine that serves --max-running of them (or what --kv-cache-tokens holds)")  # fmt: skip
    p.add_argument("--max-running", type=int, default=256, help="with --saturate: requests served at once")
    p.add_argument("--kv-cache-tokens", type=int, help="with --saturate: the KV pool (default: the sim's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON result path")
    p.add_argument("--markdown")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        parser.error("--batches and --contexts must be comma-separated integers")
    if args.quick:
        batches, contexts, args.steps = [1, 4], [64, 512], 20
    if min(batches + contexts) <= 0 or args.steps <= 0:
        parser.error("batches, contexts and --steps must be positive")
    if args.forward_ms < 0:
        parser.error("--forward-ms must be >= 0")
    if args.saturate is not None and (
        args.saturate <= 0 or args.max_running <= 0 or (args.kv_cache_tokens or 1) <= 0
    ):
        parser.error("--saturate, --max-running and --kv-cache-tokens must be positive")
    started = time.perf_counter()
    overlaps = ("off", "on") if args.overlap == "both" else (args.overlap,)
    if args.saturate is not None:
        rows = run_saturated(args.saturate, contexts[0], args.steps, args.forward_ms, args.max_running,
                             args.kv_cache_tokens, overlaps, args.seed)  # fmt: skip
    else:
        rows = run(batches, contexts, args.steps, args.seed, args.forward_ms, overlaps)
    doc = {"benchmark": "host_step_saturated" if args.saturate else "host_step",
           "command": "python -m worker.bench_host " + " ".join(argv or sys.argv[1:]),
           "machine": machine_info("cpu"), "params": vars(args) | {"batches": batches, "contexts": contexts},
           "rows": rows, "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    write_results(doc, args.out, args.markdown, markdown_saturated(doc) if args.saturate else markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
