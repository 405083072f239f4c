"""The load tools' benchmarks report one percentile, loadtest.report's (linear between order
statistics): a p99 of 100 timings is not their maximum, a p50 of an even count is the mean of the
middle two, and numbers from two benchmark pages are the same statistic."""

from __future__ import annotations

import itertools

import pytest

from loadtest import bench_resync, bench_route_decision, bench_tokenizer
from loadtest.report import percentile

ONE_TO_100 = [float(i) for i in range(1, 101)]


def test_the_route_decision_bench_uses_the_report_percentile() -> None:
    ns = [v * 1e6 for v in ONE_TO_100]  # 1..100 ms
    assert bench_route_decision._ms(ns, 99) == pytest.approx(99.01) == percentile(ONE_TO_100, 99)
    assert bench_route_decision._ms(ns, 50) == 50.5
    assert bench_route_decision._ms([], 99) is None


def test_the_resync_bench_uses_the_report_percentile() -> None:
    s = [v / 1e3 for v in ONE_TO_100]  # 1..100 ms
    assert bench_resync._ms(s, 99) == pytest.approx(99.01)
    assert bench_resync._ms(s, 50) == 50.5 and bench_resync._ms(s, 100) == 100.0
    assert bench_resync._ms([], 99) == 0.0


def test_the_tokenizer_bench_uses_the_report_percentile(monkeypatch) -> None:
    """Request i of 100 takes i ms on a clock the test drives: p90 is 90.1 ms."""
    clock, took = [0.0], itertools.count(1)

    class Tokenizer:
        def encode_chat(self, messages: list, tools: list | None) -> list[int]:
            clock[0] += next(took) / 1e3
            return [0]

    monkeypatch.setattr(bench_tokenizer.time, "perf_counter", lambda: clock[0])
    row = bench_tokenizer.run(Tokenizer(), [([], None)] * 100)  # type: ignore[arg-type]
    assert row["p90_ms"] == pytest.approx(percentile(ONE_TO_100, 90)) == pytest.approx(90.1)
    assert row["median_ms"] == 50.5
