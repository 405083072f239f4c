"""Worker Prometheus metrics: cache hit rate, KV usage, queue sizes, evictions, latency histograms,
prefill/decode throughput. Reads engine snapshots; never touches the cache or the model itself."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixgate_worker"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0)


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine state after a step; counters are cumulative since start (tokens unless named)."""

    t: float = 0.0  # monotonic s
    running: int = 0  # admitted requests (prefilling + decoding)
    waiting: int = 0  # queued, not admitted yet
    prefill_backlog_tokens: int = 0  # prompt tokens still to prefill (Scheduler.prefill_backlog)
    kv_pages_total: int = 1
    kv_pages_free: int = 1
    kv_pages_cached: int = 0  # pages held by the radix tree (locked or not)
    kv_pages_evictable: int = 0  # tree pages no request holds
    page_size: int = 16
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # computed by extend steps
    decode_tokens: int = 0
    evicted_pages: int = 0
    retractions: int = 0
    host_pages_total: int = 0  # host-memory KV tier size (0: no tier)
    host_pages_cached: int = 0  # host pages held by the radix tree
    host_offloaded_pages: int = 0  # device pages copied to the host tier on eviction
    host_loaded_pages: int = 0  # host pages copied back for a cache hit
    host_dropped_pages: int = 0  # host pages dropped for room (those blocks left the cache)
    verify_steps: int = 0  # speculative decoding: decode steps that checked drafts
    draft_tokens: int = 0  # drafts proposed to those steps
    accepted_tokens: int = 0  # of those, kept
    ahead_steps: int = 0  # decode steps scheduled while the step before ran (--overlap-schedule)
    salt_namespaces: int = 0  # cache namespaces held by cache salts (worker.cache_salt)
    salt_waiting: int = 0  # of the waiting requests, those waiting for a salt namespace
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    @property
    def kv_pages_active(self) -> int:
        """Pages requests hold right now (not reclaimable by eviction)."""
        return self.kv_pages_total - self.kv_pages_free - self.kv_pages_evictable

    @property
    def kv_usage(self) -> float:
        return self.kv_pages_active / self.kv_pages_total

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class WorkerMetrics:
    """Histograms observed by the engine thread; everything else derived at scrape time from the
    latest snapshot and a short history of snapshots (windowed hit rate and tokens/s)."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        event_stats: Callable[[], dict[str, int]] = dict,
        hit_window_s: float = 60.0,
        rate_window_s: float = 10.0,
    ) -> None:
        self._snapshot = snapshot
        self._event_stats = event_stats
        self.hit_window_s = hit_window_s
        self.rate_window_s = rate_window_s
        self._history: deque[EngineSnapshot] = deque()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of one request.",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "Arrival to last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.constrained = Counter(
            f"{PREFIX}_constrained_requests_total",
            "Requests generated under a grammar, by kind: json_schema, json_object, regex, choice, "
            "grammar, tool_call (a required or named tool call), tool_auto (free text whose tool calls follow "
            "their schemas: tool_choice auto).",
            ["kind"],
            registry=self.registry,
        )
        self.queue_full = Counter(
            f"{PREFIX}_queue_full_requests_total",
            "Requests refused with 429 queue_full: at submit (the client's answer), or at admission when "
            "retracted requests had filled the queue since (also a finished request with reason error).",
            registry=self.registry,
        )
        self.tool_calls = Counter(
            f"{PREFIX}_tool_calls_total",
            "Tool calls answered (read from the text, or generated for a required or named tool_choice).",
            registry=self.registry,
        )
        self.kv_fetch = Counter(
            f"{PREFIX}_kv_fetch_total",
            "KV fetches from another worker before a request a router hinted (x-radixgate-kv-source), by "
            "outcome: ok, cached (nothing to fetch), miss (the source had nothing more), busy (this worker's or "
            "the source's transfers at their memory bound, or queued past --kv-transfer-max-wait-ms), wasted "
            "(the KV came but this worker's prefix left its cache meanwhile, or no pages could be freed), error, "
            "cut (the client left while it was fetched).",
            ["outcome"],
            registry=self.registry,
        )
        self.kv_fetched_tokens = Counter(
            f"{PREFIX}_kv_fetched_tokens",
            "Prompt tokens whose KV was fetched from another worker and cached here.",
            registry=self.registry,
        )
        self.kv_fetch_seconds = Histogram(
            f"{PREFIX}_kv_fetch_seconds",
            "A successful KV fetch, from the local lookup to the KV cached here.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_exported_tokens = Counter(
            f"{PREFIX}_kv_exported_tokens",
            "Cached tokens whose KV this worker sent to another worker.",
            registry=self.registry,
        )
        self.kv_export = Counter(
            f"{PREFIX}_kv_export_total",
            "KV exports asked of this worker by others (POST /v1/kv/export), by outcome: ok (sent whole), "
            "not_cached (nothing cached beyond 'start'), busy (transfers under way at the memory bound, or "
            "queued past --kv-transfer-max-wait-ms), cut (the receiver left before the whole body was sent).",
            ["outcome"],
            registry=self.registry,
        )
        self.kv_transfer_held = Gauge(
            f"{PREFIX}_kv_transfer_held_bytes",
            "Host memory held now for KV transfers under way, fetches and exports (bound: --kv-transfer-max-mib).",
            registry=self.registry,
        )
        self.registry.register(_SnapshotCollector(self))

    def record(self, snap: EngineSnapshot) -> None:
        """Keep ``snap`` for windowed rates (called after engine steps; at most ~4 samples/s kept)."""
        with self._lock:
            h = self._history
            # NOTE: the newest sample moves on only while it is within 0.25 s of the one before it, so
            # steps closer than that still leave a sample every 0.25 s (not one that moves for ever)
            if len(h) >= 2 and snap.t - h[-2].t < 0.25:
                h[-1] = snap
            else:
                h.append(snap)
            horizon = snap.t - max(self.hit_window_s, self.rate_window_s) - 1.0
            while len(self._history) > 2 and self._history[1].t < horizon:
                self._history.popleft()

    def _since(self, now: EngineSnapshot, window_s: float) -> EngineSnapshot | None:
        """The oldest kept snapshot within ``window_s`` of ``now``."""
        with self._lock:
            for old in self._history:
                if now.t - old.t <= window_s:
                    return old
        return None

    def recent_hit_rate(self, now: EngineSnapshot) -> float:
        old = self._since(now, self.hit_window_s)
        if old is None:
            return now.hit_rate
        prompt = now.prompt_tokens - old.prompt_tokens
        return (now.cached_tokens - old.cached_tokens) / prompt if prompt > 0 else 0.0

    def token_rates(self, now: EngineSnapshot) -> tuple[float, float]:
        """(prefill, decode) tokens per second over the rate window."""
        old = self._since(now, self.rate_window_s)
        if old is None or now.t - old.t <= 0:
            return 0.0, 0.0
        dt = now.t - old.t
        return (now.prefill_tokens - old.prefill_tokens) / dt, (now.decode_tokens - old.decode_tokens) / dt

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self.m._snapshot()
        now = snap if snap.t else EngineSnapshot(t=time.monotonic())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge("running_requests", "Admitted requests (prefilling or decoding).", snap.running)
        yield gauge("waiting_requests", "Requests queued for admission.", snap.waiting)
        yield gauge("cache_salt_namespaces", "Cache namespaces held by cache salts.", snap.salt_namespaces)
        yield gauge(
            "cache_salt_waiting_requests", "Requests waiting for a cache salt namespace.", snap.salt_waiting
        )
        yield gauge("prefill_backlog_tokens", "Prompt tokens still to prefill (admitted and waiting).",
                    snap.prefill_backlog_tokens)  # fmt: skip
        yield gauge("kv_usage", "Fraction of KV pages held by requests (not reclaimable).", snap.kv_usage)
        yield gauge("kv_cached_pages", "KV pages held by the radix cache.", snap.kv_pages_cached)
        yield gauge("kv_capacity_tokens", "KV pool size in tokens.", snap.kv_pages_total * snap.page_size)
        yield gauge("cache_hit_rate", "Cached / prompt tokens since start.", snap.hit_rate)
        yield gauge(
            "cache_hit_rate_recent",
            f"Cached / prompt tokens over the last {self.m.hit_window_s:g} s.",
            self.m.recent_hit_rate(now),
        )
        prefill_rate, decode_rate = self.m.token_rates(now)
        yield gauge("prefill_tokens_per_second", "Computed prompt tokens/s (recent).", prefill_rate)
        yield gauge("decode_tokens_per_second", "Generated tokens/s (recent).", decode_rate)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests.", snap.prompt_tokens)
        yield counter("cached_tokens", "Prompt tokens served from the radix cache.", snap.cached_tokens)
        yield counter("prefill_computed_tokens", "Tokens computed by prefill steps.", snap.prefill_tokens)
        yield counter("generation_tokens", "Tokens generated by decode steps.", snap.decode_tokens)
        yield counter("evicted_pages", "KV pages evicted from the radix cache.", snap.evicted_pages)
        yield counter("retracted_requests", "Requests preempted to free KV pages.", snap.retractions)
        yield counter("spec_verify_steps", "Decode steps that checked draft tokens (speculative decoding).",
                      snap.verify_steps)  # fmt: skip
        yield counter("spec_draft_tokens", "Draft tokens proposed to verify steps.", snap.draft_tokens)
        yield counter(
            "spec_accepted_tokens", "Draft tokens the model agreed with (kept).", snap.accepted_tokens
        )
        yield counter("overlapped_steps", "Decode steps scheduled and launched while the step before ran.",
                      snap.ahead_steps)  # fmt: skip
        if snap.host_pages_total:
            ps = snap.page_size
            yield gauge(
                "host_cache_capacity_tokens",
                "Host-memory KV tier size in tokens.",
                snap.host_pages_total * ps,
            )
            yield gauge(
                "host_cache_tokens", "Tokens held in the host-memory KV tier.", snap.host_pages_cached * ps
            )
            yield counter("host_offloaded_tokens", "Evicted KV tokens copied to the host tier.",
                          snap.host_offloaded_pages * ps)  # fmt: skip
            yield counter("host_loaded_tokens", "Cached prompt tokens copied back from the host tier.",
                          snap.host_loaded_pages * ps)  # fmt: skip
            yield counter("host_dropped_tokens", "KV tokens dropped from the host tier for room.",
                          snap.host_dropped_pages * ps)  # fmt: skip
        finished = CounterMetricFamily(
            f"{PREFIX}_requests_finished", "Finished requests by reason.", labels=["finish_reason"]
        )
        for reason, n in sorted(snap.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        events = CounterMetricFamily(
            f"{PREFIX}_kv_event_batches", "KV event batches by outcome.", labels=["outcome"]
        )
        for outcome, n in sorted(self.m._event_stats().items()):
            events.add_metric([outcome], n)
        yield events
