"""Which upstream HTTP client should the router use? The same minimal starlette proxy in front of
the echo backend, once per client: httpx's async pool, aiohttp's, and the router's own pooled
client (router/http_client.py); closed-loop load.

    python -m loadtest.bench_http_clients --concurrency 32 --requests 3000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtest.bench_router_overhead import run_load, start
from router.launcher import free_port, stop_processes


def proxy_app(client: str, upstream: str) -> Starlette:
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        if client == "httpx":
            import httpx

            state["c"] = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)
            )
        elif client == "radixgate":
            from router.http_client import HTTPClient

            state["c"] = HTTPClient()
        else:
            import aiohttp

            state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        if client == "httpx":
            await state["c"].aclose()
        elif client == "radixgate":
            state["c"].close()
        else:
            await state["c"].close()

    async def forward(request: Request) -> Response:
        body = await request.body()
        headers = {"content-type": "application/json"}
        if client == "httpx":
            r = await state["c"].post(upstream + "/v1/completions", content=body, headers=headers)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        if client == "radixgate":
            r = await state["c"].post(upstream, "/v1/completions", body, headers)
            try:
                payload = await r.read()
            finally:
                r.close()
            return Response(payload, status_code=r.status, media_type="application/json")
        async with state["c"].post(upstream + "/v1/completions", data=body, headers=headers) as r:
            payload = await r.read()
            return Response(payload, status_code=r.status, media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"ok")

    return Starlette(
        routes=[Route("/v1/completions", forward, methods=["POST"]), Route("/health", health)],
        lifespan=lifespan,
    )


async def client_cpu(upstream: str, requests: int) -> dict[str, float]:
    """CPU (user + system, this process) per request of each client alone: sequential POSTs of a
    1 KiB body, response read whole, keep-alive, after a warm-up."""
    import aiohttp

    from router.http_client import HTTPClient

    body = b'{"model": "echo", "prompt": "' + b"x" * 1024 + b'", "max_tokens": 4}'
    headers = {"content-type": "application/json"}
    out = {}
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
    own = HTTPClient()

    async def via_aiohttp() -> None:
        async with session.post(upstream + "/v1/completions", data=body, headers=headers) as r:
            await r.read()

    async def via_own() -> None:
        r = await own.post(upstream, "/v1/completions", body, headers)
        try:
            await r.read()
        finally:
            r.close()

    try:
        for name, one in (("aiohttp", via_aiohttp), ("radixgate", via_own)):
            for _ in range(100):
                await one()
            cpu = time.process_time()
            for _ in range(requests):
                await one()
            out[name] = (time.process_time() - cpu) / requests * 1e6
    finally:
        await session.close()
        own.close()
    return out


def serve(client: str, upstream: str, port: int) -> None:
    uvicorn.run(
        proxy_app(client, upstream), host="127.0.0.1", port=port, log_level="warning", access_log=False
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--out", default="http-clients.json")  # NOTE: docs/benchmarks' file only when named
    p.add_argument("--serve", nargs=3, metavar=("CLIENT", "UPSTREAM", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return
    backend_port = free_port()
    backend = start(["-m", "loadtest.echo_backend", "--port", str(backend_port)], backend_port)
    upstream = f"http://127.0.0.1:{backend_port}"
    rows = {"backend alone": asyncio.run(run_load(upstream, args.concurrency, args.requests, False))}
    cpu = asyncio.run(client_cpu(upstream, args.requests))
    try:
        for client in ("httpx", "aiohttp", "radixgate"):
            port = free_port()
            proc = start(["-m", "loadtest.bench_http_clients", "--serve", client, upstream, str(port)], port)
            try:
                rows[f"proxy with {client}"] = asyncio.run(
                    run_load(f"http://127.0.0.1:{port}", args.concurrency, args.requests, False)
                )
            finally:
                stop_processes([proc])
    finally:
        stop_processes([backend])
    result = {
        "benchmark": "upstream-http-client",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores shared by client, proxy and backend",
        "python": platform.python_version(),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rows": rows,
        "client_cpu_us_per_request": cpu,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("| setup | req/s | p50 ms | p99 ms |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['req_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |", file=sys.stdout)
    print("\n| client alone | CPU us per request |\n|---|---|")
    for name, us in cpu.items():
        print(f"| {name} | {us:.0f} |")


if __name__ == "__main__":
    main()
