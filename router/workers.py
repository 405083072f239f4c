"""The router's view of its workers: address, health, circuit breaker, load and per-worker counters.

A worker's load lives here and only here: in-flight requests counted by this router on every path,
blended with the queue the worker itself reports (which includes other router replicas' traffic)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from router.circuit_breaker import BreakerState, CircuitBreaker


@dataclass
class WorkerStats:
    """Cumulative counters, read by the metrics collector at scrape time."""

    requests: int = 0
    errors: Counter = field(default_factory=Counter)  # kind -> count (connect, timeout, http_5xx)
    retries: int = 0  # requests that moved away from this worker before their first byte
    prompt_tokens: int = 0  # router-side token count of prompts sent here
    predicted_cached_tokens: int = 0  # what the prefix index predicted would be cached
    usage_prompt_tokens: int = 0  # prompt tokens as the worker reported them (usage)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens reported by the worker
    kv_event_batches: int = 0
    kv_resyncs: int = 0


@dataclass
class Worker:
    url: str
    breaker: CircuitBreaker
    healthy: bool = False  # last health check passed (a new worker is unhealthy until checked)
    in_flight: int = 0  # requests this router has open to the worker right now
    reported_queue: float = 0.0  # running + waiting as the worker last reported (0 if it doesn't)
    models: set[str] = field(default_factory=set)  # served model ids (empty = unknown, serves all)
    cache_info: dict | None = None  # /v1/cache/info of a radixgate worker, None for other backends
    epoch: str | None = None  # the worker's start identity, from /health or cache info
    last_check_ok_at: float = 0.0
    stats: WorkerStats = field(default_factory=WorkerStats)

    @property
    def load(self) -> float:
        """Outstanding requests: ours, or the worker's own count when other replicas add to it."""
        return float(max(self.in_flight, self.reported_queue))

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    @property
    def block_size(self) -> int | None:
        return None if self.cache_info is None else self.cache_info.get("block_size")


class WorkerRegistry:
    """Workers by URL. Listeners hear about additions and removals (index, event subscriptions)."""

    def __init__(self, breaker_factory: Callable[[], CircuitBreaker]) -> None:
        self._workers: dict[str, Worker] = {}
        self._breaker_factory = breaker_factory
        self.on_added: list[Callable[[Worker], None]] = []
        self.on_removed: list[Callable[[Worker], None]] = []

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url in self._workers:
            return self._workers[url]
        worker = Worker(url=url, breaker=self._breaker_factory())
        self._workers[url] = worker
        for listener in self.on_added:
            listener(worker)
        return worker

    def remove(self, url: str) -> bool:
        worker = self._workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        for listener in self.on_removed:
            listener(worker)
        return True

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def __iter__(self):
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def candidates(self, model: str | None, exclude: set[str] | frozenset = frozenset()) -> list[Worker]:
        """Workers that may take a request for ``model`` now: healthy, breaker allows, serve it."""
        now = time.monotonic()
        return [
            w
            for w in self._workers.values()
            if w.url not in exclude
            and w.available(now)
            and (model is None or not w.models or model in w.models)
        ]

    def serves(self, model: str) -> bool:
        """Does any known worker serve this model (or not say what it serves)?"""
        return any(not w.models or model in w.models for w in self._workers.values())

    def models(self) -> set[str]:
        out: set[str] = set()
        for w in self._workers.values():
            out |= w.models
        return out

    def describe(self) -> list[dict]:
        return [
            {
                "url": w.url,
                "healthy": w.healthy,
                "breaker": BreakerState(w.breaker.state).name.lower(),
                "in_flight": w.in_flight,
                "reported_queue": w.reported_queue,
                "load": w.load,
                "models": sorted(w.models),
                "block_size": w.block_size,
                "epoch": w.epoch,
            }
            for w in self._workers.values()
        ]
