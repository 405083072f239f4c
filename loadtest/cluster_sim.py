"""`python -m loadtest.cluster_sim`: discrete-event fleet simulation of routing policies.

The real router policies and prefix index in front of N workers that each run the real radix cache
over a bounded page pool, timed by a cost model instead of GPUs (engine: loadtest/fleet_sim.py,
request sources: loadtest/sim_sources.py). Every latency and throughput it prints is simulated;
only router CPU per decision is measured.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict
from typing import Any

import orjson

from loadtest.fleet_sim import ClusterSim, SimConfig, WorkerModel, check_config
from loadtest.report import prepare_output
from loadtest.sim_sources import Source, TraceSource, WorkloadSource

_ROWS = [  # (title, key, format)
    ("fleet hit rate", "hit_rate", "{:.1%}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
    ("throughput (req/s)", "throughput_rps", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
    ("load max/mean (requests)", "load_spread_requests", "{:.2f}"),
    ("load max/mean (busy time)", "load_spread_busy", "{:.2f}"),
    ("max queue on a worker", "max_waiting", "{}"),
    ("KV fetched (% of prompt tokens)", "kv_fetched_share", "{:.1%}"),
    ("completed / rejected", None, None),
    ("router CPU/decision p50 (us, measured)", "decision_us_p50", "{:.0f}"),
    ("router CPU/decision p99 (us, measured)", "decision_us_p99", "{:.0f}"),
    ("index entries", "index_entries", "{:,}"),
    ("index memory (MiB, est.)", "index_mem_mb_est", "{:.1f}"),
]


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """One column per run, one row per metric; the header says the numbers are simulated."""
    lines = ["| simulated | " + " | ".join(s["label"] for s in summaries) + " |",
             "|---|" + "---|" * len(summaries)]  # fmt: skip
    for title, key, fmt in _ROWS:
        cells = []
        for s in summaries:
            if key is None:
                cells.append(f"{s['completed']} / {s['rejected']}")
            else:
                v = s.get(key)
                cells.append("n/a" if v is None else fmt.format(v))  # type: ignore[union-attr]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_run(text: str) -> tuple[str, str, dict[str, Any]]:
    """``POLICY``, ``LABEL=POLICY`` or ``LABEL=POLICY:K=V,K=V`` -> (label, policy, params)."""
    label, sep, rest = text.partition("=")
    if not sep or ":" in label:
        label, rest = "", text
    policy, _, raw = rest.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, raw.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"policy parameter must be KEY=VALUE, got {item!r}")
        params[key] = _number(value)
    return label or (policy if not params else f"{policy}({raw})"), policy, params


def parse_option(text: str) -> tuple[str, str]:
    """``--option KEY=VALUE`` -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--option expects KEY=VALUE, got {text!r}")
    return key, value


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return None if value == "None" else value


# the policies that draw at random (their ``seed`` parameter; a router leaves it unseeded)
SEEDED_POLICIES = ("random", "least_load")


def run_configs(
    a: argparse.Namespace, runs: list[tuple[str, str, dict[str, Any]]], replicas: list[int],
    fetches: list[int], model: WorkerModel,
) -> list[SimConfig]:  # fmt: skip
    """One SimConfig per run, router count and fetch setting; each checked (ValueError) before any runs."""
    configs = []
    for n, fetch, (label, policy, params) in itertools.product(replicas, fetches, runs):
        if policy in SEEDED_POLICIES and "seed" not in params:  # NOTE: --seed makes every run repeatable
            params = {**params, "seed": a.seed}
        label = label if len(replicas) == 1 else f"{label} x{n}"
        label = label if len(fetches) == 1 else f"{label} fetch>={fetch}" if fetch else f"{label} no fetch"
        cfg = SimConfig(a.workers, policy, params, label, model, not a.no_events, a.event_delay_ms / 1e3,
                        a.index_entries, prefill_tokens_per_load=a.prefill_tokens_per_load,
                        join_workers=a.join_workers, join_at_s=a.join_at, routers=n,
                        health_interval_s=a.health_interval_s, prefill_report=not a.no_prefill_report,
                        replica_sync_delay_s=None if a.replica_sync_ms is None else a.replica_sync_ms / 1e3,
                        kv_fetch_min_tokens=fetch)  # fmt: skip
        check_config(cfg)
        configs.append(cfg)
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.cluster_sim", description=__doc__)
    p.add_argument("--workload", default="tenants", help="a loadtest.workloads name, or 'trace'")
    p.add_argument("--trace", help="Mooncake JSONL (with --workload trace)")
    p.add_argument("--trace-tokens-per-block", type=int, default=32, help="simulated tokens per 512-token id")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=50.0, help="Poisson arrivals, requests/s (not for traces)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (workloads)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="workload knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--policies", default="round_robin,least_load,prefix_hash,cache_aware,sticky")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=POLICY:K=V,...",
                   help="an extra run with policy parameters (repeatable)")  # fmt: skip
    d = WorkerModel()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # NOTE: --prefix-sharing / --no-prefix-sharing
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    p.add_argument("--no-events", action="store_true", help="router index learns only from its own routing")
    p.add_argument("--event-delay-ms", type=float, default=0.0)
    p.add_argument("--index-entries", type=int, default=2_000_000)
    p.add_argument("--prefill-tokens-per-load", type=float, default=SimConfig.prefill_tokens_per_load,
                   help="the router's setting: unanswered prefill tokens worth one request of load (0: off)")  # fmt: skip
    p.add_argument("--join-workers", type=int, default=0, help="workers that join the fleet at --join-at")
    p.add_argument("--join-at", type=float, default=0.0, help="simulated time (s) of the join")
    p.add_argument("--routers", default="1", metavar="N[,N...]",
                   help="router replicas, each request to one at random; several counts: every run at each")  # fmt: skip
    p.add_argument("--health-interval-s", type=float, default=SimConfig.health_interval_s,
                   help="each replica's health-check round, when it reads the workers' load reports (0: never)")  # fmt: skip
    p.add_argument("--no-prefill-report", action="store_true",
                   help="workers report running + waiting only, no prefill backlog (as other servers)")  # fmt: skip
    p.add_argument("--replica-sync-ms", type=float,
                   help="replicas announce their counts to each other, heard this late (ms); default: off")  # fmt: skip
    p.add_argument("--kv-fetch-min-tokens", default="0", metavar="N[,N...]",
                   help="the router's setting: fetch KV from a holder of >= N more prompt tokens (0: off); "
                        "several values: every run at each")  # fmt: skip
    p.add_argument("--json", help="write all summaries here")
    p.add_argument("--md", help="write the markdown table here")
    a = p.parse_args(argv)
    try:
        runs = [parse_run(x) for x in filter(None, a.policies.split(","))] + [parse_run(x) for x in a.run]
        replicas = [int(x) for x in a.routers.split(",")]
        fetches = [int(x) for x in a.kv_fetch_min_tokens.split(",")]
        if min(replicas) < 1 or not a.health_interval_s >= 0 or min(fetches) < 0:
            raise ValueError("--routers must be >= 1, --health-interval-s and --kv-fetch-min-tokens >= 0")
        for flag, value, least in (("--max-tokens", a.max_tokens, 1), ("--requests", a.requests, 1),
                                   ("--time-scale", a.time_scale, 0),
                                   ("--event-delay-ms", a.event_delay_ms, 0),
                                   ("--replica-sync-ms", a.replica_sync_ms or 0.0, 0)):  # fmt: skip
            if not value >= least:  # NOTE: NaN too
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        options = dict(parse_option(x) for x in a.option)
        for path in (a.md, a.json):  # NOTE: before the runs, not after them
            if path:
                prepare_output(path)
        model = WorkerModel(**{k: getattr(a, k) for k in asdict(d)})
        configs = run_configs(a, runs, replicas, fetches, model)
        if a.workload == "trace":
            if not a.trace:
                raise ValueError("--workload trace needs --trace PATH")
            source: Source = TraceSource(a.trace, a.requests, a.trace_tokens_per_block, a.time_scale, a.seed)
        else:
            source = WorkloadSource(a.workload, a.requests, a.rate, a.max_tokens, a.seed,
                                    {k: _number(v) for k, v in options.items()})  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summaries = []
    for cfg in configs:
        summaries.append(ClusterSim(cfg, source).run())
        print(f"# {cfg.label}: simulated in {summaries[-1]['wall_s']} s wall", file=sys.stderr)
    table = markdown_table(summaries)
    sys.stdout.write(table)
    try:  # NOTE: checked before the runs, but a disk may fill or a folder go meanwhile
        if a.md:
            with open(a.md, "w") as f:
                f.write(table)
        if a.json:
            with open(a.json, "wb") as f:
                f.write(orjson.dumps({"simulated": True, "argv": sys.argv[1:] if argv is None else argv,
                                      "runs": summaries}, option=orjson.OPT_INDENT_2))  # fmt: skip
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
