"""One router replica of the fleet simulator: the real policy, prefix index and per-worker load
(router.workers.Worker) of one ``python -m router`` process. Time is the engine's business
(loadtest/fleet_sim.py); this module only decides, counts and learns.

Several replicas model a deployment with more than one router (the Helm chart runs two): each
routes its own share of the requests and counts its own in-flight requests and pending prefill
live; other replicas' traffic reaches it through the workers' periodic health reports and, with
replica sync, through the other replicas' announcements (router/replica_sync.py); KV events (when
on) reach every replica, as Redis delivers them to every router.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mmh3

from router.block_hash import block_hashes
from router.circuit_breaker import CircuitBreaker
from router.policies import Candidate, Policy, RouteRequest, kv_fetch_source, make_policy
from router.prefix_index import PrefixIndex
from router.workers import Worker, WorkerRegistry


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


class SimRouter:
    """A router replica: ``route`` picks a worker for a prompt and counts the request in that
    worker's load here; ``apply_events`` and ``apply_reports`` are what it hears back."""

    def __init__(
        self, policy: str, params: dict[str, Any], index_entries: int, prefill_tokens_per_load: float,
        namespace: str, on_change: Callable[[Worker], None] | None = None, kv_fetch_min_tokens: int = 0,
    ) -> None:  # fmt: skip
        self.index = PrefixIndex(index_entries)
        self.namespace = namespace
        self.kv_fetch_min_tokens = kv_fetch_min_tokens  # --kv-fetch-min-tokens (simulated tokens; 0: off)
        if policy == "sticky":
            self.policy: Policy = StickyPolicy(self.index, params)
        else:
            self.policy = make_policy(policy, self.index, params)
        self.workers = WorkerRegistry(CircuitBreaker, prefill_tokens_per_load)
        self.decision_ns: list[int] = []
        self.event_ns = 0
        self.on_change = on_change  # replica sync: called when this replica's counts on a worker move

    def add_worker(self, url: str) -> None:
        worker = self.workers.add(url)
        worker.healthy, worker.on_change = True, self.on_change
        self.index.add_worker(url)

    def route(
        self, tokens: list[int], block_size: int, group: str, urls: list[str]
    ) -> tuple[Worker, int, str | None]:
        """The chosen worker (this replica's view of it, its in-flight count already raised), the
        prompt tokens the index predicts are not cached there, and the worker it is told to fetch
        the prompt's KV from (--kv-fetch-min-tokens; None: none). ``urls``: the candidates."""
        t0 = time.perf_counter_ns()
        policy, get = self.policy, self.workers.get
        route = RouteRequest(block_hashes(tokens, block_size, self.namespace), len(tokens), block_size)
        candidates = [Candidate(url, get(url).load) for url in urls]  # type: ignore[union-attr]
        uncached, source = 0, None  # NOTE: sticky ignores loads and predictions
        if isinstance(policy, StickyPolicy):
            url = policy.select_group(group, candidates)
        else:
            decision = policy.select(route, candidates)
            url = decision.url
            uncached = len(tokens) - route.cacheable(decision.matched_tokens[url])
            source = kv_fetch_source(decision, self.kv_fetch_min_tokens, self.workers.load)
        policy.on_routed(route, url)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        worker = get(url)
        assert worker is not None
        worker.in_flight += 1
        return worker, uncached, source

    def apply_events(self, url: str, stored: list, removed: list[int], cleared: bool) -> None:
        t0 = time.perf_counter_ns()
        self.index.apply_events(url, stored, removed, cleared)
        self.event_ns += time.perf_counter_ns() - t0

    def apply_reports(self, reports: dict[str, tuple[int, int]]) -> None:
        """A health-check round: url -> (running + waiting, prefill backlog tokens) as each worker
        reports them in ``GET /health``."""
        for url, (queue, backlog) in reports.items():
            worker = self.workers.get(url)
            if worker is not None:
                worker.apply_report(queue, backlog)
