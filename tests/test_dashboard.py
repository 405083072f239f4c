"""The Grafana dashboard (helm/radixgate/dashboards/radixgate.json) queries only metrics a real
router and a real worker export: a renamed metric fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent.parent / "helm" / "radixgate" / "dashboards" / "radixgate.json"


SUFFIXES = {"counter": ("", "_total"), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(text: str) -> set[str]:
    """Sample names a Prometheus text exposition declares (``# TYPE``; a family with no sample yet,
    such as an error counter before the first error, counts) or carries."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names.update(name.removesuffix("_total") + suffix for suffix in SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split(" ")[0])
    return names


def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_every_panel_queries_the_prometheus_datasource_variable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert graphs and all(p["datasource"]["uid"] == "${datasource}" and p["targets"] for p in graphs)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    cells = [(x, y) for p in dash["panels"] for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
             for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])]  # fmt: skip
    assert len(cells) == len(set(cells)), "panels overlap"


def test_every_query_names_metrics_the_router_and_a_worker_export(launch) -> None:
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--host-cache-tokens", "4096")
    router = launch.router([worker.url], "--max-concurrent-requests", "8")  # admission metrics on
    body = {"model": "sim-8b", "prompt": "a dashboard needs at least one request", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    names = exported(httpx.get(router.url + "/metrics").text) | exported(
        httpx.get(worker.url + "/metrics").text
    )
    missing = []
    for title, expr in queries():
        for metric in re.findall(r"\bradixgate_[a-z0-9_]+", expr):
            if metric not in names:
                missing.append(f"{title}: {metric}")
    assert queries() and missing == []
