"""The fleet simulator's engine: the real router policies and prefix index in front of N workers
that each run the real radix cache over a bounded page pool, timed by a cost model instead of GPUs.

Every latency and throughput it reports is simulated; only router CPU per decision is measured.
It never opens a socket, never sleeps, and never reads the wall clock for simulated time.
The command line is loadtest/cluster_sim.py; request sources are loadtest/sim_sources.py.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import mmh3
import numpy as np

from loadtest.report import percentile
from loadtest.sim_sources import Source
from router.block_hash import block_hashes
from router.policies import Candidate, Policy, RouteRequest, make_policy
from router.prefix_index import PrefixIndex
from router.workers import blended_load
from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache

SIM_POLICIES = ("round_robin", "random", "least_load", "prefix_hash", "cache_aware", "sticky")
# Index memory per block held (bytes): tracemalloc of PrefixIndex.insert for 100k fresh blocks,
# the block-hash ints included (the index keeps them); a further worker on the same blocks adds
# only a bit in the node's mask.
_BYTES_FIRST_ENTRY, _BYTES_EXTRA_ENTRY = 96, 0


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
    concurrent requests with one prefix each compute it. Admission is FCFS over the oldest
    ``admit_window`` waiting requests (the worker's ``--schedule-policy fcfs``)."""

    prefill_ms_per_token: float = 0.07  # per uncached prompt token (real tokens)
    decode_base_ms: float = 7.0  # one decode step at batch size 1
    decode_ms_per_seq: float = 0.06  # per decoding request in the step
    max_running: int = 256  # requests admitted at once; the rest wait (FCFS, see prefix_sharing)
    chunked_prefill_tokens: int = 2048  # real prompt tokens prefilled per step
    kv_tokens: int = 400_000  # KV pool per worker, in simulated tokens (pages = kv_tokens // block_size)
    block_size: int = 16  # tokens per page = router block size
    prefix_sharing: bool = True  # cache computed pages per step; wait for a shared page in flight
    admit_window: int = 256  # oldest waiting requests considered for admission per step


@dataclass
class SimConfig:
    workers: int = 8
    policy: str = "cache_aware"  # a router policy name, or "sticky" (pin each group by hash)
    params: dict[str, Any] = field(default_factory=dict)  # router/policies.py parameters
    label: str = ""
    model: WorkerModel = field(default_factory=WorkerModel)
    events: bool = True  # worker KV events (stored/removed) flow back into the router's index
    event_delay_s: float = 0.0  # simulated delay from a worker step to the router applying its events
    index_entries: int = 2_000_000  # router PrefixIndex budget of (block, worker) entries
    # the router's --prefill-tokens-per-load: a request's predicted uncached prompt tokens count in
    # its worker's load until its first token (a streamed answer's first chunk); 0 = requests only
    prefill_tokens_per_load: float = 256.0
    namespace: str = "default"  # block-hash root: the model name


class StickyPolicy(Policy):
    """Reference client: every request of a group (conversation, tenant, document) goes to the
    worker with the highest rendezvous hash for that group, whatever the load."""

    name = "sticky"

    def __init__(self, index: PrefixIndex, params: dict[str, Any] | None = None) -> None:
        super().__init__(index, params)
        self._pinned: dict[str, str] = {}

    def select_group(self, group: str, candidates: list[Candidate]) -> str:
        url = self._pinned.get(group)
        if url is None:
            key = group.encode()
            url = max(candidates, key=lambda c: mmh3.hash64(key + c.url.encode(), signed=False)[0]).url
            self._pinned[group] = url
        return url


class _Job:
    """One admitted or waiting request. ``pages`` hold the whole sequence (prompt + output); the
    first ``tree_n`` of them belong to the radix cache, locked through ``node``."""

    __slots__ = ("id", "ids", "node", "out_ids", "pages", "pending", "prefill_left", "start",
                 "steps_left", "tree_n", "ttft")  # fmt: skip

    def __init__(self, rid: int, ids: np.ndarray, out_ids: np.ndarray, steps: int, start: float):
        self.id, self.ids, self.out_ids, self.steps_left, self.start = rid, ids, out_ids, steps, start
        self.ttft = 0.0
        self.tree_n = 0
        self.pending = 0  # prefill tokens the router counts in the worker's load until the first token


class _Worker:
    def __init__(self, url: str, m: WorkerModel, events: bool, namespace: str) -> None:
        self.url = url
        self.alloc = PageAllocator(max(1, m.kv_tokens // m.block_size))
        self.cache = RadixCache(self.alloc, m.block_size, namespace, enable_events=events)
        self.waiting: deque[_Job] = deque()
        self.prefilling: list[_Job] = []
        self.decoding: list[_Job] = []
        self.chunk: list[tuple[_Job, int]] = []  # prefill work of the current step (job, tokens)
        self.outstanding = 0  # routed, not finished: what the router counts as in flight
        self.pending_prefill = 0  # the router's Worker.pending_prefill
        self.requests = 0
        self.busy_s = 0.0
        self.max_waiting = 0
        self.seg: tuple[float, float, int] | None = None  # (start s, step s, steps) or idle
        self.version = 0  # bumps when a planned segment end is moved


class ClusterSim:
    """One simulation run: ``ClusterSim(config, source).run()`` -> summary dict."""

    def __init__(self, config: SimConfig, source: Source) -> None:
        self.c, self.m, self.src = config, config.model, source
        self.weight = source.weight  # real tokens per simulated token (trace scale-down)
        self.index = PrefixIndex(config.index_entries)
        if config.policy == "sticky":
            self.policy: Policy = StickyPolicy(self.index, config.params)
        else:
            self.policy = make_policy(config.policy, self.index, config.params)
        self.workers = [
            _Worker(f"http://sim-worker-{i}", self.m, config.events, config.namespace)
            for i in range(config.workers)
        ]
        self.by_url = {w.url: w for w in self.workers}
        for w in self.workers:
            self.index.add_worker(w.url)
        self.pool_pages = max(1, self.m.kv_tokens // self.m.block_size)
        tpl = config.prefill_tokens_per_load
        self.prefill_weight = 1.0 / tpl if tpl > 0 else 0.0
        self.heap: list[tuple[float, int, int, Any]] = []  # (time s, seq, kind, payload)
        self.seq = 0
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.decision_ns: list[int] = []
        self.event_ns = 0
        self.prompt_tokens = self.cached_tokens = self.output_tokens = 0
        self.rejected = self.skipped = 0
        self.last_finish = 0.0

    # ---------------------------------------------------------------- event loop
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        self.src.reset()
        # NOTE: the workload's objects are no router state: keep them out of the cyclic GC's scans,
        # or its pauses (proportional to live objects) would land in the measured decision times.
        gc.collect()
        gc.freeze()
        firsts = self.src.first_turns()  # (arrival s, id), sorted
        pos, heap = 0, self.heap
        while pos < len(firsts) or heap:
            if pos < len(firsts) and (not heap or firsts[pos][0] <= heap[0][0]):
                t, rid = firsts[pos]
                pos += 1
                self._arrive(rid, t)
                continue
            t, _, kind, payload = heapq.heappop(heap)
            if kind == 0:  # a worker's planned segment ends
                w, version = payload
                if version == w.version:
                    self._segment_end(w, t)
            elif kind == 1:  # a later turn arrives
                self._arrive(payload, t)
            else:  # KV events reach the router
                self._apply_events(*payload)
        gc.unfreeze()
        return self._summary(time.perf_counter() - wall0, firsts[0][0] if firsts else 0.0)

    # ---------------------------------------------------------------- router
    def _arrive(self, rid: int, t: float) -> None:
        ids = self.src.prompt_ids(rid)
        tokens = ids.tolist()  # NOTE: tokenization is not timed; the router's tokenizer gives a list
        bs, policy = self.m.block_size, self.policy
        t0 = time.perf_counter_ns()
        route = RouteRequest(block_hashes(tokens, bs, self.c.namespace), len(tokens), bs)
        weight = self.prefill_weight
        candidates = [
            Candidate(w.url, blended_load(w.outstanding, 0.0, w.pending_prefill, weight))
            for w in self.workers
        ]
        pending = 0
        if isinstance(policy, StickyPolicy):
            url = policy.select_group(self.src.group(rid), candidates)
        else:
            decision = policy.select(route, candidates)
            url = decision.url
            pending = len(tokens) - decision.matched_tokens[url]
        policy.on_routed(route, url)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        w = self.by_url[url]
        w.outstanding += 1
        w.requests += 1
        job = _Job(rid, ids, self.src.output_ids(rid), self.src.output_steps(rid), t)
        job.pending = pending
        w.pending_prefill += pending
        w.waiting.append(job)
        w.max_waiting = max(w.max_waiting, len(w.waiting))
        self._kick(w, t)

    def _apply_events(self, url: str, stored: list, removed: list[int], cleared: bool) -> None:
        t0 = time.perf_counter_ns()
        if cleared:
            self.index.clear_worker(url)
        for run in stored:
            self.index.apply_stored(url, run.parent_hash, run.block_hashes)
        if removed:
            self.index.apply_removed(url, removed)
        self.event_ns += time.perf_counter_ns() - t0

    # ---------------------------------------------------------------- workers
    def _kick(self, w: _Worker, t: float) -> None:
        """A request joined ``w``'s queue at ``t``: start it now if idle, or cut a decode-only
        segment at its next step boundary so the request is admitted there."""
        if w.seg is None:
            self._boundary(w, t)
            return
        start, step, steps = w.seg
        if w.chunk or len(w.prefilling) + len(w.decoding) >= self.m.max_running:
            return  # a prefill step is a single step; a full batch admits nothing until a finish
        done = min(steps, int((t - start) / step) + 1)
        if done < steps:
            w.seg = (start, step, done)
            w.version += 1
            self._push(start + done * step, 0, (w, w.version))

    def _segment_end(self, w: _Worker, t: float) -> None:
        _, step, steps = w.seg  # type: ignore[misc]
        w.busy_s += step * steps
        if not w.chunk:  # a decode segment: every decoding request made ``steps`` tokens
            for job in w.decoding:
                job.steps_left -= steps
        for job, n in w.chunk:
            job.prefill_left -= n
            if self.m.prefix_sharing:
                self._cache_prompt(w, job)
            if job.prefill_left == 0:
                job.ttft = t
                w.pending_prefill -= job.pending
                job.steps_left -= 1  # NOTE: the step that finishes a prefill emits the first token
                w.prefilling.remove(job)
                w.decoding.append(job)
        w.chunk = []
        if any(job.steps_left <= 0 for job in w.decoding):
            keep = []
            for job in w.decoding:
                if job.steps_left <= 0:
                    self._finish(w, job, t)
                else:
                    keep.append(job)
            w.decoding = keep
        self._boundary(w, t)

    def _insert(self, w: _Worker, job: _Job, tokens: np.ndarray) -> None:
        """Cache ``tokens`` (whole pages, job's sequence) held in the job's pages; free the job's
        pages whose tokens another request cached meanwhile (the tree keeps its own)."""
        pos = w.cache.insert(tokens, job.pages[: tokens.size // self.m.block_size])
        dup = job.pages[job.tree_n : pos // self.m.block_size]
        if dup.size:
            w.alloc.free(dup)

    def _cache_prompt(self, w: _Worker, job: _Job) -> None:
        """After a prefill step: the prompt's computed full pages enter the cache, locked for the
        job, which now reads the tree's pages for them (as the worker's scheduler does)."""
        ps = self.m.block_size
        full = (job.ids.size - job.prefill_left) // ps
        if full <= job.tree_n:
            return
        tokens = job.ids[: full * ps]
        self._insert(w, job, tokens)
        # NOTE: match leaves one token uncached, so a probe token past the pages lets all of them match
        match = w.cache.match_prefix(np.append(tokens, np.int32(0)))
        w.cache.lock(match.last_node)
        w.cache.unlock(job.node)
        job.node, job.tree_n = match.last_node, full
        job.pages = np.concatenate((match.pages, job.pages[full:]))

    def _in_flight_key(self, job: _Job, cached: int) -> bytes | None:
        """The first page past ``cached`` tokens of job's prompt, as the key of its computation."""
        ps = self.m.block_size
        if cached + ps > job.ids.size:
            return None
        return cached.to_bytes(4, "little") + job.ids[cached : cached + ps].tobytes()

    def _finish(self, w: _Worker, job: _Job, t: float) -> None:
        ps = self.m.block_size
        seq = np.concatenate((job.ids, job.out_ids))
        n_full = seq.size // ps
        self._insert(w, job, seq[: n_full * ps])
        w.alloc.free(job.pages[n_full:])
        w.cache.unlock(job.node)
        w.outstanding -= 1
        self.ttft.append(job.ttft - job.start)
        self.latency.append(t - job.start)
        self.output_tokens += self.src.output_steps(job.id)
        self.last_finish = max(self.last_finish, t)
        nxt = self.src.next_turn(job.id)
        if nxt is not None:
            self._push(t + self.src.think_s(nxt), 1, nxt)

    def _admit(self, w: _Worker) -> None:
        m, cache, alloc = self.m, w.cache, w.alloc
        in_flight: set[bytes] = set()
        if m.prefix_sharing:
            in_flight = {k for j in w.prefilling if (k := self._in_flight_key(j, j.tree_n * m.block_size))}
        deferred = 0  # waiting requests passed over this step, kept at the head of the queue
        while len(w.waiting) > deferred and len(w.prefilling) + len(w.decoding) < m.max_running:
            if deferred >= m.admit_window:
                break
            job = w.waiting[deferred]
            total = job.ids.size + job.out_ids.size
            if -(-total // m.block_size) > self.pool_pages:  # can never fit: like HTTP 413
                del w.waiting[deferred]
                w.outstanding -= 1
                w.pending_prefill -= job.pending
                self.rejected += 1
                self.skipped += self.src.drop_conversation(job.id)
                continue
            match = cache.match_prefix(job.ids)
            key = self._in_flight_key(job, match.num_tokens) if m.prefix_sharing else None
            if key is not None and key in in_flight:
                deferred += 1  # NOTE: another request computes this page now; take it from the tree next step
                continue
            need = -(-(total - match.num_tokens) // m.block_size)
            cache.lock(match.last_node)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            pages = alloc.alloc(need)
            if pages is None:  # NOTE: running requests hold the pool; retry when one finishes
                cache.unlock(match.last_node)
                return
            del w.waiting[deferred]
            job.node, job.pages = match.last_node, np.concatenate((match.pages, pages))
            job.tree_n = match.pages.size
            job.prefill_left = job.ids.size - match.num_tokens
            self.prompt_tokens += job.ids.size
            self.cached_tokens += match.num_tokens
            w.prefilling.append(job)
            if key is not None:
                in_flight.add(key)

    def _boundary(self, w: _Worker, t: float) -> None:
        """At a step boundary: admit, plan the next segment, publish the cache's events."""
        m = self.m
        self._admit(w)
        if w.prefilling:
            budget = max(1, int(m.chunked_prefill_tokens / self.weight))  # simulated tokens
            chunk = []
            for job in w.prefilling:
                n = min(job.prefill_left, budget)
                chunk.append((job, n))
                budget -= n
                if budget <= 0:
                    break
            w.chunk = chunk
            real = sum(n for _, n in chunk) * self.weight
            step = m.prefill_ms_per_token * real / 1e3
            w.seg = (t, step, 1)
        elif w.decoding:
            step = (m.decode_base_ms + m.decode_ms_per_seq * len(w.decoding)) / 1e3
            w.seg = (t, step, min(job.steps_left for job in w.decoding))
        else:
            w.seg = None
        if w.seg is not None:
            w.version += 1
            self._push(t + w.seg[1] * w.seg[2], 0, (w, w.version))
        if self.c.events:
            stored, removed, cleared = w.cache.drain_events()
            if stored or removed or cleared:
                if self.c.event_delay_s > 0:
                    self._push(t + self.c.event_delay_s, 2, (w.url, stored, removed, cleared))
                else:
                    self._apply_events(w.url, stored, removed, cleared)

    # ---------------------------------------------------------------- results
    def _summary(self, wall_s: float, t_first: float) -> dict[str, Any]:
        n_done = len(self.latency)
        span = max(self.last_finish - t_first, 1e-9)
        reqs = [w.requests for w in self.workers]
        busy = [w.busy_s for w in self.workers]
        dec_us = [ns / 1e3 for ns in self.decision_ns]

        def spread(xs: list[float]) -> float | None:
            mean = sum(xs) / len(xs)
            return round(max(xs) / mean, 3) if mean > 0 else None

        def ms(xs: list[float], q: float) -> float | None:
            v = percentile(xs, q)
            return None if v is None else round(v * 1e3, 2)

        nodes, entries = self.index.num_nodes, self.index.num_entries
        return {
            "simulated": True,
            "label": self.c.label or self.c.policy,
            "policy": self.c.policy,
            "params": self.policy.describe()["params"],
            "workers": self.c.workers,
            "source": self.src.describe(),
            "requests": len(self.decision_ns),
            "completed": n_done,
            "rejected": self.rejected,
            "skipped": self.skipped,
            "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_p50_ms": ms(self.ttft, 50),
            "ttft_p99_ms": ms(self.ttft, 99),
            "latency_p50_ms": ms(self.latency, 50),
            "latency_p99_ms": ms(self.latency, 99),
            "throughput_rps": round(n_done / span, 3),
            "output_tokens_per_s": round(self.output_tokens / span, 1),
            "sim_duration_s": round(span, 3),
            "load_spread_requests": spread(reqs),
            "load_spread_busy": spread(busy),
            "requests_per_worker_min_max": [min(reqs), max(reqs)],
            "max_waiting": max(w.max_waiting for w in self.workers),
            "decision_us_p50": round(percentile(dec_us, 50) or 0.0, 1),
            "decision_us_p99": round(percentile(dec_us, 99) or 0.0, 1),
            "event_apply_us_per_request": round(self.event_ns / 1e3 / max(1, len(dec_us)), 1),
            "index_entries": entries,
            "index_nodes": nodes,
            "index_mem_mb_est": round(
                (nodes * _BYTES_FIRST_ENTRY + (entries - nodes) * _BYTES_EXTRA_ENTRY) / 2**20, 1
            ),
            "wall_s": round(wall_s, 2),
            "config": {**asdict(self.c), "label": self.c.label or self.c.policy},
        }
