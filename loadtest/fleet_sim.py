"""The fleet simulator's engine: the real router policies and prefix index in front of N workers
that each run the real radix cache over a bounded page pool, timed by a cost model instead of GPUs.

Every latency and throughput it reports is simulated; only router CPU per decision is measured.
It never opens a socket, never sleeps, and never reads the wall clock for simulated time.
The command line is loadtest/cluster_sim.py; request sources are loadtest/sim_sources.py; one
simulated worker (cache, queues, admission) is loadtest/sim_worker.py.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from loadtest.report import percentile
from loadtest.sim_router import SimRouter
from loadtest.sim_sources import Source
from loadtest.sim_worker import SimJob, SimWorker, WorkerModel
from router.workers import PendingPrefill, Worker
from worker.kv_pages import transfer_chunking

SIM_POLICIES = ("round_robin", "random", "least_load", "prefix_hash", "cache_aware", "sticky")
# Index memory per block held (bytes): tracemalloc of PrefixIndex.insert for 100k fresh blocks,
# the block-hash ints included (the index keeps them); a further worker on the same blocks adds
# only a bit in the node's mask.
_BYTES_FIRST_ENTRY, _BYTES_EXTRA_ENTRY = 96, 0


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
    join_workers: int = 0  # workers added to the fleet (empty caches) at join_at_s: a scale-up
    join_at_s: float = 0.0  # simulated time of the join (s; arrivals start near 0)
    routers: int = 1  # router replicas; each request goes to one at random (a Service's spread)
    health_interval_s: float = 1.0  # each replica's health-check round: the workers' load reports
    prefill_report: bool = True  # workers report their prefill backlog (radixgate's do; others don't)
    # replica sync: each replica's in-flight and pending prefill per worker reach the others this
    # late (s) after every change (router/replica_sync.py over Redis pub/sub); None = off
    replica_sync_delay_s: float | None = None
    # the router's --kv-fetch-min-tokens (real tokens; 0 = off): a request whose pick is predicted to
    # hold this many fewer prompt tokens than another candidate fetches that KV (WorkerModel's kv_fetch_*)
    kv_fetch_min_tokens: int = 0


def check_config(config: SimConfig) -> None:
    """Raise ValueError for a configuration the simulator cannot run: counts below 1, negative
    sizes or times, an unknown schedule policy, or a policy name or parameter the router refuses
    (the policy is built once here, so a bad run is refused before any run starts)."""
    c = config
    for name in ("workers", "routers", "index_entries"):
        if getattr(c, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(c, name)}")
    for name in ("join_workers", "join_at_s", "event_delay_s", "prefill_tokens_per_load",
                 "health_interval_s", "kv_fetch_min_tokens"):  # fmt: skip
        if not getattr(c, name) >= 0:  # NOTE: NaN too: no simulated time compares with it
            raise ValueError(f"{name} must be >= 0, got {getattr(c, name)}")
    if c.replica_sync_delay_s is not None and not c.replica_sync_delay_s >= 0:
        raise ValueError(f"replica_sync_delay_s must be >= 0, got {c.replica_sync_delay_s}")
    c.model.check()
    if c.policy not in SIM_POLICIES:
        raise ValueError(f"unknown policy {c.policy!r}; choose from {', '.join(SIM_POLICIES)}")
    SimRouter(c.policy, c.params, 1, c.prefill_tokens_per_load, c.namespace)  # NOTE: refuses bad params


class ClusterSim:
    """One simulation run: ``ClusterSim(config, source).run()`` -> summary dict."""

    def __init__(self, config: SimConfig, source: Source) -> None:
        check_config(config)
        self.c, self.m, self.src = config, config.model, source
        self.weight = source.weight  # real tokens per simulated token (trace scale-down)
        sync = config.replica_sync_delay_s is not None and config.routers > 1
        # NOTE: the router sees simulated tokens
        fetch_min = math.ceil(config.kv_fetch_min_tokens / self.weight)
        # NOTE: a seeded policy's replicas draw apart (the same seed would have them pick alike)
        seeded = config.params.get("seed")
        self.routers = [
            SimRouter(config.policy, config.params if seeded is None else {**config.params, "seed": seeded + i},
                      config.index_entries, config.prefill_tokens_per_load, config.namespace,
                      partial(self._announce, i) if sync else None, fetch_min)
            for i in range(config.routers)
        ]  # fmt: skip
        self.now = 0.0  # simulated time of the event being handled
        self.pick_router = random.Random(0)
        self.workers = [
            SimWorker(f"http://sim-worker-{i}", self.m, config.events, config.namespace)
            for i in range(config.workers + config.join_workers)
        ]
        self.by_url = {w.url: w for w in self.workers}
        self.active = self.workers[: config.workers]  # the router's candidates; joiners come later
        self.joiners = self.workers[config.workers :]
        for w in self.active:
            for r in self.routers:
                r.add_worker(w.url)
        self.joined = False
        self.joiner_urls = {w.url for w in self.joiners}
        self.ttft_after_join: list[float] = []
        self.routed_after_join = self.to_joiners = 0
        self.heap: list[tuple[float, int, int, Any]] = []  # (time s, seq, kind, payload)
        self.seq = 0
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.output_tokens = 0
        self.rejected = self.skipped = 0
        self.last_finish = 0.0
        self.kv_fetches = dict.fromkeys(("ok", "cached", "miss", "busy", "error"), 0)  # as the worker counts
        self.kv_fetched_tokens = 0  # real tokens
        self.fetching = 0  # requests whose KV fetch is under way (in no worker's queue yet)
        self.kv_fetch_s: list[float] = []  # hint to request queued, fetches that brought KV

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
        self.arrivals_left = len(firsts)  # requests still to arrive: first turns, and later turns due
        if self.c.join_workers:
            self._push(self.c.join_at_s, 3, None)
        start, n, every = (firsts[0][0] if firsts else 0.0), len(self.routers), self.c.health_interval_s
        for i in range(n if every > 0 else 0):  # NOTE: replicas poll out of phase
            self._push(start + i * every / n, 4, i)
        while pos < len(firsts) or heap:
            if pos < len(firsts) and (not heap or firsts[pos][0] <= heap[0][0]):
                t, rid = firsts[pos]
                pos += 1
                self.now = t
                self._arrive(rid, t)
                continue
            t, _, kind, payload = heapq.heappop(heap)
            self.now = t
            if kind == 0:  # a worker's planned segment ends
                w, version = payload
                if version == w.version:
                    self._segment_end(w, t)
            elif kind == 1:  # a later turn arrives
                self._arrive(payload, t)
            elif kind == 3:  # the scale-up: new workers become candidates
                for w in self.joiners:
                    for r in self.routers:
                        r.add_worker(w.url)
                self.active = self.workers
                self.joined = True
            elif kind == 4:  # a replica's health-check round
                self._poll(payload, t)
            elif kind == 6:  # a KV fetch's stage: the receiver's lookup, the export, the import
                self._fetch_stage(*payload)
            elif kind == 5:  # a replica's announcement of its counts on a worker reaches the others
                sender, url, in_flight, pending = payload
                for i, r in enumerate(self.routers):
                    if i != sender and (view := r.workers.get(url)) is not None:
                        view.set_peer(str(sender), in_flight, pending)
            else:  # KV events reach the routers
                for r in self.routers:
                    r.apply_events(*payload)
        gc.unfreeze()
        return self._summary(time.perf_counter() - wall0, firsts[0][0] if firsts else 0.0)

    # ---------------------------------------------------------------- routers
    def _arrive(self, rid: int, t: float) -> None:
        self.arrivals_left -= 1
        ids = self.src.prompt_ids(rid)
        tokens = ids.tolist()  # NOTE: tokenization is not timed; the router's tokenizer gives a list
        router = self.routers[self.pick_router.randrange(len(self.routers))]
        urls = [w.url for w in self.active]
        view, uncached, source = router.route(tokens, self.m.block_size, self.src.group(rid), urls)
        w = self.by_url[view.url]
        w.requests += 1
        if self.joined:
            self.routed_after_join += 1
            self.to_joiners += w.url in self.joiner_urls
        job = SimJob(rid, ids, self.src.output_ids(rid), self.src.output_steps(rid), t)
        job.view, job.prefill = view, PendingPrefill(view, uncached)
        if source is not None:
            self.fetching += 1
            self._push(w.next_boundary(t), 6, ("lookup", w, self.by_url[source], job, t, 0, 0, 0.0))
            return
        w.enqueue(job)
        self._kick(w, t)

    # ---------------------------------------------------------------- KV transfer
    def _fetch_stage(self, stage: str, w: SimWorker, src: SimWorker, job: SimJob, t0: float, have: int,
                     n: int, deadline: float) -> None:  # fmt: skip
        """One stage of worker ``w`` fetching ``job``'s prompt KV from ``src`` (worker/kv_transfer.py):
        the lookup of its own cached prefix and the import run between w's steps, the export between
        src's; the request joins w's queue when the fetch ends, whatever its outcome. As on the
        worker, a fetch gives up at ``kv_fetch_timeout_s`` after the lookup, and the KV of transfers
        under way on a worker, out and in together, hold at most ``kv_fetch_max_tokens`` in host
        memory (each two groups of layers: the worker's transfer_chunking); a fetch that would wait
        more than ``kv_fetch_max_wait_ms`` for the receiver's link in, or an export for the source's
        link out, is refused (busy)."""
        m, t, ps = self.m, self.now, self.m.block_size
        bound = int(m.kv_fetch_max_tokens / self.weight)  # simulated tokens
        slabs = 2 * m.kv_layers

        def held(n: int) -> float:  # NOTE: in tokens' KV, as the bound
            return transfer_chunking(n, slabs, bound * slabs)[1] / slabs

        def queued_too_long(link_free: float) -> bool:  # NOTE: the worker's --kv-transfer-max-wait-ms
            return bool(m.kv_fetch_max_wait_ms) and link_free - t > m.kv_fetch_max_wait_ms / 1e3

        if stage == "lookup":
            have = w.cache.cached_prefix_len(job.ids)
            matchable = (job.ids.size - 1) // ps * ps  # NOTE: a match always leaves a token to compute
            timely = w.link.timely(m.kv_fetch_timeout_s, 1, ps)  # NOTE: the worker's, in simulated tokens
            cap = min(bound * slabs // 2 // ps * ps, w.alloc.num_pages // 2 * ps, matchable - have, timely)
            if cap < ps:
                self._fetched(w, job, "cached", t0)
                return
            if queued_too_long(w.link_in_free):
                self._fetched(w, job, "busy", t0)  # NOTE: the receiver does not ask
                return
            self._push(
                src.next_boundary(t), 6, ("export", w, src, job, t0, have, cap, t + m.kv_fetch_timeout_s)
            )
        elif stage == "export":
            answered = t + m.kv_fetch_base_ms / 1e3
            # NOTE: the source's 503 kv_transfer_busy (n: what was asked for)
            if queued_too_long(src.link_out_free) or src.kv_held + held(n) > bound:
                self._push(answered, 6, ("busy", w, src, job, t0, have, 0, deadline))
                return
            n = src.export_len(job.ids, have, n)
            if n == 0:
                self._push(answered, 6, ("miss", w, src, job, t0, have, 0, deadline))
                return
            h = held(n)
            if w.kv_held + h > bound:  # NOTE: the receiver drops it on reading the headers
                self._push(answered, 6, ("busy", w, src, job, t0, have, 0, deadline))
                return
            copy_ms = m.host_copy_ms_per_token * n * self.weight
            if src.seg is not None:  # NOTE: a busy source's next step waits for the copy
                src.extra_ms += copy_ms
            src.kv_held += h
            w.kv_held += h
            # NOTE: one transfer at a time on the source's way out and on the receiver's way in
            start = max(t + (copy_ms + m.kv_fetch_base_ms) / 1e3, src.link_out_free, w.link_in_free)
            end = start + m.kv_fetch_ms_per_token * n * self.weight / 1e3
            if end > deadline:  # NOTE: cut off; the link carried it until then
                if start < deadline:
                    src.link_out_free = w.link_in_free = deadline
                self._push(deadline, 6, ("timeout", w, src, job, t0, have, n, deadline))
                return
            src.link_out_free = w.link_in_free = end
            self._push(end, 6, ("import", w, src, job, t0, have, n, deadline))
        elif stage in ("import", "timeout"):
            src.kv_held -= held(n)
            w.kv_held -= held(n)
            if stage == "timeout":
                self._fetched(w, job, "error", t0)
                return
            w.link.seen(n, t - (deadline - m.kv_fetch_timeout_s))  # NOTE: from the lookup, as the worker
            got, pages = w.import_len(job.ids, have, n)
            w.extra_ms += m.host_copy_ms_per_token * pages * ps * self.weight
            self.kv_fetched_tokens += got * self.weight
            self._fetched(w, job, "ok" if got else "cached", t0)
        else:  # miss or busy
            self._fetched(w, job, stage, t0)

    def _fetched(self, w: SimWorker, job: SimJob, outcome: str, t0: float) -> None:
        self.fetching -= 1
        self.kv_fetches[outcome] += 1
        if outcome == "ok":
            self.kv_fetch_s.append(self.now - t0)
        w.enqueue(job)
        self._kick(w, self.now)

    def _announce(self, replica: int, view: Worker) -> None:
        """Replica sync: ``replica``'s counts on a worker changed; the others hear it a bit later."""
        payload = (replica, view.url, view.in_flight, view.pending_prefill)
        self._push(self.now + (self.c.replica_sync_delay_s or 0.0), 5, payload)

    def _poll(self, replica: int, t: float) -> None:
        """What ``GET /health`` of every worker tells one replica; the next round while work remains."""
        reports = {w.url: w.report() for w in self.active}
        if not self.c.prefill_report:
            reports = {url: (queue, 0) for url, (queue, _) in reports.items()}
        self.routers[replica].apply_reports(reports)
        if self.arrivals_left > 0 or self.fetching or any(w.has_work() for w in self.workers):
            self._push(t + self.c.health_interval_s, 4, replica)

    # ---------------------------------------------------------------- workers
    def _kick(self, w: SimWorker, t: float) -> None:
        """A request joined ``w``'s queue at ``t``: start it now if idle, or cut a decode-only
        segment at its next step boundary so the request is admitted there."""
        if w.seg is None:
            self._boundary(w, t)
            return
        start, step, steps = w.seg
        if w.chunk or len(w.prefilling) + len(w.decoding) >= self.m.max_running:
            return  # a prefill step is a single step; a full batch admits nothing until a finish
        done = w.steps_by(t)
        if done < steps:
            w.seg = (start, step, done)
            w.version += 1
            self._push(start + done * step, 0, (w, w.version))

    def _segment_end(self, w: SimWorker, t: float) -> None:
        _, step, steps = w.seg  # type: ignore[misc]
        w.busy_s += step * steps
        if not w.chunk:  # a decode segment: every decoding request made ``steps`` tokens
            for job in w.decoding:
                job.steps_left -= steps
        for job, n in w.chunk:
            job.prefill_left -= n
            if self.m.prefix_sharing:
                w.cache_prompt(job)
            if job.prefill_left == 0:
                job.ttft = t
                job.prefill.release()
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

    def _finish(self, w: SimWorker, job: SimJob, t: float) -> None:
        w.release(job)
        job.view.in_flight -= 1
        job.view.changed()
        self.ttft.append(job.ttft - job.start)
        if self.c.join_workers and job.start >= self.c.join_at_s:
            self.ttft_after_join.append(job.ttft - job.start)
        self.latency.append(t - job.start)
        self.output_tokens += self.src.output_steps(job.id)
        self.last_finish = max(self.last_finish, t)
        nxt = self.src.next_turn(job.id)
        if nxt is not None:
            self.arrivals_left += 1
            self._push(t + self.src.think_s(nxt), 1, nxt)

    def _admit(self, w: SimWorker, t: float) -> None:
        for job in w.admit(t):  # NOTE: can never fit the pool: the worker's context_length_exceeded
            job.view.in_flight -= 1
            job.prefill.release()
            job.view.changed()
            self.rejected += 1
            self.skipped += self.src.drop_conversation(job.id)

    def _boundary(self, w: SimWorker, t: float) -> None:
        """At a step boundary: admit, plan the next segment, publish the cache's events."""
        m = self.m
        self._admit(w, t)
        # NOTE: as the worker's scheduler: a prefill step, then a decode step while requests decode
        if w.prefilling and not (w.decoding and w.after_prefill):
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
            copied = w.cache.offloaded_pages + w.cache.loaded_pages
            copy_ms = m.host_copy_ms_per_token * (copied - w.copied_pages) * m.block_size * self.weight
            w.copied_pages = copied
            step = (m.prefill_ms_per_token * real + copy_ms + w.extra_ms) / 1e3
            w.seg, w.extra_ms, w.after_prefill = (t, step, 1), 0.0, True
        elif w.decoding:
            w.after_prefill = False
            step = (m.decode_base_ms + m.decode_ms_per_seq * len(w.decoding)) / 1e3
            if w.extra_ms:  # NOTE: one step carries the copies between steps
                w.seg, w.extra_ms = (t, step + w.extra_ms / 1e3, 1), 0.0
            else:  # NOTE: one step when a prefill waits for it
                w.seg = (t, step, 1 if w.prefilling else min(job.steps_left for job in w.decoding))
        else:
            w.seg, w.extra_ms = None, 0.0
        if w.seg is not None:
            w.version += 1
            self._push(t + w.seg[1] * w.seg[2], 0, (w, w.version))
        if self.c.events:
            stored, removed, cleared = w.cache.drain_events()
            if stored or removed or cleared:
                if self.c.event_delay_s > 0:
                    self._push(t + self.c.event_delay_s, 2, (w.url, stored, removed, cleared))
                else:
                    for r in self.routers:
                        r.apply_events(w.url, stored, removed, cleared)

    # ---------------------------------------------------------------- results
    def _join_summary(self, ms: Any) -> dict[str, Any]:
        """For a run with a scale-up: where the requests routed after the join went, and TTFT of
        the requests that arrived after it."""
        if not self.c.join_workers:
            return {}
        n, total = self.c.join_workers, self.c.workers + self.c.join_workers
        return {
            "join": {
                "workers": n,
                "at_s": self.c.join_at_s,
                "routed_after": self.routed_after_join,
                "share_to_joiners": round(self.to_joiners / max(1, self.routed_after_join), 4),
                "fair_share": round(n / total, 4),
                "joiner_requests": [w.requests for w in self.joiners],
                "ttft_p50_ms_after": ms(self.ttft_after_join, 50),
                "ttft_p99_ms_after": ms(self.ttft_after_join, 99),
            }
        }

    def _summary(self, wall_s: float, t_first: float) -> dict[str, Any]:
        n_done = len(self.latency)
        # NOTE: the summary's token counts are real tokens (simulated ones x the trace's weight)
        prompt = round(sum(w.prompt_tokens for w in self.workers) * self.weight)
        cached = round(sum(w.cached_tokens for w in self.workers) * self.weight)
        host_loaded = round(sum(w.cache.loaded_pages for w in self.workers) * self.m.block_size * self.weight)
        span = max(self.last_finish - t_first, 1e-9)
        reqs = [w.requests for w in self.workers]
        busy = [w.busy_s for w in self.workers]
        dec_us = [ns / 1e3 for r in self.routers for ns in r.decision_ns]
        first = self.routers[0]  # NOTE: index size and event cost are per replica: the first one's

        def spread(xs: list[float]) -> float | None:
            mean = sum(xs) / len(xs)
            return round(max(xs) / mean, 3) if mean > 0 else None

        def ms(xs: list[float], q: float) -> float | None:
            v = percentile(xs, q)
            return None if v is None else round(v * 1e3, 2)

        nodes, entries = first.index.num_nodes, first.index.num_entries
        return {
            "simulated": True,
            "label": self.c.label or self.c.policy,
            "policy": self.c.policy,
            "params": first.policy.describe()["params"],
            "workers": self.c.workers,
            "source": self.src.describe(),
            "requests": len(dec_us),
            "completed": n_done,
            "rejected": self.rejected,
            "skipped": self.skipped,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "token_weight": self.weight,  # real tokens per simulated token
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "host_loaded_tokens": host_loaded,
            "kv_fetches": dict(self.kv_fetches),
            "kv_fetched_tokens": round(self.kv_fetched_tokens),
            "kv_fetched_share": round(self.kv_fetched_tokens / prompt, 4) if prompt else None,
            "kv_fetch_p50_ms": ms(self.kv_fetch_s, 50),
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
            # NOTE: a replica applies every worker's events: its time over all the fleet's requests
            "event_apply_us_per_request": round(first.event_ns / 1e3 / max(1, len(dec_us)), 1),
            "index_entries": entries,
            "index_nodes": nodes,
            # NOTE: MiB (2**20 bytes); the name is the committed JSON's
            "index_mem_mb_est": round(
                (nodes * _BYTES_FIRST_ENTRY + (entries - nodes) * _BYTES_EXTRA_ENTRY) / 2**20, 1
            ),
            **self._join_summary(ms),
            "wall_s": round(wall_s, 2),
            "config": {**asdict(self.c), "label": self.c.label or self.c.policy},
        }
