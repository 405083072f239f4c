"""What the README and docs/ promise about the code itself: the usage blocks' flags and the defaults
they show, a code map that names every module, and the metrics and health fields a real router and
worker export, and benchmark pages whose tables quote their JSON. A renamed flag, a changed
default, a new module, an undocumented metric or a re-run whose page was left behind fails here, not
in a reader's shell or an operator's query."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import httpx
import pytest

from router.config import RouterConfig
from router.config import build_parser as router_parser
from tests.support import REDIS
from tests.test_tokenization import byte_level_dir
from worker.config import WorkerConfig
from worker.config import build_parser as worker_parser

ROOT = Path(__file__).resolve().parent.parent


def usage_block(doc: str, program: str) -> str:
    """A doc's ``python -m <program> ...`` block, continuation lines included."""
    block = re.search(rf"```\n(python -m {program} .*?)```", (ROOT / doc).read_text(), re.S)
    assert block, f"{doc} has no usage block for python -m {program}"
    return block.group(1)


def shown_options(block: str) -> list[tuple[str, str]]:
    """Each ``[--flag VALUE]`` (``--flag=VALUE``, ``| --flag VALUE``) of a usage block, as (flag, VALUE or "")."""
    return re.findall(r"(?:\[|\| )(--[a-z0-9-]+)(?:[ =]([^\s\[\]]+))?", block)


ROUTER = (router_parser, {f.name: f.default for f in dataclasses.fields(RouterConfig)})
WORKER = (worker_parser, {f.name: f.default for f in dataclasses.fields(WorkerConfig)})


@pytest.mark.parametrize(
    ("doc", "program", "parser", "defaults"),
    [
        ("README.md", "router", *ROUTER),
        ("README.md", "worker", *WORKER),
        ("docs/worker.md", "worker", *WORKER),
    ],
    ids=["README-router", "README-worker", "worker.md"],
)
def test_usage_blocks_show_real_flags_and_their_defaults(doc, program, parser, defaults) -> None:
    """A value shown in the usage is the default: a number or address as is, of ``a|b|c`` the first."""
    actions = {o: a for a in parser()._actions for o in a.option_strings}
    shown = shown_options(usage_block(doc, program))
    assert len(shown) > 10
    for flag, value in shown:
        assert flag in actions, f"{doc} shows {flag}, which python -m {program} does not take"
        action = actions[flag]
        if "|" in value:
            default, *others = value.split("|")
        elif re.fullmatch(r"[0-9.]+", value):
            default, others = value, []
        else:
            continue  # a placeholder (N, URL, KEY) or an example (router.yaml, redis://...)
        real = defaults[action.dest]
        assert str(real) == default, f"{doc} shows {flag} {default}; its default is {real}"
        if action.choices:
            assert {default, *(v for v in others if not v.isupper())} <= set(action.choices), flag


def test_the_code_map_names_every_module_and_only_modules_that_exist() -> None:
    """docs/structure.md maps the code: each module by its path, or a folder's by its file name on
    the folder's row (``worker/model/``)."""
    rows = [
        line for line in (ROOT / "docs" / "structure.md").read_text().splitlines() if line.startswith("| `")
    ]
    named = {p for row in rows for p in re.findall(r"`([\w/.-]+\.py)`", row.split(" | ")[0])}
    missing = sorted(p for p in named if "/" in p and not (ROOT / p).is_file())
    assert missing == [], f"docs/structure.md names modules that do not exist: {missing}"
    unmapped = []
    for package in ("router", "worker", "kernels", "loadtest"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.name == "__init__.py" or str(rel) in named:
                continue
            folder_rows = [row for row in rows if f"`{rel.parent}/`" in row.split(" | ")[0]]
            if not any(f"`{rel.name}`" in row for row in folder_rows):
                unmapped.append(str(rel))
    assert unmapped == [], f"docs/structure.md does not map {unmapped}"


# NOTE: exported only with --k8s-worker-service, against an API server (tests/test_discovery.py)
DISCOVERY_ONLY = {
    "radixgate_discovered_workers",
    "radixgate_discovery_rounds",
    "radixgate_discovery_failures",
}


def documented_metrics(doc: str, section: str) -> dict[str, tuple[str, set[str]]]:
    """A metrics table's rows as {family: (type, labels)}: a family is the name less a counter's
    ``_total``; labels from a ``labels`` column, or written ``name{label}``."""
    text = (ROOT / "docs" / doc).read_text()
    table = text.split(section, 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in table.splitlines():
        if not row.startswith("| `radixgate_"):
            continue
        cells = [c.strip() for c in row.strip("|").split("|")]
        kind, label_cell = cells[1], cells[2] if doc == "metrics.md" else ""
        for name, braced in re.findall(r"`(radixgate_[a-z0-9_]+)(?:\{([a-z_]+)\})?`", cells[0]):
            labels = {w.strip() for w in label_cell.split(",") if w.strip()} | ({braced} if braced else set())
            out[name.removesuffix("_total") if kind == "counter" else name] = (kind, labels)
    return out


def exported_metrics(text: str) -> dict[str, tuple[str, list[set[str]]]]:
    """A Prometheus text exposition's families as {family: (type, each sample's label names)}."""
    kinds, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            kinds[name.removesuffix("_total") if kind == "counter" else name] = kind
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = set(re.findall(r'([a-z_]+)="', rest.split("}")[0])) - {"le"} if rest else set()
            samples.setdefault(name.split(" ")[0], []).append(labels)
    out = {}
    for family, kind in kinds.items():
        if family.endswith("_created"):
            continue  # prometheus_client's creation time of a counter or histogram
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}.get(kind, ("",))
        out[family] = (kind, [labels for s in suffixes for labels in samples.get(family + s, [])])
    return out


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_metrics_docs_match_what_a_router_and_a_worker_export(launch, tmp_path) -> None:
    """Every family docs/metrics.md and docs/worker.md list is exported with that type and those
    labels, and every family exported is listed. Switched on: Redis (replica sync), admission, API
    keys, affinity groups, a model tokenizer (prefix ids) and a worker's host tier."""
    redis_url = launch.redis()
    worker = launch.sim_worker("--host-cache-tokens", "4096", "--redis-url", redis_url)
    config = tmp_path / "router.yaml"
    config.write_text(
        "api_keys: [team:k1]\naffinity_groups: [{name: g, match: {header: {x-tenant: a}}, size: 1}]\n"
    )
    router = launch.router(
        [worker.url], "--config", str(config), "--redis-url", redis_url, "--max-concurrent-requests", "4",
        "--tokenizer", str(byte_level_dir(tmp_path / "tok")),
    )  # fmt: skip
    with httpx.Client(timeout=30, headers={"authorization": "Bearer k1", "x-tenant": "a"}) as client:
        body = {"model": "sim-8b", "messages": [{"role": "user", "content": "metrics"}], "max_tokens": 2}
        for stream in (False, True):
            assert (
                client.post(router.url + "/v1/chat/completions", json={**body, "stream": stream}).status_code
                == 200
            )
        router_text, worker_text = (client.get(url + "/metrics").text for url in (router.url, worker.url))
    # NOTE: one Prometheus holds both (the chart's ServiceMonitors): a family in both would mix them
    assert set(exported_metrics(router_text)) & set(exported_metrics(worker_text)) == set()
    for doc, section, text in (
        ("metrics.md", "| metric |", router_text),
        ("worker.md", "## Metrics (`/metrics`)", worker_text),
    ):
        documented, exported = documented_metrics(doc, section), exported_metrics(text)
        assert len(documented) > 20
        assert sorted(set(exported) - set(documented)) == [], f"exported but not in docs/{doc}"
        assert sorted(set(documented) - set(exported) - DISCOVERY_ONLY) == [], f"in docs/{doc}, not exported"
        for family, (kind, label_sets) in exported.items():
            assert kind == documented[family][0], (
                f"{family} is a {kind}; docs/{doc} says {documented[family][0]}"
            )
            for labels in label_sets:
                assert labels == documented[family][1], (
                    f"{family}: labels {labels}, documented {documented[family][1]}"
                )


def test_worker_health_and_cache_info_fields_are_documented(launch) -> None:
    """Each field of a worker's /health and /v1/cache/info (a host tier on) is named in its row of
    docs/worker.md's endpoint table (``simulated`` is the sim's, documented with it)."""
    worker = launch.sim_worker("--host-cache-tokens", "4096")
    rows = (ROOT / "docs" / "worker.md").read_text().splitlines()
    for path in ("/health", "/v1/cache/info"):
        (row,) = [r for r in rows if r.startswith(f"| `GET {path}` |")]
        fields = set(httpx.get(worker.url + path, timeout=10).json()) - {"simulated"}
        assert sorted(f for f in fields if not re.search(rf"\b{f}\b", row)) == [], path


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with ``header``, bold marks dropped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip("|").split("|")])
    return rows


def test_the_route_decision_page_quotes_its_json() -> None:
    """docs/benchmarks/route-decision.md's tables and headline p99s are route-decision.json's run,
    cell by cell: a re-run that writes the JSON without the page fails here."""
    page = (ROOT / "docs/benchmarks/route-decision.md").read_text()
    run = json.loads((ROOT / "docs/benchmarks/route-decision.json").read_text())

    def pair(case: dict, key: str) -> str:
        return f"{case[key + '_p50_ms']:.2f} / {case[key + '_p99_ms']:.2f}"

    expected = [
        [
            str(case["workers"]),
            f"{case['budget_entries']:,}",
            f"{case['p50_ms']:.2f}",
            f"{case['p99_ms']:.2f}",
            pair(case, "warm"),
            pair(case, "cold"),
            pair(case, "after_send"),
            pair(case, "cpu_total"),
            f"{case['max_ms']:.1f}",
        ]
        for case in run["cases"]
    ]
    assert table_rows(page, "| workers | budget") == expected
    gc_rows = table_rows(page, "| index shape | blocks | nodes")
    assert [row[-1] for row in gc_rows] == [f"{gc['full_gc_ms_median']} ms" for gc in run["full_gc"]]
    assert [row[1:3] for row in gc_rows] == [
        [f"{gc['blocks']:,}", f"{gc['nodes']:,}"] for gc in run["full_gc"]
    ]
    first, widest = run["cases"][0], max(run["cases"], key=lambda case: case["workers"])
    assert f"**met**,\n  {first['p99_ms']:.2f} ms" in page
    assert f"At {widest['workers']} workers the p99 is {widest['p99_ms']:.2f} ms" in page
    machine = run["machine"]
    assert f"load average {machine['load_average_1m_at_start']} at start" in page
