"""`python -m loadtest.bench_replica_sync`: how long one router replica's load change takes to reach
another through replica sync (router/replica_sync.py) over a real Redis.

Two processes, each with a ReplicaSync over a registry of one worker. The sender changes its
in-flight count there (1, 2, 3, ...) at a fixed rate, stamping each change with the monotonic clock
(shared by processes on one machine); the receiver stamps the moment its copy of that worker shows
the count. Reports latency percentiles. Starts a throwaway redis-server on a loopback port when no
--redis-url is given (needs redis-server on PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time

import orjson

from loadtest.report import percentile
from router.circuit_breaker import CircuitBreaker
from router.launcher import free_port, redis_server, stop_processes
from router.replica_sync import ReplicaSync
from router.workers import WorkerRegistry

WORKER = "http://bench-worker:8001"


async def _receiver(redis_url: str, n: int, ready, out) -> None:
    registry = WorkerRegistry(CircuitBreaker, 256.0)
    worker = registry.add(WORKER)
    seen: dict[int, float] = {}
    original = worker.set_peer

    def set_peer(replica: str, in_flight: int, pending: int) -> None:
        original(replica, in_flight, pending)
        seen.setdefault(in_flight, time.monotonic())

    worker.set_peer = set_peer  # type: ignore[method-assign]
    sync = ReplicaSync(registry, redis_url, heartbeat_s=60.0)
    await sync.start()
    await asyncio.sleep(0.5)  # subscribed before the sender starts
    ready.set()
    cpu0 = time.process_time()
    deadline = time.monotonic() + 60
    while len([k for k in seen if k > 0]) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cpu = time.process_time() - cpu0
    await sync.stop()
    out.put(orjson.dumps({"seen": seen, "cpu_s": cpu}, option=orjson.OPT_NON_STR_KEYS))


async def _sender(redis_url: str, n: int, rate: float, ready, out) -> None:
    registry = WorkerRegistry(CircuitBreaker, 256.0)
    worker = registry.add(WORKER)
    sync = ReplicaSync(registry, redis_url, heartbeat_s=60.0)
    await sync.start()
    while not ready.is_set():
        await asyncio.sleep(0.01)
    base0 = time.process_time()  # NOTE: the pacing loop's own CPU, without changes, to subtract
    for _ in range(min(n, 500)):
        await asyncio.sleep(1.0 / rate)
    baseline = (time.process_time() - base0) / min(n, 500)
    sent: dict[int, float] = {}
    cpu0 = time.process_time()
    for i in range(1, n + 1):
        worker.in_flight = i
        sent[i] = time.monotonic()
        worker.changed()
        await asyncio.sleep(1.0 / rate)
    cpu = time.process_time() - cpu0 - baseline * n
    await asyncio.sleep(0.5)
    await sync.stop()
    out.put(orjson.dumps({"sent": sent, "cpu_s": cpu}, option=orjson.OPT_NON_STR_KEYS))


def _run(role: str, *args) -> None:
    asyncio.run((_receiver if role == "receiver" else _sender)(*args))


def measure(redis_url: str, n: int, rate: float) -> dict:
    ctx = mp.get_context("spawn")
    ready, out_r, out_s = ctx.Event(), ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_run, args=("receiver", redis_url, n, ready, out_r))
    sender = ctx.Process(target=_run, args=("sender", redis_url, n, rate, ready, out_s))
    receiver.start()
    sender.start()
    s, r = orjson.loads(out_s.get(timeout=120)), orjson.loads(out_r.get(timeout=120))
    sent = {int(k): v for k, v in s["sent"].items()}
    seen = {int(k): v for k, v in r["seen"].items()}
    for p in (sender, receiver):
        p.join(30)
    lat = [(seen[i] - sent[i]) * 1e3 for i in sent if i in seen]
    return {
        "changes": n,
        "rate_per_s": rate,
        "received": len(lat),
        "latency_ms": {f"p{q}": round(percentile(lat, q) or 0.0, 3) for q in (50, 90, 99)} if lat else None,
        "latency_ms_max": round(max(lat), 3) if lat else None,
        # CPU per change: the sending replica's (announce; its pacing loop's own CPU subtracted) and
        # the receiving one's (apply); a request changes a replica's counts about three times
        "sender_cpu_us_per_change": round(s["cpu_s"] / n * 1e6, 1),
        "receiver_cpu_us_per_change": round(r["cpu_s"] / n * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_replica_sync", description=__doc__)
    p.add_argument("--redis-url", help="default: start a redis-server on a loopback port")
    p.add_argument("--changes", type=int, default=2000)
    p.add_argument("--rate", type=float, default=500.0, help="load changes per second")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    server = None
    url = a.redis_url
    if url is None:
        port = free_port()
        try:
            server = redis_server(port)
        except RuntimeError as exc:
            print(f"error: no --redis-url and {exc}", file=sys.stderr)
            return 2
        url = f"redis://127.0.0.1:{port}/0"
    try:
        result = measure(url, a.changes, a.rate)
    finally:
        if server is not None:
            stop_processes([server])
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    if a.json:
        with open(a.json, "wb") as f:
            f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
