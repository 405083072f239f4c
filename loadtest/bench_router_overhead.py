"""Router overhead: latency and throughput through the router versus straight to the backend.

Starts an echo backend (loadtest/echo_backend.py, no simulated delay) and a router in front of it
as real processes on loopback, then runs closed-loop load at several concurrencies, stream and
non-stream, against both. Writes JSON and prints a markdown table.

    python -m loadtest.bench_router_overhead --out docs/benchmarks/router-overhead.json

``--fleet N`` gives the router N workers (one echo backend process serving N ports, each a backend
with its own cache): what a large fleet costs per request (candidates, policy, health checks
running meanwhile). The router's CPU per request (its /proc times over a routed run) is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import aiohttp

from loadtest.report import percentile
from router.launcher import free_port, stop_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "You are a helpful assistant. " * 40  # ~1.1 KiB


def start(args: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{args} did not start")


async def run_load(url: str, concurrency: int, requests: int, stream: bool) -> dict:
    """Closed loop: `concurrency` clients each send requests back to back."""
    body = {"model": "echo", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = sent = 0
    remaining = requests
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(i: int) -> None:
            nonlocal remaining, errors, sent
            payload = json.dumps({**body, "prompt": f"{i} " + PROMPT}).encode()  # per-client prefix
            while remaining > 0:
                remaining -= 1
                sent += 1
                t0 = time.perf_counter()
                async with session.post(url + "/v1/completions", data=payload) as resp:
                    first = None
                    async for _ in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                end = time.perf_counter()
                if resp.status != 200:  # NOTE: a failed answer is counted, not timed
                    errors += 1
                    continue
                latencies.append(end - t0)
                ttfts.append((first or end) - t0)

        await asyncio.gather(*(client(i) for i in range(concurrency)))  # warm-up round
        latencies.clear()
        ttfts.clear()
        remaining, errors = requests, 0
        t_start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - t_start
    if not latencies:
        raise RuntimeError(f"{url}: all {errors} requests failed")
    return {
        "requests": len(latencies),
        "errors": errors,
        "sent": sent,  # the warm-up round's too
        "req_per_s": len(latencies) / wall,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def routed_load(url: str, pid: int, concurrency: int, requests: int, stream: bool) -> dict:
    """``run_load`` through the router, with the router's CPU time per request."""
    before = cpu_seconds(pid)
    result = asyncio.run(run_load(url, concurrency, requests, stream))
    result["router_cpu_ms_per_request"] = (cpu_seconds(pid) - before) * 1e3 / result["sent"]
    return result


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def median_of(runs: list[dict]) -> dict:
    """Per-field median over repeated runs of the same point."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests", type=int, default=1000, help="per measurement and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating direct/router runs per point")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument(
        "--fleet", type=int, default=1, help="workers behind the router (ports of one echo backend)"
    )
    p.add_argument("--out", default="router-overhead.json")  # NOTE: docs/benchmarks' file only when named
    args = p.parse_args()
    if args.fleet < 1:
        p.error("--fleet must be at least 1")
    *ports, router_port = free_ports(args.fleet + 1)
    backend_port = ports[0]
    more = ["--more-ports", ",".join(map(str, ports[1:]))] if args.fleet > 1 else []
    backend = start(["-m", "loadtest.echo_backend", "--port", str(backend_port), *more], ports[-1])
    workers = ",".join(f"http://127.0.0.1:{port}" for port in ports)
    router = start(
        ["-m", "router", "--port", str(router_port), "--workers", workers, "--policy", args.policy,
         "--log-level", "warning"],
        router_port,
    )  # fmt: skip
    rows = []
    try:
        for stream in (False, True):
            for c in (int(x) for x in args.concurrency.split(",")):
                # Direct and routed runs alternate, `rounds` times; each figure is the median over
                # rounds, so one noisy stretch on a shared machine does not decide a row.
                directs, routeds = [], []
                for _ in range(args.rounds):
                    directs.append(
                        asyncio.run(run_load(f"http://127.0.0.1:{backend_port}", c, args.requests, stream))
                    )
                    routeds.append(
                        routed_load(f"http://127.0.0.1:{router_port}", router.pid, c, args.requests, stream)
                    )
                direct, routed = median_of(directs), median_of(routeds)
                rows.append(
                    {
                        "stream": stream,
                        "concurrency": c,
                        "direct": direct,
                        "router": routed,
                        "rounds": {"direct": directs, "router": routeds},
                    }
                )
                print(f"stream={stream} c={c}: direct {direct['p50_ms']:.2f} ms, router {routed['p50_ms']:.2f} ms",
                      file=sys.stderr)  # fmt: skip
    finally:
        stop_processes([router, backend])
    result = {
        "benchmark": "router-overhead",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (client, router and backend share them)",
        "python": platform.python_version(),
        "policy": args.policy,
        "fleet": args.fleet,
        "requests_per_point": args.requests,
        "rounds": args.rounds,
        "prompt_bytes": len(PROMPT) + 4,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"fleet of {args.fleet} worker(s), policy {args.policy}")
    print("| stream | conc | direct p50 ms | router p50 ms | added p50 ms | added p99 ms | added TTFT p50 ms |"
          " direct req/s | router req/s | router CPU ms/req |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, x = r["direct"], r["router"]
        print(
            f"| {'yes' if r['stream'] else 'no'} | {r['concurrency']} | {d['p50_ms']:.2f} | {x['p50_ms']:.2f} | "
            f"{x['p50_ms'] - d['p50_ms']:.2f} | {x['p99_ms'] - d['p99_ms']:.2f} | "
            f"{x['ttft_p50_ms'] - d['ttft_p50_ms']:.2f} | {d['req_per_s']:.0f} | {x['req_per_s']:.0f} | "
            f"{x['router_cpu_ms_per_request']:.3f} |"
        )


if __name__ == "__main__":
    main()
