"""worker.bench_cpu_attention --quick in a child process (it sets the process's torch threads): both
decode paths agree on every scenario, and the report says which batches were split by length."""

from __future__ import annotations

import json
import subprocess
import sys


def test_quick_run_reports_every_scenario_with_agreeing_paths(tmp_path):
    out = tmp_path / "cpu-attention.json"
    proc = subprocess.run(
        [sys.executable, "-m", "worker.bench_cpu_attention", "--quick", "--pool-slots", "20000", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["batch"]: r for r in doc["rows"]}
    assert list(rows) == ["32 x 512 (equal)", "32 x U(100, 4000)", "1 x 4000 + 31 x 200", "64 x U(50, 600)"]
    for r in rows.values():
        assert r["rel_diff"] < 1e-5 and r["padded_ms"] > 0 and r["grouped_ms"] > 0
        assert r["padded_tokens"] >= r["tokens"]
    assert rows["32 x 512 (equal)"]["groups"] == 1 and rows["1 x 4000 + 31 x 200"]["groups"] == 2
    assert doc["threads"] == 1
    assert proc.stdout.splitlines()[0].startswith("| batch |")
