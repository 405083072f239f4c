"""Kernel timing for the benchmarks and the tuner: median of many runs, L2 flushed before each one.

``flush="clean"`` (the default) evicts L2 by reading a buffer larger than it, leaving clean lines, as
the weight reads of a decode step do before its attention kernel. ``flush="dirty"`` evicts it by writing
the buffer (triton.testing.do_bench's way): the timed call then also pays writing those lines back, up to
an L2's worth of extra DRAM traffic (~50 MB on an H100/H200), which a short call cannot hide.
On CUDA the runs are timed with events; elsewhere with the host clock (tests only).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

FLUSH_BYTES = 256 << 20  # past every current GPU's L2 (H100/H200: 50 MB, B200: 126 MB)
FLUSHES = ("clean", "dirty")


@functools.lru_cache(maxsize=4)
def flush_buffer(device: torch.device, nbytes: int = FLUSH_BYTES) -> torch.Tensor:
    """The device's flush buffer (int32, ``nbytes``), allocated once."""
    return torch.zeros(nbytes // 4, dtype=torch.int32, device=device)


def flush_l2(device: torch.device, flush: str = "clean", nbytes: int = FLUSH_BYTES) -> None:
    """Evict L2 before a timed run: by reading the flush buffer ("clean") or writing it ("dirty")."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    buf = flush_buffer(device, nbytes)
    if flush == "dirty":
        buf.zero_()
    else:
        torch.amax(buf)  # reads every line; writes one scalar


class _Clock:
    """Start/stop marks around one run: CUDA events on a GPU (stream order), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        return start.elapsed_time(stop) if self.cuda else (stop - start) * 1e3


def time_ms(
    fn: Callable[[], Any],
    device: torch.device | None = None,
    *,
    flush: str = "clean",
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    max_reps: int = 10_000,
    flush_bytes: int = FLUSH_BYTES,
) -> float:
    """Median milliseconds of ``fn`` (on ``device``, default the current CUDA device), each run after an
    L2 flush; the run count fills ~``rep_ms`` after ~``warmup_ms`` of untimed runs (at least one each)."""
    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    device = device or torch.device("cuda", torch.cuda.current_device())
    clock = _Clock(device)
    fn()
    clock.sync()
    start = clock.mark()
    for _ in range(5):  # a first estimate, flush included
        flush_l2(device, flush, flush_bytes)
        fn()
    stop = clock.mark()
    clock.sync()
    estimate = max(clock.elapsed_ms(start, stop) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    marks = []
    for _ in range(min(max_reps, max(1, int(rep_ms / estimate)))):
        flush_l2(device, flush, flush_bytes)
        start = clock.mark()
        fn()  # NOTE: its result is dropped: keeping a thousand outputs alive would fill the device
        marks.append((start, clock.mark()))
    clock.sync()
    return statistics.median(clock.elapsed_ms(a, b) for a, b in marks)


def capture(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after one run on a side stream (compiles, allocates)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replay_ms(fn: Callable[[], Any], *, flush: str = "clean") -> float:
    """Median time of ``fn`` captured once in a CUDA graph and replayed (no Python launch cost)."""
    return time_ms(capture(fn).replay, flush=flush)


def device_spans(events: Any) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the device (CUDA) kernels among torch.profiler ``events``, in start order."""
    from torch.autograd import DeviceType

    spans = [
        (e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA
    ]
    return sorted(spans, key=lambda span: span[1])


def profile_kernels(
    fn: Callable[[], Any], device: torch.device, reps: int = 20
) -> list[tuple[str, float, float]]:
    """device_spans of ``reps`` runs of ``fn`` (each after a clean L2 flush, as time_ms runs it) recorded by
    the CUDA profiler (CUPTI): when each kernel ran, gaps between kernels included. Empty off CUDA."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:  # NOTE: host activity too, as worker.bench_profile records
        for _ in range(reps):
            flush_l2(device)
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return device_spans(prof.events())
