"""One simulated worker of the fleet simulator: its real radix cache over a bounded page pool, its
queues, and how it admits requests and shares a prompt's pages. Time is the engine's business
(loadtest/fleet_sim.py): nothing here reads a clock or plans a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from worker.host_cache import HostKVPool
from worker.kv_pages import Pinned, export_span, import_pages
from worker.kv_pool import PageAllocator
from worker.kv_transfer import LinkRate
from worker.radix_cache import RadixCache


@dataclass
class WorkerModel:
    """One worker's service model, the same cost model as ``python -m worker --engine sim`` (see
    worker/sim_engine.py for where the defaults come from). The defaults are ESTIMATES for one H100
    serving Llama-3-8B in bf16, not measurements: a prefill (extend) step costs 0.07 ms per uncached
    prompt token (~14k tokens/s); a decode step costs 7 ms + 0.06 ms per decoding request; the KV pool
    holds 400k tokens. Prefill and decode steps alternate (a prefill step stalls decoding).

    ``prefix_sharing`` (default True) follows radixgate's worker scheduler: the full pages a prefill
    step computes enter the radix cache at once (and the router hears of them), and a waiting
    request whose next uncached page another admitted request is computing waits a step to reuse it
    instead of computing it again. With False a request's pages enter the cache when it finishes and
    concurrent requests with one prefix each compute it.

    Admission considers the oldest ``admit_window`` waiting requests in arrival order (``schedule_policy``
    "fcfs", the worker's ``--schedule-policy fcfs``) or, as the worker does by default ("lpm"),
    longest cached prefix first, except that those waiting longer than ``max_wait_s`` go first in
    arrival order.

    ``host_kv_tokens`` > 0 gives each worker the worker's host-memory KV tier (``--host-cache-tokens``):
    evicted pages move there and a hit on them is copied back. Every page copied either way costs
    ``host_copy_ms_per_token`` per token, added to the next prefill step (the worker copies on its
    engine thread). The default is an ESTIMATE: Llama-3-8B's 128 KiB of KV per token over ~45 GB/s
    of PCIe 5 pinned-memory copies.

    KV transfer (the router's --kv-fetch-min-tokens, ``SimConfig.kv_fetch_min_tokens``): a worker
    told to fetch a prompt's KV looks up its own cached prefix between two of its steps, the source
    exports what it holds beyond it between two of its own steps (its device-to-host copy,
    ``host_copy_ms_per_token`` per token, delays its next step), the KV crosses the link
    (``kv_fetch_base_ms`` + ``kv_fetch_ms_per_token`` per token), and the receiver caches it (its
    host-to-device copy delays its next step) before the request joins its queue. A worker's link
    carries one transfer at a time each way: concurrent fetches from one source, or into one
    receiver, queue for it. The link defaults
    are ESTIMATES for the worker's HTTP path: Llama-3-8B's 128 KiB per token at ~1.1 GB/s (what
    an HTTP body moved over loopback, docs/benchmarks/kv-transfer.md) and ~3 ms up to the answer's headers.
    ``kv_fetch_max_tokens`` is the worker's --kv-transfer-max-mib (1024) in Llama-3-8B tokens: the
    most one worker's transfers under way hold in host memory, sending and receiving (beyond it a
    source answers busy, a receiver drops the fetch). Transfers stream a group of ``kv_layers``
    layers' K or V at a time and each holds two groups, as the worker's (transfer_chunking), so a
    fetch moves at most ``kv_layers`` times the bound (and half the receiver's pool), and what its
    link has brought in half the timeout (LinkRate); ``kv_fetch_timeout_s`` is its
    --kv-fetch-timeout-s, counted from the lookup; ``kv_fetch_max_wait_ms`` its
    --kv-transfer-max-wait-ms: a fetch that would queue longer than that for the receiver's link
    in, or an export for the source's link out, is refused (busy)."""

    prefill_ms_per_token: float = 0.07  # per uncached prompt token (real tokens)
    decode_base_ms: float = 7.0  # one decode step at batch size 1
    decode_ms_per_seq: float = 0.06  # per decoding request in the step
    max_running: int = 256  # requests admitted at once; the rest wait (FCFS, see prefix_sharing)
    chunked_prefill_tokens: int = 2048  # real prompt tokens prefilled per step
    kv_tokens: int = 400_000  # KV pool per worker, in simulated tokens (pages = kv_tokens // block_size)
    block_size: int = 16  # tokens per page = router block size
    prefix_sharing: bool = True  # cache computed pages per step; wait for a shared page in flight
    admit_window: int = 256  # oldest waiting requests considered for admission per step
    schedule_policy: str = "fcfs"  # admission order: "fcfs" or "lpm" (see above)
    max_wait_s: float = 5.0  # lpm: a request waiting longer goes first, in arrival order
    host_kv_tokens: int = 0  # host-memory KV tier per worker, in simulated tokens (0: none)
    host_copy_ms_per_token: float = 0.003  # a page copied to or from the host tier, per real token
    kv_fetch_ms_per_token: float = 0.12  # KV fetched from another worker: link time per real token
    kv_fetch_base_ms: float = 3.0  # KV fetch: the exchange's fixed cost
    kv_fetch_max_tokens: int = 8192  # host memory of a worker's KV transfers under way, real tokens
    kv_layers: int = 32  # the model's layers: a transfer streams one layer's K or V at a time, or more
    kv_fetch_timeout_s: float = 5.0  # KV fetch: given up after this long (the worker's --kv-fetch-timeout-s)
    kv_fetch_max_wait_ms: float = 200.0  # queued longer for a link: refused (--kv-transfer-max-wait-ms)

    def check(self) -> None:
        """Raise ValueError unless every count is >= 1 where 0 could never admit a request or would
        divide by zero (max_running, admit_window, block_size, kv_layers), every other number is
        >= 0 and the schedule policy is known."""
        for name, value in asdict(self).items():
            least = 1 if name in ("max_running", "block_size", "admit_window", "kv_layers") else 0
            # NOTE: NaN too: a NaN cost or wait compares false with every time and loses requests
            if isinstance(value, int | float) and not isinstance(value, bool) and not value >= least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"schedule_policy must be fcfs or lpm, got {self.schedule_policy!r}")


class SimJob:
    """One admitted or waiting request. ``pages`` hold the whole sequence (prompt + output); the
    first ``tree_n`` of them belong to the radix cache, locked through ``node``."""

    __slots__ = ("id", "ids", "node", "out_ids", "pages", "prefill", "prefill_left", "start",
                 "steps_left", "tree_n", "ttft", "uncached", "view")  # fmt: skip

    def __init__(self, rid: int, ids: np.ndarray, out_ids: np.ndarray, steps: int, start: float):
        self.id, self.ids, self.out_ids, self.steps_left, self.start = rid, ids, out_ids, steps, start
        self.ttft = 0.0
        self.tree_n = 0
        self.prefill: Any = None  # router.workers.PendingPrefill: in the worker's load until the first token
        self.view: Any = None  # router.workers.Worker: the routing replica's view of the worker
        self.uncached = 0  # prompt tokens not cached when it arrived (the worker's backlog estimate)


class SimWorker:
    def __init__(self, url: str, m: WorkerModel, events: bool, namespace: str) -> None:
        self.url, self.m = url, m
        self.alloc = PageAllocator(max(1, m.kv_tokens // m.block_size))
        host = HostKVPool(m.host_kv_tokens // m.block_size) if m.host_kv_tokens >= m.block_size else None
        self.cache = RadixCache(self.alloc, m.block_size, namespace, enable_events=events, host=host)
        self.copied_pages = 0  # host-tier pages copied either way, as of the last step planned
        self.extra_ms = 0.0  # engine-thread work between steps (KV export/import), added to the next step
        self.link_out_free = self.link_in_free = 0.0  # when its link is free to send / receive KV (s)
        self.kv_held = 0  # simulated tokens of KV in transfers under way, out and in (the worker's bound)
        self.link = LinkRate()  # the rate its fetches came at, in simulated tokens: what it asks for
        self.waiting: deque[SimJob] = deque()
        self.prefilling: list[SimJob] = []
        self.decoding: list[SimJob] = []
        self.chunk: list[tuple[SimJob, int]] = []  # prefill work of the current step (job, tokens)
        self.requests = 0
        self.prompt_tokens = self.cached_tokens = 0  # of admitted requests, cached as matched then
        self.busy_s = 0.0
        self.max_waiting = 0
        self.seg: tuple[float, float, int] | None = None  # (start s, step s, steps) or idle
        self.after_prefill = False  # the last step was a prefill step: decoding requests step next
        self.version = 0  # bumps when a planned segment end is moved

    def enqueue(self, job: SimJob) -> None:
        job.uncached = job.ids.size - self.cache.cached_prefix_len(job.ids)
        self.waiting.append(job)
        self.max_waiting = max(self.max_waiting, len(self.waiting))

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def report(self) -> tuple[int, int]:
        """What ``GET /health`` says: (running + waiting, prefill backlog tokens): the prompt
        tokens admitted requests have still to compute plus waiting ones' uncached estimate."""
        backlog = sum(j.prefill_left for j in self.prefilling) + sum(j.uncached for j in self.waiting)
        return len(self.waiting) + len(self.prefilling) + len(self.decoding), backlog

    def _order(self, now: float) -> None:
        """LPM: reorder the admission window as the worker's scheduler does; each request's
        uncached estimate is refreshed on the way (the worker's backlog report)."""
        window = [self.waiting.popleft() for _ in range(min(self.m.admit_window, len(self.waiting)))]
        old = [j for j in window if now - j.start > self.m.max_wait_s]
        old.sort(key=lambda j: j.start)
        young = [j for j in window if now - j.start <= self.m.max_wait_s]
        for j in young:
            j.uncached = j.ids.size - self.cache.cached_prefix_len(j.ids)
        young.sort(key=lambda j: (j.uncached - j.ids.size, j.start))  # longest cached prefix first
        self.waiting.extendleft(reversed(old + young))

    def admit(self, now: float = 0.0) -> list[SimJob]:
        """Move waiting requests into ``prefilling`` while batch room and pages allow. Returns the
        requests taken off the queue because they can never fit the pool (the worker's context_length_exceeded)."""
        m, cache, alloc = self.m, self.cache, self.alloc
        if (
            m.schedule_policy == "lpm"
            and len(self.waiting) > 1
            and len(self.prefilling) + len(self.decoding) < m.max_running
        ):
            self._order(now)
        pool_pages = alloc.num_pages
        rejected: list[SimJob] = []
        in_flight: set[bytes] = set()
        if m.prefix_sharing:
            in_flight = {k for j in self.prefilling if (k := self._in_flight_key(j, j.tree_n * m.block_size))}
        deferred = 0  # waiting requests passed over this step, kept at the head of the queue
        while len(self.waiting) > deferred and len(self.prefilling) + len(self.decoding) < m.max_running:
            if deferred >= m.admit_window:
                break
            job = self.waiting[deferred]
            total = job.ids.size + job.out_ids.size
            if -(-total // m.block_size) > pool_pages:
                del self.waiting[deferred]
                rejected.append(job)
                continue
            match = cache.match_prefix(job.ids)
            key = self._in_flight_key(job, match.num_tokens) if m.prefix_sharing else None
            if key is not None and key in in_flight:
                deferred += 1  # NOTE: another request computes this page now; take it from the tree next step
                continue
            need = -(-total // m.block_size) - match.pages.size  # NOTE: host hits need device pages too
            cache.lock(match.last_node)
            cache.make_room(need)
            if alloc.num_free < need:  # NOTE: running requests hold the pool; retry when one finishes
                cache.unlock(match.last_node)
                break
            tree_pages = cache.load_back(match) if match.host_nodes else match.pages
            pages = alloc.alloc(need - (tree_pages.size - match.pages.size))
            del self.waiting[deferred]
            job.node, job.pages = match.last_node, np.concatenate((tree_pages, pages))
            job.tree_n = tree_pages.size
            job.prefill_left = job.ids.size - match.num_tokens
            self.prompt_tokens += job.ids.size
            self.cached_tokens += match.num_tokens
            self.prefilling.append(job)
            if key is not None:
                in_flight.add(key)
        return rejected

    def cache_prompt(self, job: SimJob) -> None:
        """After a prefill step: the prompt's computed full pages enter the cache, locked for the
        job, which now reads the tree's pages for them (as the worker's scheduler does)."""
        ps = self.m.block_size
        full = (job.ids.size - job.prefill_left) // ps
        if full <= job.tree_n:
            return
        tokens = job.ids[: full * ps]
        self._insert(job, tokens)
        # NOTE: match leaves one token uncached, so a probe token past the pages lets all of them match
        match = self.cache.match_prefix(np.append(tokens, np.int32(0)))
        self.cache.lock(match.last_node)
        self.cache.unlock(job.node)
        job.node, job.tree_n = match.last_node, full
        job.pages = np.concatenate((match.pages, job.pages[full:]))

    def release(self, job: SimJob) -> None:
        """A finished request: the full pages of what it computed enter the cache, the rest of its
        pages go back to the pool, and its lock is dropped."""
        ps = self.m.block_size
        seq = np.concatenate((job.ids, job.out_ids))
        # NOTE: the last output token was sampled but never fed back, so it has no K/V: the worker
        # caches its kv_len, prompt + output - 1 tokens (never fewer than the tree already holds)
        n_full = max(job.tree_n, (seq.size - 1) // ps)
        self._insert(job, seq[: n_full * ps])
        self.alloc.free(job.pages[n_full:])
        self.cache.unlock(job.node)

    def _insert(self, job: SimJob, tokens: np.ndarray) -> None:
        """Cache ``tokens`` (whole pages, job's sequence) held in the job's pages; free the job's
        pages whose tokens another request cached meanwhile (the tree keeps its own)."""
        pos = self.cache.insert(tokens, job.pages[: tokens.size // self.m.block_size])
        dup = job.pages[job.tree_n : pos // self.m.block_size]
        if dup.size:
            self.alloc.free(dup)

    def steps_by(self, t: float) -> int:
        """Steps of the planned segment finished once the step under way at ``t`` ends."""
        start, step, steps = self.seg  # type: ignore[misc]
        return min(steps, int((t - start) / step) + 1)

    def next_boundary(self, t: float) -> float:
        """When the engine next runs work queued at ``t`` between steps: now if idle, else at the end
        of the step under way."""
        if self.seg is None:
            return t
        start, step, _ = self.seg
        return start + self.steps_by(t) * step

    def export_len(self, ids: np.ndarray, start: int, cap: int) -> int:
        """Tokens of ``ids`` past ``start`` an export sends (the worker's own export_span)."""
        _, end = export_span(self.cache, self.m.block_size, ids, start, cap)
        return max(0, end - start)

    def import_len(self, ids: np.ndarray, start: int, n: int) -> tuple[int, int]:
        """Cache ``ids[start:start + n]`` as fetched KV (the worker's own import_pages); returns the
        tokens newly cached and the pages written (a host-to-device copy each)."""
        written = [0]

        def write(pin: Pinned) -> None:
            written[0] = pin.pages.size

        got = import_pages(self.cache, self.alloc, self.m.block_size, ids, start, start + n, write)
        return got, written[0]

    def _in_flight_key(self, job: SimJob, cached: int) -> bytes | None:
        """The first page past ``cached`` tokens of job's prompt, as the key of its computation."""
        ps = self.m.block_size
        if cached + ps > job.ids.size:
            return None
        return cached.to_bytes(4, "little") + job.ids[cached : cached + ps].tobytes()
