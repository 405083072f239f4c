"""Discrete-event fleet simulator: the real router policies and prefix index in front of N workers
that each run the real radix cache over a bounded page pool, timed by a cost model instead of GPUs.

Every latency and throughput it prints is simulated; only router CPU per decision is measured.
It never opens a socket, never sleeps, and never reads the wall clock for simulated time.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import mmh3
import numpy as np
import orjson

from loadtest.report import percentile
from loadtest.trace import TRACE_BLOCK_TOKENS, read_trace
from loadtest.workloads import continue_body, generate, random_text
from router.block_hash import block_hashes
from router.policies import Candidate, Policy, RouteRequest, make_policy
from router.prefix_index import PrefixIndex
from router.tokenization import ByteTokenizer
from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache

SIM_POLICIES = ("round_robin", "random", "least_load", "prefix_hash", "cache_aware", "sticky")
# Index memory estimate per (block, worker) entry, from router/prefix_index.py's measurements (bytes).
_BYTES_FIRST_ENTRY, _BYTES_EXTRA_ENTRY = 210, 145


@dataclass
class WorkerModel:
    """One worker's service model, the same cost model as ``python -m worker --engine sim`` (see
    worker/sim_engine.py for where the defaults come from). The defaults are ESTIMATES for one H100
    serving Llama-3-8B in bf16, not measurements: a prefill (extend) step costs 0.07 ms per uncached
    prompt token (~14k tokens/s); a decode step costs 7 ms + 0.06 ms per decoding request; the KV pool
    holds 400k tokens. Prefill and decode steps alternate (a prefill step stalls decoding)."""

    prefill_ms_per_token: float = 0.07  # per uncached prompt token (real tokens)
    decode_base_ms: float = 7.0  # one decode step at batch size 1
    decode_ms_per_seq: float = 0.06  # per decoding request in the step
    max_running: int = 256  # requests admitted at once; the rest wait in FCFS order
    chunked_prefill_tokens: int = 2048  # real prompt tokens prefilled per step
    kv_tokens: int = 400_000  # KV pool per worker, in simulated tokens (pages = kv_tokens // block_size)
    block_size: int = 16  # tokens per page = router block size


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
    namespace: str = "default"  # block-hash root: the model name


# ------------------------------------------------------------------------ request sources
def _synthetic_ids(rid: int, n: int) -> np.ndarray:
    """Token ids for generated output nobody else shares (only the finished sequence is cached)."""
    return ((np.arange(n, dtype=np.int64) + (1 << 29) + rid * 1031) % (1 << 31)).astype(np.int32)


class WorkloadSource:
    """A loadtest.workloads workload as token ids: UTF-8 bytes of the prompt rendered like the
    router's default ``bytes`` tokenizer. A multi-turn reply is seeded text of ``max_tokens``
    characters; the worker caches prompt + reply, so the next turn can hit all of it."""

    weight = 1.0  # real tokens per simulated token

    def __init__(self, name: str, n: int, rate: float, max_tokens: int, seed: int, options: dict) -> None:
        self.name, self.rate, self.seed, self.options = name, rate, seed, options
        self.reqs = generate(name, n, seed=seed, rate=rate, max_tokens=max_tokens, **options)
        self._next = {r.after: r.id for r in self.reqs if r.after is not None}
        self._tok = ByteTokenizer()
        self.reset()

    def describe(self) -> dict[str, Any]:
        return {"workload": self.name, "requests": len(self.reqs), "rate": self.rate, "seed": self.seed,
                "options": self.options}  # fmt: skip

    def reset(self) -> None:
        self._full: dict[int, dict] = {}  # full bodies a later turn still has to extend

    def first_turns(self) -> list[tuple[float, int]]:
        return sorted((r.arrival_s, r.id) for r in self.reqs if r.after is None)

    def _reply(self, rid: int) -> str:
        return random_text(random.Random(f"reply:{self.seed}:{rid}"), self.output_steps(rid))

    def prompt_ids(self, rid: int) -> np.ndarray:
        r = self.reqs[rid]
        body = r.body if r.after is None else continue_body(self._full.pop(r.after), self._reply(r.after), r)
        if rid in self._next:
            self._full[rid] = body
        text = self._tok.render_chat(body["messages"]) if "messages" in body else body["prompt"]
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    def output_ids(self, rid: int) -> np.ndarray:
        if rid in self._next:
            return np.frombuffer(self._reply(rid).encode(), np.uint8).astype(np.int32)
        return _synthetic_ids(rid, self.output_steps(rid))

    def output_steps(self, rid: int) -> int:
        return max(1, int(self.reqs[rid].body.get("max_tokens") or 1))

    def group(self, rid: int) -> str:
        return self.reqs[rid].group

    def next_turn(self, rid: int) -> int | None:
        return self._next.get(rid)

    def think_s(self, rid: int) -> float:
        return self.reqs[rid].think_time_s

    def drop_conversation(self, rid: int) -> int:
        """``rid`` was rejected: its later turns are never sent. Returns how many."""
        dropped, nxt = 0, self._next.get(rid)
        self._full.pop(rid, None)
        while nxt is not None:
            dropped, nxt = dropped + 1, self._next.get(nxt)
        return dropped


class TraceSource:
    """A Mooncake trace with each 512-token hash id mapped straight to ``tokens_per_block``
    synthetic token ids (id * tokens_per_block + j), so leading shared ids are shared prefixes.
    Costs are charged in real tokens: one simulated token stands for ``weight`` real ones."""

    def __init__(self, path: str, limit: int | None, tokens_per_block: int, time_scale: float, seed: int):
        if tokens_per_block <= 0 or TRACE_BLOCK_TOKENS % tokens_per_block:
            raise ValueError(f"tokens per block must divide {TRACE_BLOCK_TOKENS}")
        self.path, self.tpb, self.time_scale = path, tokens_per_block, time_scale
        self.recs = read_trace(path, limit)
        self.weight = TRACE_BLOCK_TOKENS / tokens_per_block

    def describe(self) -> dict[str, Any]:
        return {"trace": self.path, "requests": len(self.recs), "tokens_per_block": self.tpb,
                "time_scale": self.time_scale}  # fmt: skip

    def reset(self) -> None:
        pass

    def first_turns(self) -> list[tuple[float, int]]:
        t0 = self.recs[0].timestamp_ms if self.recs else 0.0
        return sorted(((r.timestamp_ms - t0) / 1e3 * self.time_scale, i) for i, r in enumerate(self.recs))

    def prompt_ids(self, rid: int) -> np.ndarray:
        rec, tpb = self.recs[rid], self.tpb
        n = max(1, rec.input_length * tpb // TRACE_BLOCK_TOKENS)
        nb = -(-n // tpb)
        # NOTE: blocks past the record's ids are private to it: a range no hash id reaches.
        private = (1 << 30) + rid * 512 * tpb
        bases = [rec.hash_ids[b] * tpb if b < len(rec.hash_ids) else private + b * tpb for b in range(nb)]
        ids = (np.asarray(bases, dtype=np.int64)[:, None] + np.arange(tpb)).reshape(-1)[:n]
        return (ids % (1 << 31)).astype(np.int32)

    def output_ids(self, rid: int) -> np.ndarray:
        return _synthetic_ids(rid, -(-self.output_steps(rid) // int(self.weight)))

    def output_steps(self, rid: int) -> int:
        return max(1, self.recs[rid].output_length)

    def group(self, rid: int) -> str:
        ids = self.recs[rid].hash_ids
        return f"root-{ids[0]}" if ids else f"private-{rid}"

    def next_turn(self, rid: int) -> int | None:
        return None

    def think_s(self, rid: int) -> float:
        return 0.0

    def drop_conversation(self, rid: int) -> int:
        return 0


Source = WorkloadSource | TraceSource


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
    __slots__ = ("cached", "id", "ids", "node", "out_ids", "pages", "prefill_left", "prefix_pages",
                 "start", "steps_left", "ttft")  # fmt: skip

    def __init__(self, rid: int, ids: np.ndarray, out_ids: np.ndarray, steps: int, start: float):
        self.id, self.ids, self.out_ids, self.steps_left, self.start = rid, ids, out_ids, steps, start
        self.ttft = 0.0


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
        candidates = [Candidate(w.url, float(w.outstanding)) for w in self.workers]
        if isinstance(policy, StickyPolicy):
            url = policy.select_group(self.src.group(rid), candidates)
        else:
            url = policy.select(route, candidates).url
        policy.on_routed(route, url)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        w = self.by_url[url]
        w.outstanding += 1
        w.requests += 1
        w.waiting.append(_Job(rid, ids, self.src.output_ids(rid), self.src.output_steps(rid), t))
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
            if job.prefill_left == 0:
                job.ttft = t
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

    def _finish(self, w: _Worker, job: _Job, t: float) -> None:
        ps, cache = self.m.block_size, w.cache
        seq = np.concatenate((job.ids, job.out_ids))
        n_full = seq.size // ps
        n_prefix = job.prefix_pages.size
        own = n_full - n_prefix  # NOTE: our pages that hold full pages of the sequence
        pos = cache.insert(seq[: n_full * ps], np.concatenate((job.prefix_pages, job.pages[:own])))
        dup = pos // ps - n_prefix  # our pages whose tokens another request cached meanwhile
        if dup > 0:
            w.alloc.free(job.pages[:dup])
        w.alloc.free(job.pages[own:])
        cache.unlock(job.node)
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
        while w.waiting and len(w.prefilling) + len(w.decoding) < m.max_running:
            job = w.waiting[0]
            total = job.ids.size + job.out_ids.size
            if -(-total // m.block_size) > self.pool_pages:  # can never fit: like HTTP 413
                w.waiting.popleft()
                w.outstanding -= 1
                self.rejected += 1
                self.skipped += self.src.drop_conversation(job.id)
                continue
            match = cache.match_prefix(job.ids)
            need = -(-(total - match.num_tokens) // m.block_size)
            cache.lock(match.last_node)
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            pages = alloc.alloc(need)
            if pages is None:  # NOTE: running requests hold the pool; retry when one finishes
                cache.unlock(match.last_node)
                return
            w.waiting.popleft()
            job.node, job.prefix_pages, job.pages = match.last_node, match.pages, pages
            job.cached = match.num_tokens
            job.prefill_left = job.ids.size - match.num_tokens
            self.prompt_tokens += job.ids.size
            self.cached_tokens += match.num_tokens
            w.prefilling.append(job)

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


_ROWS = [  # (title, key, format)
    ("fleet hit rate", "hit_rate", "{:.1%}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
    ("latency p50 (ms)", "latency_p50_ms", "{:.1f}"),
    ("throughput (req/s)", "throughput_rps", "{:.2f}"),
    ("output tokens/s", "output_tokens_per_s", "{:.0f}"),
    ("load max/mean (requests)", "load_spread_requests", "{:.2f}"),
    ("load max/mean (busy time)", "load_spread_busy", "{:.2f}"),
    ("max queue on a worker", "max_waiting", "{}"),
    ("completed / rejected", None, None),
    ("router CPU/decision p50 (us, measured)", "decision_us_p50", "{:.0f}"),
    ("router CPU/decision p99 (us, measured)", "decision_us_p99", "{:.0f}"),
    ("index entries", "index_entries", "{:,}"),
    ("index memory (MB, est.)", "index_mem_mb_est", "{:.1f}"),
]


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    """One column per run, one row per metric; the header says the numbers are simulated."""
    lines = ["| simulated | " + " | ".join(s["label"] for s in summaries) + " |",
             "|---|" + "---|" * len(summaries)]  # fmt: skip
    for title, key, fmt in _ROWS:
        cells = []
        for s in summaries:
            if key is None:
                cells.append(f"{s['completed']} / {s['rejected']}")
            else:
                v = s.get(key)
                cells.append("n/a" if v is None else fmt.format(v))  # type: ignore[union-attr]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_run(text: str) -> tuple[str, str, dict[str, Any]]:
    """``POLICY``, ``LABEL=POLICY`` or ``LABEL=POLICY:K=V,K=V`` -> (label, policy, params)."""
    label, sep, rest = text.partition("=")
    if not sep or ":" in label:
        label, rest = "", text
    policy, _, raw = rest.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, raw.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"policy parameter must be KEY=VALUE, got {item!r}")
        params[key] = _number(value)
    return label or (policy if not params else f"{policy}({raw})"), policy, params


def _number(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return None if value == "None" else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.cluster_sim", description=__doc__)
    p.add_argument("--workload", default="tenants", help="a loadtest.workloads name, or 'trace'")
    p.add_argument("--trace", help="Mooncake JSONL (with --workload trace)")
    p.add_argument("--trace-tokens-per-block", type=int, default=32, help="simulated tokens per 512-token id")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=50.0, help="Poisson arrivals, requests/s (not for traces)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (workloads)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="workload knob")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--policies", default="round_robin,least_load,prefix_hash,cache_aware,sticky")
    p.add_argument("--run", action="append", default=[], metavar="LABEL=POLICY:K=V,...",
                   help="an extra run with policy parameters (repeatable)")  # fmt: skip
    d = WorkerModel()
    for name in asdict(d):
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name))
    p.add_argument("--no-events", action="store_true", help="router index learns only from its own routing")
    p.add_argument("--event-delay-ms", type=float, default=0.0)
    p.add_argument("--index-entries", type=int, default=2_000_000)
    p.add_argument("--json", help="write all summaries here")
    p.add_argument("--md", help="write the markdown table here")
    a = p.parse_args(argv)
    try:
        runs = [parse_run(x) for x in filter(None, a.policies.split(","))] + [parse_run(x) for x in a.run]
        for _, policy, _ in runs:
            if policy not in SIM_POLICIES:
                raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(SIM_POLICIES)}")
        options = dict(x.split("=", 1) for x in a.option)
        if a.workload == "trace":
            if not a.trace:
                raise ValueError("--workload trace needs --trace PATH")
            source: Source = TraceSource(a.trace, a.requests, a.trace_tokens_per_block, a.time_scale, a.seed)
        else:
            source = WorkloadSource(a.workload, a.requests, a.rate, a.max_tokens, a.seed,
                                    {k: _number(v) for k, v in options.items()})  # fmt: skip
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = WorkerModel(**{k: getattr(a, k) for k in asdict(d)})
    summaries = []
    for label, policy, params in runs:
        cfg = SimConfig(a.workers, policy, params, label, model, not a.no_events, a.event_delay_ms / 1e3,
                        a.index_entries)  # fmt: skip
        summaries.append(ClusterSim(cfg, source).run())
        print(f"# {label}: simulated in {summaries[-1]['wall_s']} s wall", file=sys.stderr)
    table = markdown_table(summaries)
    sys.stdout.write(table)
    if a.md:
        with open(a.md, "w") as f:
            f.write(table)
    if a.json:
        with open(a.json, "wb") as f:
            f.write(orjson.dumps({"simulated": True, "argv": sys.argv[1:] if argv is None else argv,
                                  "runs": summaries}, option=orjson.OPT_INDENT_2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
