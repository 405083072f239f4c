"""kernels.timing: every timed run follows an L2 flush; a clean flush only reads, a dirty one writes;
the result is the median of the timed runs. On CPU the host clock stands in for CUDA events."""

from __future__ import annotations

import time

import pytest
import torch

from kernels import timing

CPU = torch.device("cpu")
SMALL = 1 << 16  # flush bytes: the order of calls is under test here, not the cache


def test_a_clean_flush_only_reads_and_a_dirty_one_writes():
    buf = timing.flush_buffer(CPU, SMALL)
    buf.fill_(7)
    timing.flush_l2(CPU, "clean", SMALL)
    assert bool((buf == 7).all())
    timing.flush_l2(CPU, "dirty", SMALL)
    assert bool((buf == 0).all())


def test_every_timed_run_follows_a_flush(monkeypatch):
    calls: list[str] = []
    flush = timing.flush_l2
    monkeypatch.setattr(
        timing, "flush_l2", lambda device, mode, nbytes: (calls.append(mode), flush(device, mode, nbytes))
    )
    timing.time_ms(lambda: calls.append("run"), CPU, flush="dirty", warmup_ms=0, rep_ms=0, flush_bytes=SMALL)
    # one first run, five estimate runs, one untimed warm-up run, then the timed run(s)
    assert calls[0] == "run"
    assert calls[1:11] == ["dirty", "run"] * 5
    assert calls[11] == "run"
    timed = calls[12:]
    assert timed and timed == ["dirty", "run"] * (len(timed) // 2)


def test_the_result_is_the_median_of_the_timed_runs():
    sleeps = iter([0.0] * 7 + [0.004, 0.001, 0.004])  # first, estimate and warm-up runs, then three timed

    def run() -> None:
        time.sleep(next(sleeps, 0.0))

    ms = timing.time_ms(run, CPU, warmup_ms=0, rep_ms=1e9, max_reps=3, flush_bytes=SMALL)
    assert ms >= 4.0  # the median of ~4, ~1, ~4 ms, not the mean (3) nor the minimum (1)


def test_an_unknown_flush_is_refused_before_anything_runs():
    ran = []
    with pytest.raises(ValueError, match="flush must be one of"):
        timing.time_ms(lambda: ran.append(1), CPU, flush="none")
    assert not ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_replays_are_timed_after_either_flush_and_a_clean_flush_leaves_the_buffer():
    device = torch.device("cuda")
    src = torch.randn(1 << 20, device=device)
    dst = torch.empty_like(src)
    for flush in timing.FLUSHES:
        ms = timing.time_replay_ms(lambda: dst.copy_(src), flush=flush)
        assert 0.0 < ms < 1e3
    assert bool(torch.equal(dst, src))  # the replayed graph did the copy
    buf = timing.flush_buffer(device)
    buf.fill_(7)
    timing.flush_l2(device, "clean")
    assert bool((buf == 7).all())


def test_device_spans_keep_the_cuda_kernels_in_start_order():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, device, start, end):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [event("b", DeviceType.CUDA, 5.0, 6.0), event("aten::sum", DeviceType.CPU, 0.0, 9.0),
              event("a", DeviceType.CUDA, 1.0, 2.0)]  # fmt: skip
    assert timing.device_spans(events) == [("a", 1.0, 2.0), ("b", 5.0, 6.0)]
