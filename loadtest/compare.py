"""Side-by-side router comparison on loopback: per run, start N workers and a router as real
processes, drive one workload through loadtest.driver.run_load, read what the workers and the router
process counted, then stop them by PID.

`python -m loadtest.compare --policies round_robin,cache_aware --workers 2 --requests 40`. A run is a
radixgate router policy (`--policies`, `--run`) or another router started from a command line
(`--external LABEL=COMMAND`, e.g. sglang-router: docs/loadtest.md). Bounded in runs, workers and wall
time; never leaves a process it started running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtest import report
from loadtest.cluster_sim import parse_option, parse_run
from loadtest.driver import LoadConfig, build_requests, check_config, run_load
from router.launcher import free_port, redis_server_command, stop_processes, wait_for_port
from router.policies import make_policy
from router.prefix_index import PrefixIndex

MAX_RUNS, MAX_WORKERS, MAX_ROUTERS = 8, 16, 4
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
    host_cache_tokens: int = 0  # sim: each worker's host-memory KV tier, tokens (0: none)
    kv_fetch_ms_per_token: float = 0.12  # sim: a KV fetch's link time per token (a run's kv_fetch_min_tokens)

    def check(self) -> None:
        """ValueError for costs or sizes no backend can run with (a cache of no block crashed every
        request, a NaN cost broke every stream: the table came out all the same)."""
        if self.cache_tokens < self.block_size:
            raise ValueError(
                f"--cache-tokens must hold a block ({self.block_size} tokens) at least, got {self.cache_tokens}"
            )
        if self.host_cache_tokens < 0:
            raise ValueError(f"--host-cache-tokens must be >= 0, got {self.host_cache_tokens}")
        for name in ("prefill_ms_per_token", "decode_ms_per_token", "kv_fetch_ms_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")

    def resolved(self) -> str:
        if self.kind != "auto":
            return self.kind
        return "sim" if importlib.util.find_spec("worker.sim_engine") else "echo"

    def command(self, port: int, name: str) -> list[str]:
        if self.resolved() == "sim":
            return [sys.executable, "-m", "worker", "--engine", "sim", "--model", "tiny", "--port", str(port),
                    "--block-size", str(self.block_size), "--kv-cache-tokens", str(self.cache_tokens),
                    "--sim-prefill-ms-per-token", str(self.prefill_ms_per_token),
                    "--sim-decode-base-ms", str(self.decode_ms_per_token), "--log-level", "warning",
                    "--host-cache-tokens", str(self.host_cache_tokens),
                    "--sim-kv-fetch-ms-per-token", str(self.kv_fetch_ms_per_token),
                    "--kv-hints", "any"]  # fmt: skip
        return [sys.executable, "-m", "loadtest.echo_backend", "--port", str(port), "--name", name,
                "--block-size", str(self.block_size), "--cache-blocks", str(self.cache_tokens // self.block_size),
                "--prefill-us-per-token", str(self.prefill_ms_per_token * 1e3),
                "--decode-ms-per-token", str(self.decode_ms_per_token)]  # fmt: skip

    def describe(self) -> str:
        if self.resolved() == "sim":
            return (f"python -m worker --engine sim (cost model: prefill {self.prefill_ms_per_token} ms/token, "
                    f"decode step {self.decode_ms_per_token} ms at batch 1; KV {self.cache_tokens} tokens"
                    + (f", host tier {self.host_cache_tokens} tokens" if self.host_cache_tokens else "") + ")")  # fmt: skip
        return (f"python -m loadtest.echo_backend (sleeps {self.prefill_ms_per_token * 1e3:g} us per uncached "
                f"prompt token and {self.decode_ms_per_token:g} ms per output token; LRU prefix cache of "
                f"{self.cache_tokens // self.block_size} blocks)")  # fmt: skip


# NOTE: placeholders of an external router's command; {worker_urls} must be a whole argument
# and becomes one argument per worker URL (sglang-router's and vllm-router's --worker-urls take a list)
PLACEHOLDERS = ("{port}", "{worker_urls}", "{workers}", "{block_size}", "{python}", "{redis_url}")


def external_command(
    template: str, port: int, urls: list[str], block_size: int, redis_url: str = ""
) -> list[str]:
    """argv of another router from its command-line template (see PLACEHOLDERS)."""
    args = shlex.split(template)
    if "{port}" not in template:
        raise ValueError(f"an external router's command must listen on {{port}}: {template!r}")
    out: list[str] = []
    for arg in args:
        if arg == "{worker_urls}":
            out += urls
            continue
        for key, value in (("{port}", str(port)), ("{workers}", ",".join(urls)),
                           ("{block_size}", str(block_size)), ("{python}", sys.executable),
                           ("{redis_url}", redis_url)):  # fmt: skip
            arg = arg.replace(key, value)
        out.append(arg)
    return out


@dataclass
class CompareConfig:
    runs: list[tuple[str, str, dict[str, Any]]]  # (label, router policy, policy params)
    load: LoadConfig = field(default_factory=LoadConfig)  # url and label are set per run
    workers: int = 2
    backend: Backend = field(default_factory=Backend)
    out_dir: str = "compare-results"
    startup_timeout_s: float = 90.0  # per process, to answer GET /health (router: GET /ready)
    external: list[tuple[str, str]] = field(default_factory=list)  # (label, command template)
    routers: int = 1  # router processes per run, each given every worker; the driver takes them in turn
    redis: bool = False  # a redis-server per run: KV events (sim workers) and replica sync go through it

    def labels(self) -> list[str]:
        return [label for label, _, _ in self.runs] + [label for label, _ in self.external]


class _Fleet:
    """The processes of one run; ``stop`` terminates them by PID (kill after a grace period)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], name: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env))

    def start_redis(self) -> str:
        """A throwaway redis-server on a loopback port, stopped with the fleet; returns its URL."""
        port = free_port()
        self.start(redis_server_command(port), "redis")
        wait_for_port(self.procs[-1], port)
        return f"redis://127.0.0.1:{port}/0"

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


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds a running process has used so far, all its threads, from /proc; None elsewhere.

    NOTE: the scheduler's nanosecond run time (schedstat) of the live threads, which is exact where
    /proc/PID/stat's clock ticks are sampled (they can read 0 for a process that ran 20 ms in short
    slices); but the ticks also hold the threads that have ended, so the larger of the two counts."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    total_ns = 0
    for task in tasks:
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended in between
            total_ns += int((task / "schedstat").read_text().split()[0])
    ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of proc(5))
    return max(total_ns / 1e9, ticks / os.sysconf("SC_CLK_TCK"))


def _cpu_s(procs: list[subprocess.Popen]) -> float | None:
    """CPU seconds the router processes have used, together (None if any cannot be read)."""
    times = [process_cpu_s(p.pid) for p in procs]
    return None if None in times else sum(t for t in times if t is not None)


def worker_counts(url: str) -> dict[str, float] | None:
    """What a radixgate worker counted since it started (requests, prompt / cached tokens, evicted
    pages), from its /metrics; None for a backend without them (the echo backend)."""
    try:
        resp = httpx.get(url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    wanted = {"radixgate_worker_requests_finished": "requests", "radixgate_worker_prompt_tokens": "prompt_tokens",
              "radixgate_worker_cached_tokens": "cached_tokens", "radixgate_worker_evicted_pages": "evicted_pages",
              "radixgate_worker_kv_fetched_tokens": "fetched_tokens"}  # fmt: skip
    counts = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(resp.text):
        if family.name in wanted:
            counts[wanted[family.name]] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return counts


def settled_counts(urls: list[str], finished: int, timeout_s: float = 5.0) -> list[dict[str, float] | None]:
    """Every worker's counts once they add up to ``finished`` requests (a worker publishes its
    counters after the step that finished a request, so the last response can arrive first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [worker_counts(url) for url in urls]
        settled = any(c is None for c in counts) or sum(c["requests"] for c in counts) >= finished
        if settled or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)  # NOTE: polling with a deadline, not a blind wait


def fleet_summary(
    counts: list[dict[str, float] | None], router_cpu_s: float | None, ok: int
) -> dict[str, Any]:
    """The workers' own counts (the same for every router, since they do not rely on a response
    header) and the router process's CPU time."""
    out: dict[str, Any] = {
        "router_cpu_s": None if router_cpu_s is None else round(router_cpu_s, 3),
        "router_cpu_ms_per_request": round(router_cpu_s * 1e3 / ok, 3) if router_cpu_s and ok else None,
    }
    if counts and all(c is not None for c in counts):
        requests = [int(c["requests"]) for c in counts]
        prompt = sum(c["prompt_tokens"] for c in counts)
        out["worker_requests"] = requests
        out["worker_spread"] = (
            round(max(requests) / (sum(requests) / len(requests)), 3) if sum(requests) else None
        )
        out["worker_hit_rate"] = (
            round(sum(c["cached_tokens"] for c in counts) / prompt, 4) if prompt else None
        )
        out["evicted_pages"] = int(sum(c["evicted_pages"] for c in counts))
        out["fetched_share"] = round(sum(c["fetched_tokens"] for c in counts) / prompt, 4) if prompt else None
    return out


def with_worker_counts(summary: dict[str, Any], fleet: dict[str, Any]) -> dict[str, Any]:
    """The run's summary with "workers used" and "load spread" from the workers' own request counts
    where they have them: the response header those come from otherwise is radixgate's only."""
    if fleet.get("worker_requests") is None:
        return summary
    per_worker = {f"w{i}": n for i, n in enumerate(fleet["worker_requests"]) if n}
    return {**summary, "per_worker": per_worker, "load_spread": fleet["worker_spread"]}


def router_command(
    config: CompareConfig, label: str, port: int, urls: list[str], redis_url: str = ""
) -> tuple[list[str], str]:
    """argv of the run's router and the path that answers 200 once it can route."""
    external = dict(config.external)
    if label in external:
        # NOTE: another router's /v1/models is proxied to a worker: 200 means workers are registered
        return external_command(
            external[label], port, urls, config.backend.block_size, redis_url
        ), "/v1/models"
    _, policy, params = next(run for run in config.runs if run[0] == label)
    events = "auto" if config.backend.resolved() == "sim" else "off"  # the echo backend has none
    cmd = [sys.executable, "-m", "router", "--port", str(port), "--workers", ",".join(urls),
           "--policy", policy, "--block-size", str(config.backend.block_size), "--kv-events", events,
           "--log-level", "warning"]  # fmt: skip
    params = dict(params)
    if "kv_fetch_min_tokens" in params:  # NOTE: a router setting, not a policy parameter
        cmd += ["--kv-fetch-min-tokens", str(params.pop("kv_fetch_min_tokens"))]
    for key, value in params.items():
        cmd += ["--policy-param", f"{key}={value}"]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    return cmd, "/ready"


def run_one(config: CompareConfig, label: str) -> tuple[report.Results, dict[str, Any]]:
    """Start the fleet for one run, drive the workload, read the counts, stop the fleet."""
    log_dir = Path(config.out_dir) / "logs" / label
    log_dir.mkdir(parents=True, exist_ok=True)
    fleet = _Fleet(log_dir)
    try:
        redis_url = fleet.start_redis() if config.redis else ""
        urls = []
        for i in range(config.workers):
            port = free_port()
            cmd = config.backend.command(port, f"w{i}")
            if redis_url and config.backend.resolved() == "sim":
                cmd += ["--redis-url", redis_url]
            fleet.start(cmd, f"worker-{i}")
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            fleet.wait_ready(url + "/health", config.startup_timeout_s)
        ports = [free_port() for _ in range(config.routers)]
        for i, port in enumerate(ports):
            cmd, ready = router_command(config, label, port, urls, redis_url)
            fleet.start(cmd, "router" if i == 0 else f"router-{i}")
        routers = fleet.procs[-len(ports) :]
        for port in ports:
            fleet.wait_ready(f"http://127.0.0.1:{port}{ready}", config.startup_timeout_s)
        cpu0 = _cpu_s(routers)
        # NOTE: the model id comes from a worker: another router may list its own ("unknown" for
        # sglang-router in front of a backend without /model_info), which the workers refuse
        model = config.load.model or httpx.get(urls[0] + "/v1/models", timeout=5.0).json()["data"][0]["id"]
        router_urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        load = LoadConfig(**{**asdict(config.load), "url": router_urls, "label": label, "model": model})
        results = asyncio.run(run_load(load))
        cpu1 = _cpu_s(routers)
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        ok = sum(1 for r in results.records if r.ok)
        return results, fleet_summary(settled_counts(urls, ok), cpu, ok)
    finally:
        fleet.stop()


_FLEET_ROWS = [  # (row title, fleet summary key, format)
    ("hit rate (workers' counts)", "worker_hit_rate", "{:.1%}"),
    ("requests per worker (workers' counts)", "worker_requests", None),
    ("evicted KV pages", "evicted_pages", "{}"),
    ("KV fetched from other workers (% of prompt)", "fetched_share", "{:.1%}"),
    ("router CPU (ms per request)", "router_cpu_ms_per_request", "{:.2f}"),
]


def _fleet_cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, list):
        return " / ".join(map(str, value))
    return fmt.format(value) if fmt else str(value)


def fleet_rows(fleets: list[dict[str, Any]]) -> str:
    """Markdown rows (for compare.md) of what the workers and the router process counted."""
    lines = []
    for title, key, fmt in _FLEET_ROWS:
        cells = [_fleet_cell(f.get(key), fmt) for f in fleets]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(config: CompareConfig) -> dict[str, Any]:
    """Every run in turn; writes <label>.json, compare.md, compare.json and compare.png to out_dir."""
    labels = config.labels()
    if not 1 <= len(labels) <= MAX_RUNS or not 1 <= config.workers <= MAX_WORKERS:
        raise ValueError(f"compare takes 1..{MAX_RUNS} runs and 1..{MAX_WORKERS} workers")
    if not 1 <= config.routers <= MAX_ROUTERS:
        raise ValueError(f"compare takes 1..{MAX_ROUTERS} routers per run")
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be distinct, got {labels}")
    # NOTE: everything a run could refuse is checked here, before the first process starts
    for _, template in config.external:
        external_command(template, 0, [], config.backend.block_size)
    for label, policy, params in config.runs:
        fetch = params.get("kv_fetch_min_tokens", 0)  # NOTE: a router setting, not a policy parameter
        if not isinstance(fetch, int) or fetch < 0:
            raise ValueError(f"run {label!r}: kv_fetch_min_tokens must be a whole number >= 0, got {fetch!r}")
        make_policy(policy, PrefixIndex(1), {k: v for k, v in params.items() if k != "kv_fetch_min_tokens"})
    check_config(config.load)
    config.backend.check()
    build_requests(replace(config.load, requests=1))  # the workload's name and knobs, a trace's file
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, fleets = [], []
    for label in labels:
        res, fleet = run_one(config, label)
        report.write_json(res, out / f"{label}.json")
        results.append(res)
        fleets.append(fleet)
    header = (f"{config.workers} workers: {config.backend.describe()}; workload {config.load.workload}, "
              f"{config.load.mode} loop")  # fmt: skip
    if config.routers > 1:
        header += f"; {config.routers} router processes per run, requests to each in turn"
    if config.redis:
        header += "; a redis-server per run (KV events, replica sync)"
    if any(f.get("worker_requests") for f in fleets):
        header += "; workers used and load spread as the workers counted their requests"
    header += "\n\n"
    summaries = [with_worker_counts(r.summary(), f) for r, f in zip(results, fleets, strict=True)]
    table = header + report.markdown_table(summaries) + fleet_rows(fleets)
    (out / "compare.md").write_text(table)
    report.plot(results, out / "compare.png")
    specs = {label: {"policy": pol, "params": prm} for label, pol, prm in config.runs}
    specs |= {label: {"command": template} for label, template in config.external}
    doc = {
        "backend": config.backend.resolved(),
        "backend_description": config.backend.describe(),
        "workers": config.workers,
        "routers": config.routers,
        "redis": config.redis,
        "load": asdict(config.load),
        "runs": [
            {"label": lbl, **specs[lbl], "summary": summary, "fleet": f}
            for lbl, summary, f in zip(labels, summaries, fleets, strict=True)
        ],
    }
    (out / "compare.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return {"table": table, **doc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.compare", description=__doc__)
    p.add_argument("--policies", default="round_robin,least_load,prefix_hash,cache_aware")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=POLICY:K=V,...",
                   help="an extra run with router policy parameters (repeatable)")  # fmt: skip
    p.add_argument("--external", action="append", default=[], metavar="LABEL=COMMAND",
                   help="a run with another router, started by COMMAND (placeholders: "
                   + ", ".join(PLACEHOLDERS) + "; repeatable)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--routers", type=int, default=1, help="router processes per run (replicas), used in turn")
    p.add_argument("--redis", action="store_true",
                   help="start a redis-server per run for KV events and replica sync ({redis_url} in --external)")  # fmt: skip
    p.add_argument("--backend", default="auto", choices=["auto", "sim", "echo"])
    p.add_argument("--cache-tokens", type=int, default=Backend.cache_tokens, help="per worker")
    p.add_argument("--host-cache-tokens", type=int, default=0,
                   help="sim backend: each worker's host-memory KV tier (tokens; 0 = none)")  # fmt: skip
    p.add_argument("--prefill-ms-per-token", type=float, default=Backend.prefill_ms_per_token)
    p.add_argument("--decode-ms-per-token", type=float, default=Backend.decode_ms_per_token)
    p.add_argument("--kv-fetch-ms-per-token", type=float, default=Backend.kv_fetch_ms_per_token,
                   help="sim: link time per token of KV fetched between workers (runs with kv_fetch_min_tokens=N)")  # fmt: skip
    p.add_argument("--workload", default="tenants")
    p.add_argument("--trace", help="Mooncake JSONL with --workload trace")
    p.add_argument("--mode", default="closed", choices=["closed", "open"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--duration", type=float, default=120.0, help="wall-clock bound per run (s)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--api", default="chat", choices=["chat", "completions", "responses"],
                   help="responses: later turns send previous_response_id, not the conversation")  # fmt: skip
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="workload knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="compare-results")
    a = p.parse_args(argv)
    try:
        runs = [parse_run(x) for x in filter(None, a.policies.split(","))] + [parse_run(x) for x in a.run]
        options = {k: _value(v) for k, v in map(parse_option, a.option)}
        load = LoadConfig(workload=a.workload, trace=a.trace, mode=a.mode, concurrency=a.concurrency,
                          rate=a.rate, requests=a.requests, duration_s=a.duration, max_tokens=a.max_tokens,
                          stream=True, seed=a.seed, options=options, block_chars=32 if a.trace else None,
                          api=a.api)  # fmt: skip
        if a.host_cache_tokens and a.backend == "echo":
            raise ValueError("--host-cache-tokens needs the sim backend")
        backend = Backend(a.backend, a.cache_tokens, 16, a.prefill_ms_per_token, a.decode_ms_per_token,
                          a.host_cache_tokens, a.kv_fetch_ms_per_token)  # fmt: skip
        external = [_external(x) for x in a.external]
        config = CompareConfig(
            runs, load, a.workers, backend, a.out_dir, external=external, routers=a.routers, redis=a.redis
        )
        result = compare(config)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(result["table"])
    print(f"\nresults: {a.out_dir}/compare.json, compare.md, compare.png", file=sys.stderr)
    failed = [run["label"] for run in result["runs"] if run["summary"]["sent"] and not run["summary"]["ok"]]
    if failed:  # NOTE: a fleet that answered nothing is no measurement (the driver exits 1 so too)
        print(f"error: no request of {', '.join(failed)} succeeded (see the errors)", file=sys.stderr)
        return 1
    return 0


def _external(text: str) -> tuple[str, str]:
    label, sep, command = text.partition("=")
    if not sep or not label.strip() or not command.strip():
        raise ValueError(f"--external takes LABEL=COMMAND, got {text!r}")
    return label.strip(), command


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


if __name__ == "__main__":
    raise SystemExit(main())
