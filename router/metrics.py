"""Prometheus metrics of the router (names documented in docs/metrics.md).

Per-worker counters live in router.workers.WorkerStats (one copy of each fact); this module
exposes them at scrape time, derives hit rates from them, and owns the latency histograms."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from router.admission import AdmissionGate
from router.workers import WorkerRegistry

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class _WorkerCollector:
    """Reads the worker registry and the prefix index when Prometheus scrapes: ``read`` on the event
    loop (the router's state, plain values), ``families`` of what it read anywhere (a thread)."""

    def __init__(self, workers: WorkerRegistry, index_size: Callable[[], tuple[int, int]]) -> None:
        self._workers = workers
        self._index_size = index_size

    def read(self) -> tuple[list[tuple], tuple[int, int], int]:
        """Each worker's numbers, the index's size, the number of workers."""
        rows = [
            (w.url, copy.copy(w.stats), dict(w.stats.errors), w.in_flight, w.load, w.pending_prefill, w.peer_queue,
             w.peer_prefill, w.healthy, int(w.breaker.state))
            for w in self._workers
        ]  # fmt: skip
        return rows, self._index_size(), len(self._workers)

    def families(self, read: tuple[list[tuple], tuple[int, int], int]) -> Iterable[Metric]:
        rows, (entries, nodes), registered = read
        label = ["worker"]
        requests = CounterMetricFamily(
            "radixgate_upstream_requests", "Requests sent to the worker", labels=label
        )
        errors = CounterMetricFamily(
            "radixgate_upstream_errors",
            "Worker faults (connect, timeout, http_5xx)",
            labels=["worker", "kind"],
        )
        overloaded = CounterMetricFamily(
            "radixgate_upstream_overloaded",
            "Requests the worker refused with 429 (queue full): retried elsewhere, or 429 when none had room",
            labels=label,
        )
        retries = CounterMetricFamily(
            "radixgate_upstream_retries",
            "Requests moved to another worker before their first byte",
            labels=label,
        )
        in_flight = GaugeMetricFamily(
            "radixgate_upstream_in_flight", "Requests open to the worker", labels=label
        )
        load = GaugeMetricFamily("radixgate_upstream_load", "Blended load used for routing", labels=label)
        pending = GaugeMetricFamily(
            "radixgate_upstream_pending_prefill_tokens",
            "Predicted uncached prompt tokens sent and not yet answered",
            labels=label,
        )
        peer_in_flight = GaugeMetricFamily(
            "radixgate_upstream_peer_in_flight",
            "Requests other router replicas announced there",
            labels=label,
        )
        peer_pending = GaugeMetricFamily(
            "radixgate_upstream_peer_pending_prefill_tokens",
            "Pending prefill tokens other router replicas announced there",
            labels=label,
        )
        healthy = GaugeMetricFamily(
            "radixgate_upstream_healthy", "1 if the last health check passed", labels=label
        )
        breaker = GaugeMetricFamily(
            "radixgate_upstream_breaker_state", "Circuit breaker: 0 closed, 1 open, 2 half-open", labels=label
        )
        prompt = CounterMetricFamily(
            "radixgate_upstream_prompt_tokens", "Prompt tokens routed (router's tokenizer)", labels=label
        )
        predicted = CounterMetricFamily(
            "radixgate_upstream_predicted_cached_tokens",
            "Prompt tokens the index predicted cached",
            labels=label,
        )
        usage_prompt = CounterMetricFamily(
            "radixgate_upstream_usage_prompt_tokens",
            "Prompt tokens as reported in worker usage",
            labels=label,
        )
        cached = CounterMetricFamily(
            "radixgate_upstream_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported",
            labels=label,
        )
        hit_rate = GaugeMetricFamily(
            "radixgate_upstream_hit_rate",
            "Cumulative prefix hit rate: predicted (index) or actual (worker usage)",
            labels=["worker", "source"],
        )
        events = CounterMetricFamily(
            "radixgate_upstream_kv_event_batches", "KV event batches applied", labels=label
        )
        resyncs = CounterMetricFamily("radixgate_upstream_kv_resyncs", "Snapshot re-syncs", labels=label)
        hints = CounterMetricFamily(
            "radixgate_upstream_kv_fetch_hints",
            "Requests sent there naming another worker to fetch their prefix's KV from (--kv-fetch-min-tokens)",
            labels=label,
        )
        fleet = GaugeMetricFamily("radixgate_fleet_hit_rate", "Fleet prefix hit rate", labels=["source"])
        totals = [0, 0, 0, 0]
        for url, s, errs, w_in_flight, w_load, w_pending, w_peer_queue, w_peer_prefill, ok, state in rows:
            requests.add_metric([url], s.requests)
            for kind, n in errs.items():
                errors.add_metric([url, kind], n)
            retries.add_metric([url], s.retries)
            overloaded.add_metric([url], s.overloaded)
            in_flight.add_metric([url], w_in_flight)
            load.add_metric([url], w_load)
            pending.add_metric([url], w_pending)
            peer_in_flight.add_metric([url], w_peer_queue)
            peer_pending.add_metric([url], w_peer_prefill)
            healthy.add_metric([url], 1.0 if ok else 0.0)
            breaker.add_metric([url], state)
            prompt.add_metric([url], s.prompt_tokens)
            predicted.add_metric([url], s.predicted_cached_tokens)
            usage_prompt.add_metric([url], s.usage_prompt_tokens)
            cached.add_metric([url], s.cached_tokens)
            hit_rate.add_metric([url, "predicted"], _ratio(s.predicted_cached_tokens, s.prompt_tokens))
            hit_rate.add_metric([url, "actual"], _ratio(s.cached_tokens, s.usage_prompt_tokens))
            events.add_metric([url], s.kv_event_batches)
            resyncs.add_metric([url], s.kv_resyncs)
            hints.add_metric([url], s.kv_fetch_hints)
            for i, v in enumerate(
                (s.predicted_cached_tokens, s.prompt_tokens, s.cached_tokens, s.usage_prompt_tokens)
            ):
                totals[i] += v
        fleet.add_metric(["predicted"], _ratio(totals[0], totals[1]))
        fleet.add_metric(["actual"], _ratio(totals[2], totals[3]))
        index_entries = GaugeMetricFamily(
            "radixgate_prefix_index_entries", "(block, worker) entries held by the prefix index"
        )
        index_entries.add_metric([], entries)
        index_nodes = GaugeMetricFamily(
            "radixgate_prefix_index_blocks", "Distinct blocks held by the prefix index"
        )
        index_nodes.add_metric([], nodes)
        workers_total = GaugeMetricFamily("radixgate_workers", "Registered workers")
        workers_total.add_metric([], registered)
        yield from (
            requests,
            errors,
            overloaded,
            retries,
            in_flight,
            load,
            pending,
            peer_in_flight,
            peer_pending,
        )
        yield from (healthy, breaker, prompt, predicted)
        yield from (
            usage_prompt,
            cached,
            hit_rate,
            events,
            resyncs,
            hints,
            fleet,
            index_entries,
            index_nodes,
            workers_total,
        )


class _StatsCollector:
    """Families from a component's ``describe()``-style stats; nothing while it is off (None)."""

    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        if s is not None:
            yield from self.families(s)

    def families(self, s: dict) -> Iterable[Metric]:
        raise NotImplementedError


class _SyncCollector(_StatsCollector):
    """Replica sync (router/replica_sync.py) counters, when it is on."""

    def families(self, s: dict) -> Iterable[Metric]:
        peers = GaugeMetricFamily("radixgate_replica_sync_peers", "Other router replicas heard from")
        peers.add_metric([], len(s["peers_last_heard_s"]))
        messages = CounterMetricFamily(
            "radixgate_replica_sync_messages", "Replica sync messages by kind", labels=["kind"]
        )
        for kind in ("sent", "received", "malformed", "publish_errors"):
            messages.add_metric([kind], s[kind])
        expired = CounterMetricFamily("radixgate_replica_sync_expired", "Replicas forgotten after silence")
        expired.add_metric([], s["expired"])
        yield from (peers, messages, expired)


class _DiscoveryCollector(_StatsCollector):
    """Kubernetes worker discovery (router/discovery.py), when it is on."""

    def families(self, s: dict) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "radixgate_discovered_workers",
            "Workers registered from the Service's endpoints",
            value=len(s["workers"]),
        )
        yield CounterMetricFamily("radixgate_discovery_rounds", "Endpoint listings tried", value=s["rounds"])
        yield CounterMetricFamily(
            "radixgate_discovery_failures",
            "Endpoint listings that failed (the fleet kept)",
            value=s["failures"],
        )


class _PrefixIdsCollector(_StatsCollector):
    """The model tokenizer's cache of conversation prefixes' ids (router/tokenization.py PrefixIds)."""

    def families(self, s: dict) -> Iterable[Metric]:
        lookups = CounterMetricFamily(
            "radixgate_prompt_prefix_ids",
            "Chat prompts whose cached prefix ids were found (hit) or not (miss), with a model's tokenizer",
            labels=["outcome"],
        )
        lookups.add_metric(["hit"], s["hits"])
        lookups.add_metric(["miss"], s["misses"])
        yield lookups
        yield GaugeMetricFamily(
            "radixgate_prompt_prefix_ids_bytes", "Memory the cache of prefix ids counts", value=s["bytes"]
        )


class _AdmissionCollector:
    """The router's admission gate (router/admission.py)."""

    def __init__(self, gate: AdmissionGate | None) -> None:
        self._gate = gate

    def collect(self) -> Iterable[Metric]:
        g = self._gate
        if g is None:
            return
        yield GaugeMetricFamily(
            "radixgate_router_active_requests", "Requests holding an admission slot", value=g.active
        )
        yield GaugeMetricFamily(
            "radixgate_router_queued_requests", "Requests waiting for a slot", value=g.queued
        )
        refused = CounterMetricFamily(
            "radixgate_router_queue_refused", "Requests refused by admission: full (429), timeout (503)",
            labels=["reason"],
        )  # fmt: skip
        refused.add_metric(["full"], g.rejected)
        refused.add_metric(["timeout"], g.timed_out)
        yield refused
        yield CounterMetricFamily(
            "radixgate_router_queue_wait_seconds", "Time admitted requests spent queued", value=g.waited_s
        )
        yield CounterMetricFamily(
            "radixgate_router_queue_admitted_after_wait",
            "Requests admitted after queueing",
            value=g.admitted_after_wait,
        )


class RouterMetrics:
    """One registry per router app, so several apps in one process (tests) never collide."""

    def __init__(
        self, workers: WorkerRegistry, index_size: Callable[[], tuple[int, int]],
        sync_stats: Callable[[], dict | None] = lambda: None, admission: AdmissionGate | None = None,
        discovery_stats: Callable[[], dict | None] = lambda: None,
        prefix_stats: Callable[[], dict | None] = lambda: None,
    ) -> None:  # fmt: skip
        self.registry = CollectorRegistry()  # NOTE: all but the workers' families (render reads those)
        self._workers = _WorkerCollector(workers, index_size)
        self.registry.register(_DiscoveryCollector(discovery_stats))
        self.registry.register(_AdmissionCollector(admission))
        self.registry.register(_SyncCollector(sync_stats))
        self.registry.register(_PrefixIdsCollector(prefix_stats))
        self.key_requests = Counter(
            "radixgate_api_key_requests",
            "Generation requests by API key name (never the key) and outcome: admitted, rate_limited",
            ["key", "outcome"],
            registry=self.registry,
        )
        self.requests = Counter(
            "radixgate_requests",
            "Client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "radixgate_ttft_seconds",
            "Router-observed time to first byte of the upstream response body (streams: first chunk)",
            ["stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "radixgate_request_duration_seconds",
            "Whole request as the router saw it",
            ["stream"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.decision = Histogram(
            "radixgate_route_decision_seconds",
            "Block hashing (as far as the match needs) + index match + policy select",
            buckets=_DECISION_BUCKETS,
            registry=self.registry,
        )
        self.event_lag = Histogram(
            "radixgate_kv_event_lag_seconds",
            "Worker publish time (its clock) to this router applying a KV event batch (a skewed clock shifts it)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.affinity = Counter(
            "radixgate_affinity_requests",
            "Requests by affinity group and routing outcome (in_group, overflow, ungrouped, no_worker)",
            ["group", "outcome"],
            registry=self.registry,
        )

        # Labelled children resolved once: .labels() costs microseconds on every request.
        self.ttft_of = {True: self.ttft.labels("true"), False: self.ttft.labels("false")}
        self.duration_of = {True: self.duration.labels("true"), False: self.duration.labels("false")}
        self._requests: dict[tuple[str, int], Any] = {}

    def count_key(self, key: str, outcome: str) -> None:
        """A generation request of API key ``key`` (its name): admitted or rate_limited."""
        self.key_requests.labels(key, outcome).inc()

    def count_request(self, endpoint: str, status: int) -> None:
        child = self._requests.get((endpoint, status))
        if child is None:
            child = self._requests[(endpoint, status)] = self.requests.labels(endpoint, str(status))
        child.inc()

    async def render(self) -> bytes:
        """The exposition text. The router's state is read on the event loop (plain values, ~1 ms at
        512 workers); building and formatting the families from it, ~70 ms of CPU there, runs in a
        thread, so the loop keeps serving between the interpreter's switches."""
        read, rest = self._workers.read(), list(self.registry.collect())

        def text() -> bytes:
            return generate_latest(_Collected([*self._workers.families(read), *rest]))

        return await asyncio.to_thread(text)


class _Collected:
    """Metric families already collected, as ``generate_latest`` reads a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
