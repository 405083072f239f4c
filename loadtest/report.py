"""Load-test results: per-request records, the summary numbers, JSON files, markdown tables, plots.

Pure functions over recorded results; never talks to a server. `python -m loadtest.report compare
a.json b.json --md out.md --plot out.png` sets several runs side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.stats import percentile

RESULTS_FORMAT = 1


@dataclass(slots=True)
class RequestRecord:
    id: int  # the workload request id
    group: str  # the workload's prefix group ("tenant-3", "conv-12", ...)
    start_s: float  # send time, seconds after the run started
    prompt_chars: int  # characters of the rendered prompt (~ tokens for a bytes tokenizer)
    ttft_s: float | None = None  # first output chunk: text, thinking, tool call (stream); whole response
    latency_s: float | None = None  # whole response; None unless the request succeeded
    prompt_tokens: int | None = None  # from the server's usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    worker: str | None = None  # x-radixgate-worker header, "direct" without one; None if no response
    status: int | None = None  # HTTP status; None when no response came
    error: str | None = None  # kind: http_<status>, timeout, connect, disconnected, bad_response, ...

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Results:
    label: str
    config: dict[str, Any]  # the run's settings, as given
    started_unix: float  # wall-clock start (unix seconds)
    duration_s: float  # from the first send to the last completion or the deadline
    records: list[RequestRecord] = field(default_factory=list)
    skipped: int = 0  # later turns not sent because an earlier turn failed

    def summary(self) -> dict[str, Any]:
        return summarize(self)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


def first_token_times(results: Results) -> list[float]:
    """The answered requests' times to first token in seconds; none for a run that did not stream."""
    # NOTE: a run that did not stream has no first token: its ttft_s is the whole response, reported
    # as latency only (a results file without the setting is taken as it comes)
    if results.config.get("stream") is False:
        return []
    return [r.ttft_s for r in results.records if r.ok and r.ttft_s is not None]


def summarize(results: Results) -> dict[str, Any]:
    """The numbers a run is judged by (times in ms, rates per second, hit rate as a fraction)."""
    recs = results.records
    ok = [r for r in recs if r.ok]
    failed = [r for r in recs if not r.ok and r.error != "cancelled"]
    ttfts = first_token_times(results)
    lats = [r.latency_s for r in ok if r.latency_s is not None]
    duration = max(results.duration_s, 1e-9)
    with_usage = [r for r in ok if r.prompt_tokens is not None]
    prompt_total = sum(r.prompt_tokens or 0 for r in with_usage)
    cached_total = sum(r.cached_tokens or 0 for r in with_usage)
    # NOTE: hit rate is None (unknown), not 0, when the server never reported cached tokens.
    reported = any(r.cached_tokens is not None for r in with_usage)
    hit_rate = cached_total / prompt_total if reported and prompt_total else None
    # NOTE: so is the output rate when no answer reported its completion tokens (a stream without usage)
    completions = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    per_worker = Counter(r.worker or "direct" for r in ok)
    mean_load = sum(per_worker.values()) / len(per_worker) if per_worker else 0.0
    return {
        "label": results.label,
        "sent": len(recs),
        "ok": len(ok),
        "errors": len(failed),
        "errors_by_kind": dict(sorted(Counter(r.error for r in failed).items())),
        "cancelled": sum(1 for r in recs if r.error == "cancelled"),
        "skipped": results.skipped,
        "duration_s": round(results.duration_s, 3),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p90_ms": _ms(percentile(ttfts, 90)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "latency_p50_ms": _ms(percentile(lats, 50)),
        "latency_p99_ms": _ms(percentile(lats, 99)),
        "throughput_rps": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(sum(completions) / duration, 2) if completions else None,
        "prompt_tokens": prompt_total,
        "cached_tokens": cached_total,
        "hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "per_worker": dict(sorted(per_worker.items())),
        "load_spread": round(max(per_worker.values()) / mean_load, 3) if per_worker else None,
    }


def to_dict(results: Results) -> dict[str, Any]:
    return {
        "format": RESULTS_FORMAT,
        "label": results.label,
        "config": results.config,
        "started_unix": results.started_unix,
        "duration_s": results.duration_s,
        "skipped": results.skipped,
        "summary": summarize(results),
        "records": [asdict(r) for r in results.records],
    }


def check_plotting() -> None:
    """ValueError where matplotlib, which draws the PNG, is not installed (said before a run, not after)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError('--plot needs matplotlib: pip install "radixgate[loadtest]"')


def prepare_output(path: str | Path) -> Path:
    """Create ``path``'s missing parent folders and check that a file can be written there, so a
    run fails before it starts, not after (OSError with the path if not)."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot write {out}: cannot create its folder ({exc.strerror or exc})") from None
    if out.is_dir():
        raise IsADirectoryError(f"cannot write {out}: it is a folder")
    # NOTE: opened, not asked (os.access says yes to root everywhere, /proc included); appended to, so
    # an existing file is left as it is, and one made here is removed again: the run writes it
    existed = out.exists()
    try:
        with open(out, "ab"):
            pass
    except OSError as exc:
        raise OSError(f"cannot write {out}: {exc.strerror or exc}") from None
    if not existed:
        out.unlink(missing_ok=True)
    return out


def write_json(results: Results, path: str | Path) -> None:
    prepare_output(path).write_bytes(orjson.dumps(to_dict(results), option=orjson.OPT_INDENT_2))


def read_json(path: str | Path) -> Results:
    """A results file written by ``write_json``; ValueError (naming the file) for anything else."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"{path}: not a loadtest results file (format {found!r}, expected {RESULTS_FORMAT})")
    try:
        return Results(
            label=data["label"],
            config=data["config"],
            started_unix=data["started_unix"],
            duration_s=data["duration_s"],
            records=[RequestRecord(**r) for r in data["records"]],
            skipped=data.get("skipped", 0),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a complete loadtest results file ({exc!r})") from None


_ROWS = [  # (row title, summary key, format)
    ("ok / sent", None, None),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p90 (ms)", "ttft_p90_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
    ("latency p99 (ms)", "latency_p99_ms", "{:.1f}"),
    ("throughput (req/s)", "throughput_rps", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("fleet hit rate", "hit_rate", "{:.1%}"),
    ("workers used", None, None),
    ("load spread (max/mean)", "load_spread", "{:.2f}"),
    ("errors", None, None),
    ("cancelled at deadline", "cancelled", "{}"),
]


def _cell(summary: dict[str, Any], title: str, key: str | None, fmt: str | None) -> str:
    if title == "ok / sent":
        return f"{summary['ok']} / {summary['sent']}"
    if title == "workers used":
        return str(len(summary["per_worker"]))
    if title == "errors":
        kinds = ", ".join(f"{k}: {v}" for k, v in summary["errors_by_kind"].items())
        return f"{summary['errors']} ({kinds})" if kinds else "0"
    value = summary.get(key) if key else None
    return "n/a" if value is None or fmt is None else fmt.format(value)


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """One column per run, one row per metric."""
    labels = [s["label"] or f"run {i + 1}" for i, s in enumerate(summaries)]
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for title, key, fmt in _ROWS:
        lines.append(f"| {title} | " + " | ".join(_cell(s, title, key, fmt) for s in summaries) + " |")
    return "\n".join(lines) + "\n"


def hit_rate_over_time(results: Results, bins: int = 20) -> list[tuple[float, float]]:
    """(window end s, cached/prompt tokens of requests completed in the window) per time window."""
    done = [(r.start_s + r.latency_s, r) for r in results.records if r.ok and r.latency_s and r.prompt_tokens]
    if not done:
        return []
    width = max(results.duration_s, max(t for t, _ in done)) / bins
    prompt, cached = [0] * bins, [0] * bins
    for t, r in done:
        b = min(int(t / width), bins - 1)
        prompt[b] += r.prompt_tokens or 0
        cached[b] += r.cached_tokens or 0
    return [((b + 1) * width, cached[b] / prompt[b]) for b in range(bins) if prompt[b]]


def figure(runs: list[Results]) -> Any:
    """A matplotlib figure, two panels: TTFT CDF per streamed run, fleet hit rate over time per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_hit) = plt.subplots(1, 2, figsize=(11, 4))
    for i, res in enumerate(runs):
        label = res.label or f"run {i + 1}"
        ttfts = sorted(t * 1000.0 for t in first_token_times(res))
        if ttfts:
            ax_cdf.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], label=label)
        series = hit_rate_over_time(res)
        if series:
            ax_hit.plot([t for t, _ in series], [h for _, h in series], marker=".", label=label)
    ax_cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax_hit.set(xlabel="time (s)", ylabel="cached / prompt tokens", title="Fleet hit rate", ylim=(0, 1.05))
    for ax in (ax_cdf, ax_hit):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    return fig


def plot(runs: list[Results], path: str | Path) -> None:
    """One PNG of `figure(runs)`."""
    import matplotlib.pyplot as plt

    fig = figure(runs)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(paths: list[str | Path], md: str | Path | None = None, png: str | Path | None = None) -> str:
    """Side-by-side markdown table of several result JSONs (optionally written, and plotted)."""
    if png:
        check_plotting()
    runs = [read_json(p) for p in paths]
    for out in (md, png):
        if out:
            prepare_output(out)
    table = markdown_table([summarize(r) for r in runs])
    if md:
        Path(md).write_text(table)
    if png:
        plot(runs, png)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.report")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp = sub.add_parser("compare", help="merge result JSONs into one side-by-side table")
    cmp.add_argument("results", nargs="+", help="result JSON files written by loadtest.driver")
    cmp.add_argument("--md", help="write the markdown table here")
    cmp.add_argument("--plot", help="write the TTFT CDF + hit-rate PNG here")
    args = parser.parse_args(argv)
    try:
        table = compare(args.results, args.md, args.plot)
    except (ValueError, OSError) as exc:  # a missing or foreign file, an unwritable output
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
