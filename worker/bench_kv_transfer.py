"""What a KV fetch from another worker saves: `python -m worker.bench_kv_transfer [--model tiny|llama3-8b-shape]`.

Two workers (the real HTTP apps, served by uvicorn on loopback in this process): a source that has
a prompt cached and a receiver that has not. For each prompt length, the receiver's time to first
token (a 1-token completion over HTTP) when it computes the whole prefill, when a router's hint
(x-radixgate-kv-source) makes it fetch the prefix's KV from the source first, and, as the floor,
the source's own TTFT with the prefix in its cache. Also the KV bytes moved and the fetch's
duration and rate as the receiver measured it (radixgate_worker_kv_fetch_seconds). Medians over
--reps distinct prompts per length.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from router.kv_events import KV_SOURCE_HEADER
from worker.bench import LLAMA3_8B_SHAPE, Prompts, build_bench_engine
from worker.bench_report import bench_device, machine_info, write_results
from worker.config import WorkerConfig
from worker.kv_pages import kv_bytes_per_token


class Served:
    """A worker app on a loopback port, served by uvicorn in a thread."""

    def __init__(self, engine: Any, max_mib: int) -> None:
        import uvicorn

        from worker.server import create_app

        self.engine = engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_app(engine, kv_transfer_max_mib=max_mib, kv_fetch_timeout_s=120.0, kv_hints="any")
        self.kv = app.state.kv_transfer
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("worker app did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class SourceProcess:
    """The source worker in a child process (``--source-process``), as two workers run in production:
    no event loop, engine thread or GIL shared with the receiver. Same flags; it serves until its
    stdin closes."""

    def __init__(self, argv: list[str]) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-m", "worker.bench_kv_transfer", *argv, "--serve-source"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None
        self.url = ""
        for line in self.proc.stdout:  # NOTE: blocks until it serves (or exits)
            if line.startswith("serving http://"):
                self.url = line.split()[1]
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"source process did not start (exit {self.proc.returncode})")
        self.kv = None  # its transfers' host memory is not visible from here

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


def ttft_ms(client: Any, url: str, ids: list[int], source: str | None = None) -> tuple[float, int]:
    """Wall ms of a 1-token completion of ``ids`` and the cached tokens its usage reports."""
    headers = {KV_SOURCE_HEADER: source} if source else {}
    body = {"model": "bench", "prompt": ids, "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body, headers=headers)
    elapsed = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        raise RuntimeError(f"completion failed: {r.status_code} {r.text[:200]}")
    return elapsed, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def fetch_seconds(served: Served) -> float:
    """The receiver's radixgate_worker_kv_fetch_seconds sum, read from its registry in-process."""
    return served.engine.metrics.registry.get_sample_value("radixgate_worker_kv_fetch_seconds_sum") or 0.0


def measure(
    source: Served | SourceProcess, receiver: Served, lengths: list[int], reps: int, vocab: int, seed: int
) -> list[dict]:
    import httpx

    prompts = Prompts(vocab, seed)
    per_token = kv_bytes_per_token(receiver.engine)
    rows = []
    with httpx.Client(timeout=600) as client:
        warm = prompts.make(lengths[0])  # NOTE: one untimed fetch: connections and first-use setup
        ttft_ms(client, source.url, [*warm, 1])
        ttft_ms(client, receiver.url, [*warm, 2], source.url)
        for n in lengths:
            computed, fetched, local, fetch_ms, hits = [], [], [], [], []
            receiver.kv.peak_held = 0
            if source.kv is not None:
                source.kv.peak_held = 0
            for _ in range(reps):
                computed.append(ttft_ms(client, receiver.url, prompts.make(n))[0])
                shared = prompts.make(n)
                ttft_ms(client, source.url, [*shared, 1])  # the source caches the prefix
                local.append(ttft_ms(client, source.url, [*shared, 2])[0])
                before = fetch_seconds(receiver)
                ms, cached = ttft_ms(client, receiver.url, [*shared, 3], source.url)
                fetched.append(ms)
                fetch_ms.append((fetch_seconds(receiver) - before) * 1e3)
                hits.append(cached)
            moved = statistics.median(hits) * per_token
            row = {"prompt_tokens": n, "fetched_tokens": statistics.median(hits), "kv_mib": round(moved / 2**20, 2),
                   "ttft_computed_ms": round(statistics.median(computed), 2),
                   "ttft_fetched_ms": round(statistics.median(fetched), 2),
                   "ttft_local_hit_ms": round(statistics.median(local), 2),
                   "fetch_ms": round(statistics.median(fetch_ms), 2),
                   "peak_held_mib": [None if x.kv is None else round(x.kv.peak_held / 2**20, 2)
                                     for x in (source, receiver)]}  # fmt: skip
            row["fetch_gbs"] = round(moved / (row["fetch_ms"] / 1e3) / 1e9, 3) if row["fetch_ms"] else None
            rows.append(row)
            print(row, file=sys.stderr)
    return rows


def markdown(doc: dict) -> str:
    m, p = doc["machine"], doc["params"]
    where = "the source in its own process" if p.get("source_process") else "both workers in one process"
    lines = [f"**{p['model']} on {m['device_name']}** ({p['reps']} prompts per length, medians; KV "
             f"{doc['kv_bytes_per_token']} bytes a token; {where})", "",
             "| prompt tokens | KV moved (MiB) | TTFT computed (ms) | TTFT fetched (ms) | TTFT local hit (ms) "
             "| fetch (ms) | fetch GB/s | host MiB held (source, receiver) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['kv_mib']} | {r['ttft_computed_ms']} | {r['ttft_fetched_ms']} | "
                     f"{r['ttft_local_hit_ms']} | {r['fetch_ms']} | {r['fetch_gbs']} | "
                     f"{', '.join('-' if x is None else str(x) for x in r['peak_held_mib'])} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.bench_kv_transfer", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "llama3-8b-shape"), default="tiny")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--prompt-tokens", default="256,1024,2048,4000", help="comma-separated prompt lengths")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kv-cache-tokens", type=int, default=32768, help="each worker's KV pool (tokens)")
    p.add_argument("--kv-transfer-max-mib", type=int, default=1024,
                   help="each worker's --kv-transfer-max-mib")  # fmt: skip
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads (CPU; each worker's steps)")
    p.add_argument("--source-process", action="store_true",
                   help="run the source worker in its own process, as in production (its host memory "
                   "for transfers then goes unreported)")  # fmt: skip
    p.add_argument("--serve-source", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    p.add_argument("--quick", action="store_true", help="two short lengths (256,1024), two prompts each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON result path")
    p.add_argument("--markdown")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = bench_device(parser, args.device, args.model, args.cpu_threads)
    if args.quick:
        args.prompt_tokens, args.reps = "256,1024", 2
    lengths = [int(x) for x in args.prompt_tokens.split(",") if x]
    shape = None if args.model == "tiny" else LLAMA3_8B_SHAPE
    cfg = WorkerConfig(device=device, kv_cache_tokens=args.kv_cache_tokens, warmup_tokens=128,
                       cpu_threads=args.cpu_threads, served_model_name="bench")  # fmt: skip
    if args.serve_source:  # NOTE: the child of --source-process: serve until stdin closes
        served = Served(build_bench_engine(cfg, shape), args.kv_transfer_max_mib)
        print("serving", served.url, flush=True)
        sys.stdin.read()
        served.stop()
        return 0
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--source-process"]
    source: Served | SourceProcess = (
        SourceProcess(child_argv)
        if args.source_process
        else Served(build_bench_engine(cfg, shape), args.kv_transfer_max_mib)
    )
    receiver = Served(build_bench_engine(cfg, shape), args.kv_transfer_max_mib)
    try:
        vocab = receiver.engine.tokenizer.vocab_size
        rows = measure(source, receiver, lengths, args.reps, min(vocab, 250), args.seed)
    finally:
        receiver.stop()
        source.stop()
    doc = {"benchmark": "kv_transfer", "command": "python -m worker.bench_kv_transfer " + " ".join(argv or sys.argv[1:]),
           "machine": machine_info(device), "params": vars(args),
           "kv_bytes_per_token": kv_bytes_per_token(receiver.engine), "rows": rows}  # fmt: skip
    write_results(doc, args.out, args.markdown, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
