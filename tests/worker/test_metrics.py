"""The worker's windowed gauges: rates and the recent hit rate over their windows, under steps of
any frequency."""

from __future__ import annotations

import pytest

from worker.metrics import EngineSnapshot, WorkerMetrics


@pytest.mark.parametrize("step_s", [0.01, 0.05, 0.3, 2.0])
def test_recent_rates_and_hit_rate_follow_steady_steps_at_any_pace(step_s):
    """Engine steps every ``step_s`` for 90 s at 100 prefill and 200 decode tokens/s, half the prompt
    tokens cached: the 10 s rates and the 60 s hit rate read those numbers, however often steps come."""
    snap = EngineSnapshot()
    metrics = WorkerMetrics(lambda: snap)
    for i in range(int(90 / step_s) + 1):
        t = i * step_s
        snap = EngineSnapshot(
            t=1000.0 + t, prefill_tokens=round(100 * t), decode_tokens=round(200 * t),
            prompt_tokens=round(400 * t), cached_tokens=round(200 * t),
        )  # fmt: skip
        metrics.record(snap)
    prefill, decode = metrics.token_rates(snap)
    assert prefill == pytest.approx(100, rel=0.02) and decode == pytest.approx(200, rel=0.02)
    assert metrics.recent_hit_rate(snap) == pytest.approx(0.5, rel=0.02)
    assert len(metrics._history) <= 5 * 62  # about 4 samples a second over the longest window, not one a step
