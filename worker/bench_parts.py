"""The engine's parts timed on their own, after a benchmark's run (worker.bench, worker.bench_profile):
a captured decode step replayed with nothing else between replays, and the host tier's copies. They
split a step's or a hit's wall time into the GPU's share and the rest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def cuda_median_ms(run: Callable[[], Any], reps: int) -> float:
    """Median ms of ``run()`` between two CUDA events, after one untimed call: the device's time for
    the work it enqueues, back to back with no host work between calls."""
    import torch

    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return round(statistics.median(samples), 4)


def time_graph_replays(runner: Any, batches: Sequence[int], reps: int = 50) -> dict[str, float]:
    """Median ms of each batch size's captured decode forward replayed alone (CUDA events, no host
    work between replays): the GPU's share of a decode step, against the step's wall time."""
    sizes = {batch: runner.padded_size(batch) for batch in batches}
    return {
        str(b): cuda_median_ms(runner.replay_of(size), reps) for b, size in sizes.items() if size is not None
    }


def time_host_copies(host: Any, tokens: int, reps: int = 5) -> dict | None:
    """Median GB/s of the host tier's two copies (save: device to host, load: host to device) for
    ``tokens`` worth of pages, run directly on ``host`` (a HostKVPool) after the engine stopped:
    the copy rate a hit from host memory pays, apart from its prefill. None without room."""
    import torch

    pool = host.device_pool
    if pool is None:
        return None
    ps = pool.page_size
    pages = min(tokens // ps, host.num_pages, pool.num_pages)  # whole pages, as the cache holds them
    if pages <= 0:
        return None
    device_pages, host_pages = np.arange(pages), np.arange(pages)
    nbytes = pages * host.page_bytes(pool)
    cuda = pool.k_cache[0].is_cuda

    def median_s(copy: Any) -> float:
        times = []
        for _ in range(reps + 1):  # NOTE: the first warms up (page faults on the host side)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            copy()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    save_s = median_s(lambda: host.save(device_pages, host_pages))
    load_s = median_s(lambda: host.load(host_pages, device_pages))
    return {"tokens": pages * ps, "bytes": nbytes, "save_ms": round(save_s * 1e3, 3),
            "load_ms": round(load_s * 1e3, 3), "save_gbs": round(nbytes / save_s / 1e9, 2),
            "load_gbs": round(nbytes / load_s / 1e9, 2)}  # fmt: skip
