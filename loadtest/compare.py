"""Side-by-side router comparison on loopback: per policy configuration, start N workers and a router
as real processes, drive one workload through loadtest.driver.run_load, then stop them by PID.

`python -m loadtest.compare --policies round_robin,cache_aware --workers 2 --requests 40`. Bounded in
runs, workers and wall time; never leaves a process it started running.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import report
from loadtest.cluster_sim import parse_run
from loadtest.driver import LoadConfig, run_load
from router.launcher import free_port, stop_processes

MAX_RUNS, MAX_WORKERS = 8, 16
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Backend:
    """The workers every run starts: ``python -m worker --engine sim`` when this checkout has it,
    else ``python -m loadtest.echo_backend`` (a model-free stand-in with a bounded LRU prefix cache).
    Both wait a cost model's time; neither says anything about real inference speed."""

    kind: str = "auto"  # auto | sim | echo
    cache_tokens: int = 16_384  # KV / prefix cache per worker, tokens
    block_size: int = 16  # tokens per block
    prefill_ms_per_token: float = 0.07  # per uncached prompt token
    decode_ms_per_token: float = 7.0  # echo: per output token; sim: decode step at batch 1

    def resolved(self) -> str:
        if self.kind != "auto":
            return self.kind
        return "sim" if importlib.util.find_spec("worker.sim_engine") else "echo"

    def command(self, port: int, name: str) -> list[str]:
        if self.resolved() == "sim":
            return [sys.executable, "-m", "worker", "--engine", "sim", "--model", "tiny", "--port", str(port),
                    "--block-size", str(self.block_size), "--kv-cache-tokens", str(self.cache_tokens),
                    "--sim-prefill-ms-per-token", str(self.prefill_ms_per_token),
                    "--sim-decode-base-ms", str(self.decode_ms_per_token), "--log-level", "warning"]  # fmt: skip
        return [sys.executable, "-m", "loadtest.echo_backend", "--port", str(port), "--name", name,
                "--block-size", str(self.block_size), "--cache-blocks", str(self.cache_tokens // self.block_size),
                "--prefill-us-per-token", str(self.prefill_ms_per_token * 1e3),
                "--decode-ms-per-token", str(self.decode_ms_per_token)]  # fmt: skip

    def describe(self) -> str:
        if self.resolved() == "sim":
            return (f"python -m worker --engine sim (cost model: prefill {self.prefill_ms_per_token} ms/token, "
                    f"decode step {self.decode_ms_per_token} ms at batch 1; KV {self.cache_tokens} tokens)")  # fmt: skip
        return (f"python -m loadtest.echo_backend (sleeps {self.prefill_ms_per_token * 1e3:g} us per uncached "
                f"prompt token and {self.decode_ms_per_token:g} ms per output token; LRU prefix cache of "
                f"{self.cache_tokens // self.block_size} blocks)")  # fmt: skip


@dataclass
class CompareConfig:
    runs: list[tuple[str, str, dict[str, Any]]]  # (label, router policy, policy params)
    load: LoadConfig = field(default_factory=LoadConfig)  # url and label are set per run
    workers: int = 2
    backend: Backend = field(default_factory=Backend)
    out_dir: str = "compare-results"
    startup_timeout_s: float = 90.0  # per process, to answer GET /health (router: GET /ready)


class _Fleet:
    """The processes of one run; ``stop`` terminates them by PID (kill after a grace period)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], name: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))

    def wait_ready(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited during start-up; logs in {self.log_dir}")
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # NOTE: polling with a deadline, not a blind wait
        raise RuntimeError(f"{url} not ready after {timeout_s} s; logs in {self.log_dir}")

    def stop(self, grace_s: float = 10.0) -> None:
        stop_processes(self.procs, grace_s)
        self.procs.clear()


def run_one(config: CompareConfig, label: str, policy: str, params: dict[str, Any]) -> report.Results:
    """Start the fleet for one configuration, drive the workload, stop the fleet."""
    log_dir = Path(config.out_dir) / "logs" / label
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = _Fleet(log_dir)
    try:
        urls = []
        for i in range(config.workers):
            port = free_port()
            fleet.start(config.backend.command(port, f"w{i}"), f"worker-{i}")
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            fleet.wait_ready(url + "/health", config.startup_timeout_s)
        port = free_port()
        events = "auto" if config.backend.resolved() == "sim" else "off"  # the echo backend has none
        cmd = [sys.executable, "-m", "router", "--port", str(port), "--workers", ",".join(urls),
               "--policy", policy, "--block-size", str(config.backend.block_size), "--kv-events", events,
               "--log-level", "warning"]  # fmt: skip
        for key, value in params.items():
            cmd += ["--policy-param", f"{key}={value}"]
        fleet.start(cmd, "router")
        fleet.wait_ready(f"http://127.0.0.1:{port}/ready", config.startup_timeout_s)
        load = LoadConfig(**{**asdict(config.load), "url": f"http://127.0.0.1:{port}", "label": label})
        return asyncio.run(run_load(load))
    finally:
        fleet.stop()


def compare(config: CompareConfig) -> dict[str, Any]:
    """Every run in turn; writes <label>.json, compare.md, compare.json and compare.png to out_dir."""
    if not 1 <= len(config.runs) <= MAX_RUNS or not 1 <= config.workers <= MAX_WORKERS:
        raise ValueError(f"compare takes 1..{MAX_RUNS} runs and 1..{MAX_WORKERS} workers")
    labels = [label for label, _, _ in config.runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be distinct, got {labels}")
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for label, policy, params in config.runs:
        res = run_one(config, label, policy, params)
        report.write_json(res, out / f"{label}.json")
        results.append(res)
    header = (f"{config.workers} workers: {config.backend.describe()}; workload {config.load.workload}, "
              f"{config.load.mode} loop\n\n")  # fmt: skip
    table = header + report.markdown_table([r.summary() for r in results])
    (out / "compare.md").write_text(table)
    report.plot(results, out / "compare.png")
    doc = {
        "backend": config.backend.resolved(),
        "backend_description": config.backend.describe(),
        "workers": config.workers,
        "load": asdict(config.load),
        "runs": [
            {"label": lbl, "policy": pol, "params": prm, "summary": r.summary()}
            for (lbl, pol, prm), r in zip(config.runs, results, strict=True)
        ],
    }
    (out / "compare.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return {"table": table, **doc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__)
    p.add_argument("--policies", default="round_robin,least_load,prefix_hash,cache_aware")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=POLICY:K=V,...",
                   help="an extra run with router policy parameters (repeatable)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=["auto", "sim", "echo"])
    p.add_argument("--cache-tokens", type=int, default=Backend.cache_tokens, help="per worker")
    p.add_argument("--prefill-ms-per-token", type=float, default=Backend.prefill_ms_per_token)
    p.add_argument("--decode-ms-per-token", type=float, default=Backend.decode_ms_per_token)
    p.add_argument("--workload", default="tenants")
    p.add_argument("--trace", help="Mooncake JSONL with --workload trace")
    p.add_argument("--mode", default="closed", choices=["closed", "open"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--duration", type=float, default=120.0, help="wall-clock bound per run (s)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="workload knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="compare-results")
    a = p.parse_args(argv)
    try:
        runs = [parse_run(x) for x in filter(None, a.policies.split(","))] + [parse_run(x) for x in a.run]
        options = {k: _value(v) for k, v in (x.split("=", 1) for x in a.option)}
        load = LoadConfig(workload=a.workload, trace=a.trace, mode=a.mode, concurrency=a.concurrency,
                          rate=a.rate, requests=a.requests, duration_s=a.duration, max_tokens=a.max_tokens,
                          stream=True, seed=a.seed, options=options, block_chars=32 if a.trace else None)  # fmt: skip
        backend = Backend(a.backend, a.cache_tokens, 16, a.prefill_ms_per_token, a.decode_ms_per_token)
        result = compare(CompareConfig(runs, load, a.workers, backend, a.out_dir))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result["table"])
    print(f"\nresults: {a.out_dir}/compare.json, compare.md, compare.png", file=sys.stderr)
    return 0


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    raise SystemExit(main())
