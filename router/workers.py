"""The router's view of its workers: address, health, circuit breaker, load and per-worker counters.

A worker's load lives here and only here: in-flight requests counted by this router on every path
and the prefill it has sent there and not yet seen answered (live), the same counts as other router
replicas announce them (router/replica_sync.py, when on), plus what the worker's last health report
showed beyond all that (replicas not heard from, other clients), in request units."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.circuit_breaker import BreakerState, CircuitBreaker
from router.responses_input import worker_tag


@dataclass
class WorkerStats:
    """Cumulative counters, read by the metrics collector at scrape time."""

    requests: int = 0
    errors: Counter = field(default_factory=Counter)  # kind -> count (connect, timeout, http_5xx)
    retries: int = 0  # requests that moved away from this worker before their first byte
    overloaded: int = 0  # requests it refused with 429 (its queue was full)
    prompt_tokens: int = 0  # router-side token count of prompts sent here
    predicted_cached_tokens: int = 0  # what the prefix index predicted would be cached
    usage_prompt_tokens: int = 0  # prompt tokens as the worker reported them (usage)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens reported by the worker
    kv_fetch_hints: int = 0  # requests sent here naming another worker to fetch their prefix's KV from
    kv_event_batches: int = 0
    kv_resyncs: int = 0


@dataclass
class Worker:
    url: str
    breaker: CircuitBreaker
    healthy: bool = False  # last health check passed (a new worker is unhealthy until checked)
    in_flight: int = 0  # requests this router has open to the worker right now
    # predicted uncached prompt tokens of our requests there without a first byte yet (PendingPrefill)
    pending_prefill: int = 0
    prefill_weight: float = 0.0  # load units per pending prefill token (1 / prefill_tokens_per_load)
    reported_queue: float = 0.0  # running + waiting as the worker last reported (0 if it doesn't)
    reported_prefill: float = 0.0  # prefill backlog tokens as the worker last reported (0 if it doesn't)
    others_queue: float = 0.0  # of the last report, requests beyond ours and peers' then (apply_report)
    others_prefill: float = 0.0  # of the last report, prefill tokens beyond ours and peers' then
    peers: dict[str, tuple[int, int]] = field(default_factory=dict)  # replica -> (in-flight, pending)
    peer_queue: int = 0  # sum of the peers' in-flight requests here
    peer_prefill: int = 0  # sum of the peers' pending prefill tokens here
    on_change: Callable[[Worker], None] | None = field(default=None, repr=False)  # our counts moved
    # served model ids (empty = unknown: a candidate for any model no worker of known models serves)
    models: frozenset[str] = frozenset()
    max_model_len: dict[str, int] = field(default_factory=dict)  # model id -> its /v1/models max_model_len
    parents: dict[str, str] = field(default_factory=dict)  # LoRA adapter id -> its base model's (/v1/models)
    cache_info: dict | None = None  # /v1/cache/info of a radixgate worker, None for other backends
    epoch: str | None = None  # the worker's start identity, from /health or cache info
    stats: WorkerStats = field(default_factory=WorkerStats)

    @property
    def load(self) -> float:
        """Outstanding requests (ours, the peers', the rest of the last report), plus one per
        ``prefill_tokens_per_load`` tokens of unanswered prefill (counted the same three ways).
        NOTE: a request's count says little about the work it brings: a miss on a long prompt
        queues every request behind its prefill, a hit on the same prompt costs a few tokens."""
        prefill = (self.pending_prefill + self.peer_prefill + self.others_prefill) * self.prefill_weight
        return self.in_flight + self.peer_queue + self.others_queue + prefill

    def changed(self) -> None:
        """Our in-flight count or pending prefill moved (replica sync announces it)."""
        if self.on_change is not None:
            self.on_change(self)

    def set_peer(self, replica: str, in_flight: int, pending_prefill: int) -> None:
        """Another router replica's counts here, as it announced them (absolute, not deltas)."""
        old_queue, old_prefill = self.peers.pop(replica, (0, 0))
        if in_flight or pending_prefill:
            self.peers[replica] = (in_flight, pending_prefill)
        self.peer_queue += in_flight - old_queue
        self.peer_prefill += pending_prefill - old_prefill

    def apply_report(self, queue: float, prefill_backlog: float) -> None:
        """A health report: the worker's running + waiting requests and its prefill backlog (prompt
        tokens queued or in prefill). What exceeds our own and the peers' counts at this moment is
        other routers' (or direct clients') work; it stays in the load until the next report.
        NOTE: our own and the peers' parts are counted live. Taking max(ours, reported) instead
        would freeze the load between reports wherever the report dominates (several replicas), so
        a replica would send every request in that second to the same worker."""
        self.reported_queue, self.reported_prefill = queue, prefill_backlog
        self.others_queue = max(0.0, queue - self.in_flight - self.peer_queue)
        self.others_prefill = max(0.0, prefill_backlog - self.pending_prefill - self.peer_prefill)

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def counts_like(self, tokenizer: str) -> bool:
        """Its cache info names ``tokenizer`` (equal names promise equal ids): its token counts are
        the router's."""
        return self.cache_info is not None and self.cache_info.get("tokenizer") == tokenizer

    def too_small(self, model: str | None, prompt_tokens: int, tokenizer: str) -> bool:
        """Known not to serve a prompt of ``prompt_tokens`` tokens (plus one output token) of
        ``model``: only when it counts tokens as the router does (``counts_like``) and told its
        context in /v1/models."""
        if not self.counts_like(tokenizer):
            return False
        limit = self.context(model)
        return limit is not None and prompt_tokens >= limit

    def context(self, model: str | None) -> int | None:
        """The context (tokens) it serves ``model`` with, None when it did not tell; no model: its
        base model's (not a LoRA adapter's), when it serves one."""
        limits = self.max_model_len
        if model is None:
            bases = [n for m, n in limits.items() if m not in self.parents]
            return bases[0] if len(bases) == 1 else None
        return limits.get(model)

    @property
    def block_size(self) -> int | None:
        return None if self.cache_info is None else self.cache_info.get("block_size")


class _HasPendingPrefill(Protocol):
    pending_prefill: int

    def changed(self) -> None: ...


class PendingPrefill:
    """A request's predicted uncached prompt tokens, counted in its worker's load (``Worker.load``)
    from the send until its first byte comes back (a stream's first chunk, else the whole answer)
    or the attempt fails: the prefill queued there that requests of equal count do not show. The
    fleet simulator keeps its workers' pending prefill with it too."""

    __slots__ = ("tokens", "worker")

    def __init__(self, worker: _HasPendingPrefill, tokens: int) -> None:
        self.worker, self.tokens = worker, max(0, tokens)
        worker.pending_prefill += self.tokens
        worker.changed()

    def release(self) -> None:
        """Idempotent: the first call takes the tokens off the worker's load."""
        if self.tokens:
            self.worker.pending_prefill -= self.tokens
            self.tokens = 0
            self.worker.changed()


class WorkerRegistry:
    """Workers by URL. Listeners hear about additions and removals (index, event subscriptions).
    ``prefill_tokens_per_load``: pending prefill tokens worth one request of load (0: not counted)."""

    def __init__(
        self, breaker_factory: Callable[[], CircuitBreaker], prefill_tokens_per_load: float = 0.0
    ) -> None:
        if not prefill_tokens_per_load >= 0:
            raise ValueError("prefill_tokens_per_load must be >= 0")
        self._workers: dict[str, Worker] = {}
        self._breaker_factory = breaker_factory
        self._prefill_weight = 1.0 / prefill_tokens_per_load if prefill_tokens_per_load else 0.0
        self.on_added: list[Callable[[Worker], None]] = []
        self.on_removed: list[Callable[[Worker], None]] = []
        self._shortest: float | None = None  # shortest_context's memo; None: to compute
        self._served: tuple | None = None  # served()'s memo; None: to compute
        self._bases: frozenset[str] | None = None  # base_models()'s memo, with it
        self._models: frozenset[str] | None = None  # models()'s memo, with it

    def shortest_context(self) -> float:
        """The smallest ``max_model_len`` any worker reports for any model (inf: none told): a
        prompt shorter than it fits everywhere, so routing need not look further."""
        if self._shortest is None:
            self._shortest = min((n for w in self._workers.values() for n in w.max_model_len.values()),
                                 default=float("inf"))  # fmt: skip
        return self._shortest

    def served_changed(self) -> None:
        """What the fleet serves changed: a worker came, went, or told again its models, adapters and
        contexts (health checks). The memos of it are computed again when next asked."""
        self._shortest = self._served = self._bases = self._models = None

    def served(self) -> tuple[tuple[str, frozenset[str], tuple[tuple[str, str], ...]], ...]:
        """Each worker's URL, models and LoRA adapters as (adapter, base model): one tuple until a
        worker comes, goes or tells what it serves (affinity placement is cached by it)."""
        if self._served is None:
            self._served = tuple(
                (w.url, w.models, tuple(sorted(w.parents.items()))) for w in self._workers.values()
            )
        return self._served

    def add(self, url: str) -> Worker:
        url = url.rstrip("/")
        if url in self._workers:
            return self._workers[url]
        worker = Worker(url=url, breaker=self._breaker_factory(), prefill_weight=self._prefill_weight)
        self._workers[url] = worker
        self.served_changed()
        for listener in self.on_added:
            listener(worker)
        return worker

    def remove(self, url: str) -> bool:
        worker = self._workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        self.served_changed()
        for listener in self.on_removed:
            listener(worker)
        return True

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def load(self, url: str) -> float | None:
        """The worker's load (Worker.load); None for a URL not in the fleet."""
        worker = self._workers.get(url)
        return None if worker is None else worker.load

    def __iter__(self):
        return iter(list(self._workers.values()))

    def __contains__(self, worker: object) -> bool:
        """Is this very worker registered (not one since added at its URL)?"""
        return isinstance(worker, Worker) and self._workers.get(worker.url) is worker

    def __len__(self) -> int:
        return len(self._workers)

    def tagged(self, tag: str) -> Worker | None:
        """The worker whose tag (router.responses_input.worker_tag) is ``tag``, by the URL it is
        registered under or the one it advertises (its KV events' name)."""
        for w in self._workers.values():
            names = (w.url, (w.cache_info or {}).get("worker"))
            if any(isinstance(n, str) and worker_tag(n) == tag for n in names):
                return w
        return None

    def candidates(self, model: str | None, exclude: set[str] | frozenset = frozenset()) -> list[Worker]:
        """Workers that may take a request for ``model`` now: healthy, breaker allows, serve it.
        NOTE: a worker whose models are not known yet (its /v1/models did not answer) is no candidate
        for a model other workers told they serve: it would answer the request with its own 404."""
        now, closed = time.monotonic(), BreakerState.CLOSED
        told = model is not None and model in self.models()
        return [  # NOTE: Worker.available inlined: this runs over every worker on every request
            w
            for w in self._workers.values()
            if w.healthy
            and (w.breaker.state is closed or w.breaker.allows(now))
            and (model is None or model in w.models or (not w.models and not told))
            and (not exclude or w.url not in exclude)
        ]

    def serves(self, model: str) -> bool:
        """Does a worker serve this model: one that told it does, or one that may (it answers health
        checks, its models not known yet)? While no worker has told its models, any may."""
        told = self.models()
        if model in told:
            return True
        return any(not w.models and (w.healthy or not told) for w in self._workers.values())

    def count_like(self, model: str | None, tokenizer: str) -> bool:
        """Does a worker serving ``model`` (None: any worker) count tokens as ``tokenizer`` does
        (Worker.counts_like)?"""
        return any(
            w.counts_like(tokenizer)
            for w in list(self._workers.values())
            if model is None or model in w.models
        )

    def models(self) -> frozenset[str]:
        """Every model some worker told it serves, LoRA adapters included."""
        if self._models is None:
            self._models = frozenset(m for w in self._workers.values() for m in w.models)
        return self._models

    def base_models(self) -> frozenset[str]:
        """The models served, less LoRA adapters (what a request naming no model is served as)."""
        if self._bases is None:
            self._bases = frozenset(
                m for _, ms, adapters in self.served() for m in ms - {a for a, _ in adapters}
            )
        return self._bases

    def describe(self) -> list[dict]:
        return [
            {
                "url": w.url,
                "healthy": w.healthy,
                "breaker": BreakerState(w.breaker.state).name.lower(),
                "in_flight": w.in_flight,
                "reported_queue": w.reported_queue,
                "reported_prefill_tokens": w.reported_prefill,
                "peer_in_flight": w.peer_queue,
                "peer_pending_prefill_tokens": w.peer_prefill,
                "pending_prefill_tokens": w.pending_prefill,
                "others_queue": w.others_queue,  # what the last report showed beyond ours and peers'
                "others_prefill_tokens": w.others_prefill,
                "load": w.load,
                "models": sorted(w.models),
                "block_size": w.block_size,
                "epoch": w.epoch,
            }
            for w in self._workers.values()
        ]
