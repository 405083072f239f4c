"""The request path: parse and validate an OpenAI request, pick a worker, stream the answer back.

Data flows one way: parse -> tokenize + hash -> policy picks -> proxy streams. Bad input gets an
OpenAI-shaped 4xx and never touches a worker; no request path leaves a worker's load counted.
``Router`` holds all router state (workers, prefix index, policy, metrics, upstream clients,
health checks, event subscriptions); router/app.py puts it behind HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from router import access_log
from router.admission import AdmissionGate
from router.affinity import NO_WORKER, UNGROUPED, AffinityGroups
from router.api_keys import APIKeys
from router.block_hash import PromptHashes, SpanMemo, salted
from router.circuit_breaker import CircuitBreaker
from router.client_watch import ClientWatch
from router.config import RouterConfig
from router.discovery import KubeDiscovery, target_from_config
from router.errors import QUEUE_FULL_RETRY_AFTER_S, RouterError, error_body, error_headers, stream_error_event
from router.event_subscriber import EventSubscriber
from router.health import HealthChecker
from router.http_client import HTTPClientError, ResponseTimeout
from router.http_client import Response as UpstreamResponse
from router.kv_events import KV_SOURCE_HEADER
from router.metrics import RouterMetrics
from router.policies import Candidate, Decision, OptimisticInsert, RouteRequest, kv_fetch_source, make_policy
from router.prefix_index import PrefixIndex
from router.proxy import SSEUsageScanner, Upstream, UpstreamFailure, Usage, body_usage, forwarded_headers
from router.replica_sync import ReplicaSync
from router.request_parsing import (
    PARSE_INLINE_BYTES,
    ClientGone,
    ParsedRequest,
    parse_request,
    parse_responses_request,
    read_asgi_body,
    with_stream_usage,
)
from router.responses_input import tag_of
from router.tokenization import load_tokenizer
from router.workers import PendingPrefill, Worker, WorkerRegistry

log = logging.getLogger("radixgate.router")

WORKER_HEADER = "x-radixgate-worker"
WORKER_HEADER_B = WORKER_HEADER.encode()
JSON = b"application/json"
FIRST_SYNC_WAIT_S = 5.0  # at start-up, the longest wait for the workers' cache snapshots
MODEL_TOKENIZER_INLINE_BYTES = 2048  # with a model's tokenizer, a larger body is parsed in a thread
# NOTE: router tokens taken to make one token of a worker that counts otherwise, for the most of a prompt
# the index records there: bytes per token of BPE vocabularies are ~4 for English text, more for code
OTHER_COUNT_TOKENS = 8
# NOTE: the failures that say a worker is down (not that it answered with an error): a follow-up's holder
HOLDER_DOWN = frozenset({"connect", "closed", "unresponsive", "timeout", "stream_broken"})


class Router:
    """All router state; one instance per app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.draining = False  # shutting down: /ready answers 503 while requests are still served
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.block_size = config.block_size
        self.index = PrefixIndex(max_entries=config.max_index_entries)
        self.affinity = AffinityGroups.from_config(config.affinity_groups)
        self.hash_memo = SpanMemo()  # hashes of hot prompt spans (shared prefixes), bounded
        self.policy = make_policy(config.policy, self.index, config.policy_params)
        self.workers = WorkerRegistry(
            lambda: CircuitBreaker(
                failure_threshold=config.breaker_failure_threshold, open_seconds=config.breaker_open_s
            ),
            config.prefill_tokens_per_load,
        )
        self.workers.on_added.append(lambda w: self.index.add_worker(w.url))
        self.workers.on_removed.append(lambda w: self.index.remove_worker(w.url))
        self.workers.on_removed.append(lambda w: self.upstream.client.forget(w.url))
        self.api_keys = APIKeys(config.api_keys, config.api_key_limits)
        self.admission = AdmissionGate(
            config.max_concurrent_requests, config.max_queued_requests, config.queue_timeout_s
        )
        self.metrics = RouterMetrics(
            self.workers,
            lambda: (self.index.num_entries, self.index.num_nodes),
            lambda: self.replica_sync.describe() if self.replica_sync else None,
            self.admission if config.max_concurrent_requests else None,
            lambda: self.discovery.describe() if self.discovery else None,
            lambda: prefix.describe() if (prefix := getattr(self.tokenizer, "prefix_ids", None)) else None,
        )
        self.upstream = Upstream(
            config.connect_timeout_s,
            config.first_byte_timeout_s,
            config.request_timeout_s,
            config.worker_api_key,
        )
        self.health = HealthChecker(self, config.health_interval_s, config.health_timeout_s)
        self.events = EventSubscriber(self, config.kv_events, config.redis_url)
        self.replica_sync = (
            ReplicaSync(self.workers, config.redis_url, heartbeat_s=config.replica_sync_heartbeat_s,
                        expire_s=3 * config.replica_sync_heartbeat_s)
            if config.replica_sync_enabled and config.redis_url else None
        )  # fmt: skip
        for url in config.workers:
            self.workers.add(url)
        self.discovery = (
            KubeDiscovery(self, target_from_config(config), config.discovery_interval_s)
            if config.k8s_worker_service else None
        )  # fmt: skip

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.upstream.start()
        if self.discovery is not None:
            await self.discovery.start()
        await self.health.check_all()
        up = [w for w in self.workers if w.healthy]
        log.info(
            "workers: %d configured, healthy: %s", len(self.workers), ", ".join(w.url for w in up) or "none"
        )
        self.health.start()
        await self.events.start()
        # NOTE: before the first request: the caches the workers already hold (a router restarted
        # or added beside others) are in the index, not learned after the first requests went blind.
        started = time.perf_counter()
        late = await self.events.first_sync(up, FIRST_SYNC_WAIT_S)
        if late:
            log.warning("serving before the cache snapshots of %s arrived (waited %g s)", ", ".join(late),
                        FIRST_SYNC_WAIT_S)  # fmt: skip
        synced = sum(1 for w in up if self.events.synced(w))
        if synced:
            log.info("prefix index: the caches of %d of %d healthy workers read in %.0f ms", synced, len(up),
                     (time.perf_counter() - started) * 1e3)  # fmt: skip
        if self.replica_sync is not None:
            await self.replica_sync.start()

    async def stop(self) -> None:
        if self.replica_sync is not None:
            await self.replica_sync.stop()
        await self.events.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        await self.upstream.close()

    # ---------------------------------------------------------------- parsing
    def parse(self, raw: bytes, endpoint: str) -> ParsedRequest:
        """A request body of ``endpoint`` (chat, completions, responses), checked and tokenized.
        Bad input is a RouterError 4xx; anything else a body meets here is a bug, logged with its
        traceback and answered as a 500 in the API's error shape (not the server's plain text)."""
        try:
            if endpoint == "responses":
                return parse_responses_request(raw, self.tokenizer, self.template_decides)
            return parse_request(raw, endpoint == "chat", self.tokenizer, self.template_decides)
        except RouterError:
            raise
        except Exception:
            log.exception("%s: reading the request failed", endpoint)
            raise RouterError(500, "internal error while reading the request", "internal_error") from None

    async def parse_soon(self, raw: bytes, endpoint: str) -> ParsedRequest:
        """``parse``, in a thread for a large body: tokenizing and rendering megabytes (an HF tokenizer,
        a chat template) takes seconds, which on the event loop would stall every other request."""
        # NOTE: a model's chat template can render a body many times its size (Llama 3.1 writes each tool
        # schema with tojson(indent=4): 63 KiB of nested schemas, 2 MB of text, seconds to encode)
        inline = PARSE_INLINE_BYTES if self.tokenizer.name == "bytes" else MODEL_TOKENIZER_INLINE_BYTES
        if len(raw) <= inline:
            return self.parse(raw, endpoint)
        return await asyncio.to_thread(self.parse, raw, endpoint)

    def template_decides(self, model: str | None) -> bool:
        """Is the router's chat template the one ``model``'s workers render with: does one of them count
        tokens as the router does? Only then is the template's refusal the router's 400."""
        return self.workers.count_like(self.served_as(model), self.tokenizer.name)

    def served_as(self, model: str | None) -> str | None:
        """The model a request naming ``model`` is served as: a request without one gets its worker's
        base model, known here when the fleet has one (its LoRA adapters aside); else None."""
        if model is not None:
            return model
        bases = self.workers.base_models()
        return next(iter(bases)) if len(bases) == 1 else None

    def namespace(self, model: str | None) -> str:
        """Root of the block-hash chain: the model name, as the workers use for their events."""
        return self.served_as(model) or ""

    # ---------------------------------------------------------------- routing
    def route_request(self, parsed: ParsedRequest) -> RouteRequest:
        """The request as policies see it; its block hashes are computed as the decision reads them."""
        tokens = parsed.token_ids[:0] if parsed.full_prefill else parsed.token_ids  # nothing to match
        namespace = salted(self.namespace(parsed.model), parsed.cache_salt)
        hashes = PromptHashes(tokens, self.block_size, namespace, self.hash_memo)
        return RouteRequest(hashes, len(parsed.token_ids), self.block_size)

    def affinity_group(self, parsed: ParsedRequest, chat: bool, headers: Mapping[str, str]) -> str | None:
        """The affinity group the request matches (a follow-up of a stored response goes where that
        is, so none). ``headers``: by lower-case name, a repeated header's last value."""
        if not self.affinity or parsed.follow_up:
            return None
        return self.affinity.match(parsed.affinity_body or parsed.body, chat, headers)

    def check_model(self, model: str | None) -> None:
        """404 for a model no worker serves; 400 for a request naming none in a fleet of several base
        models (which one would answer it is the policy's pick: OpenAI and vLLM require it then)."""
        if not len(self.workers):
            raise RouterError(503, "no workers are registered", "no_workers")
        if model is None and len(self.workers.base_models()) > 1:
            served = ", ".join(sorted(self.workers.base_models()))
            raise RouterError(
                400,
                f"'model' is required: the workers serve several models ({served})",
                "missing_required_parameter",
            )
        if model is not None and not self.workers.serves(model):
            raise RouterError(404, f"model {model!r} is not served by any worker", "model_not_found")

    def response_holder(self, response_id: Any) -> str | None:
        """The registered worker a response id of ours names (router.responses_input), or None:
        an id of another backend (vLLM's), or of a worker no longer registered."""
        tag = tag_of(response_id)
        worker = None if tag is None else self.workers.tagged(tag)
        return None if worker is None else worker.url

    def decide(
        self, route: RouteRequest, model: str | None, exclude: set[str], group: str | None = None,
        only: str | None = None, preview: bool = False, fit_tokens: int | None = None,
    ) -> tuple[Decision | None, str]:  # fmt: skip
        """The policy's pick among available workers (narrowed by the request's affinity group, or
        to ``only``), and the affinity outcome (ungrouped / in_group / overflow). ``preview``: the
        pick without moving the policy on (Policy.preview). ``fit_tokens``: the prompt's length,
        which workers known to have a smaller context are not given while others can take it."""
        available = self.workers.candidates(model, exclude)
        candidates = [Candidate(w.url, w.load) for w in available]
        outcome = UNGROUPED
        if only is not None:
            candidates = [c for c in candidates if c.url == only]
        elif self.affinity and candidates:
            candidates, outcome = self.affinity.filter(
                group, candidates, self.workers.served(), self.served_as(model)
            )
        left_out = 0
        if fit_tokens is not None and candidates and fit_tokens >= self.workers.shortest_context():
            small = {w.url for w in available if w.too_small(model, fit_tokens, self.tokenizer.name)}
            fit = [c for c in candidates if c.url not in small]
            if fit:  # NOTE: none fits: any of them answers the client's error (context_length_exceeded)
                left_out, candidates = len(candidates) - len(fit), fit
        if not candidates:
            return None, outcome
        decision = (self.policy.preview if preview else self.policy.select)(route, candidates)
        if only is not None:  # NOTE: the policy had no choice: say why, not its rule over one candidate
            decision.reason = "holds the conversation of previous_response_id"
        if left_out:
            decision.reason = f"{left_out} worker(s) whose context is too short left out; {decision.reason}"
        if group is not None:
            decision.reason = f"affinity group {group!r} ({outcome}); {decision.reason}"
        return decision, outcome

    def cuts(self, parsed: ParsedRequest, route: RouteRequest, worker: Worker) -> bool:
        """Does ``worker`` cut the prompt to fit its context (truncate_prompt_tokens -1, truncation
        auto)? Then no prefix of it is what that worker computes: nothing predicted, recorded or fetched.
        NOTE: only known of a worker that counts tokens as the router does (Worker.counts_like); one that
        counts otherwise is taken to keep the prompt whole (its context is in other units)"""
        if not parsed.cut_to_fit or not worker.counts_like(self.tokenizer.name):
            return False
        context = worker.context(parsed.model)
        return context is not None and route.prompt_tokens >= context

    def recorded_blocks(self, parsed: ParsedRequest, route: RouteRequest, worker: Worker) -> int | None:
        """The most blocks of the prompt the index records for ``worker``: what its context holds
        (None: it did not tell), in the router's tokens; for a worker that counts tokens otherwise,
        OTHER_COUNT_TOKENS router tokens a token of its context."""
        context = worker.context(parsed.model)
        if context is None:
            return None
        if not worker.counts_like(self.tokenizer.name):
            context *= OTHER_COUNT_TOKENS
        return context // route.block_size

    def kv_source(self, decision: Decision, cache_salt: str | None = None) -> str | None:
        """Where ``decision``'s pick may fetch the prompt's cached KV (router/policies.kv_fetch_source);
        none for a salted prompt (workers export unsalted prefixes only)."""
        if cache_salt is not None:
            return None
        return kv_fetch_source(decision, self.config.kv_fetch_min_tokens, self.workers.load)

    def admit_key(self, key: str) -> None:
        """The key's rate limit (router/api_keys.py), counted per key name; raises RouterError 429."""
        try:
            self.api_keys.admit(key)
        except RouterError:
            self.metrics.count_key(key, "rate_limited")
            raise
        self.metrics.count_key(key, "admitted")

    async def handle_completion(self, scope: dict, receive: Callable, send: Callable, endpoint: str) -> None:
        """One completion request, straight on ASGI (the hot path: no framework objects)."""
        started = time.perf_counter()
        status = 500
        watch: ClientWatch | None = None
        access = access_log.start(self.config.access_log, endpoint)
        try:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            access_log.note(request_id=headers.get("x-request-id"))  # NOTE: first: a refused request's too
            key = self.api_keys.check(headers.get("authorization"))
            if key is not None:
                access_log.note(api_key=key)
                self.admit_key(key)
            raw = await read_asgi_body(
                receive, headers.get("content-length"), self.config.max_body_bytes, self.config.body_timeout_s
            )
            parsed = await self.parse_soon(raw, endpoint)
            self.check_model(parsed.model)
            group = self.affinity_group(parsed, endpoint != "completions", headers)
            access_log.note(model=parsed.model, stream=parsed.stream, affinity_group=group)
            watch = ClientWatch(receive)
            priority = parsed.body.get("priority", 0)  # NOTE: the worker validates it; odd values wait as 0
            await self.admission.acquire(priority if type(priority) is int else 0)  # routed once admitted
            try:
                status = await self.forward(send, watch, parsed, scope["path"], headers, started, group)
            finally:
                self.admission.release()
        except RouterError as exc:
            status = exc.status
            access_log.note(error=exc.code)
            if exc.status >= 500:  # NOTE: %r: a message may quote the request (no forged log lines)
                log.warning("%s: %d %r", endpoint, exc.status, exc.message)
            else:
                log.info("%s: rejected %d %r", endpoint, exc.status, exc.message)
            if watch is not None:
                watch.stop()
            body = error_body(exc.status, exc.message, exc.code)
            await _send_bytes(send, exc.status, body, JSON, extra=error_headers(exc))
        except ClientGone:
            status = 499  # the client closed the connection; nobody reads an answer
        except asyncio.CancelledError:
            if watch is None or not watch.gone:
                raise
            task = asyncio.current_task()
            if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled here
                task.uncancel()
            status = 499
        finally:
            if watch is not None:
                watch.stop()
            self.metrics.count_request(endpoint, status)
            if access is not None:
                access.status = status
                access_log.emit(access, started)

    async def forward(
        self,
        send: Callable,
        watch: ClientWatch,
        parsed: ParsedRequest,
        path: str,
        client_headers: dict[str, str],
        started: float,
        group: str | None = None,
    ) -> int:
        """Route, send upstream (retrying elsewhere before the first byte), answer the client.
        Returns the status sent; raises RouterError when no worker could answer."""
        t0 = time.perf_counter()
        route = self.route_request(parsed)
        # NOTE: a batch's every prompt, as its usage counts them (and a request no worker takes has it too)
        access_log.note(prompt_tokens=route.prompt_tokens + parsed.other_prompt_tokens)
        headers = forwarded_headers(client_headers)
        inject = parsed.stream and self.config.stream_usage and not parsed.usage_in_stream
        body, strip_usage = with_stream_usage(parsed) if inject else (parsed.raw, False)
        # NOTE: a stored conversation lives on one worker: a follow-up goes there or nowhere
        # (an id that names no registered worker is routed by load: its worker answers 404 if need be)
        previous = parsed.body.get("previous_response_id")
        only = self.response_holder(previous)
        tried: set[str] = set()
        failure: UpstreamFailure | None = None  # the last attempt's
        fault: UpstreamFailure | None = None  # the last one that was not a full queue (a 429)
        moved_from: Worker | None = None  # the worker the last attempt failed on
        # NOTE: a non-stream answer's head comes when the whole answer is done: only the request's
        # own time bounds it (a stream's head comes at once, so first_byte_timeout_s bounds that)
        head_timeout = None if parsed.stream else self.config.request_timeout_s
        for attempt in range(self.config.max_retries + 1):
            decision, outcome = self.decide(
                route, parsed.model, tried, group, only, fit_tokens=parsed.fit_tokens
            )
            if attempt == 0:
                self.metrics.decision.observe(time.perf_counter() - t0)
                if self.affinity:
                    self.metrics.affinity.labels(
                        group or "", NO_WORKER if decision is None else outcome
                    ).inc()
            if decision is None:
                break
            if moved_from is not None:
                moved_from.stats.retries += 1
            worker = self.workers.get(decision.url)
            assert worker is not None
            worker.in_flight += parsed.sequences  # NOTE: n choices run as n sequences on the worker
            matched = decision.matched_tokens.get(worker.url, 0)
            context = worker.context(parsed.model)  # tokens, when the worker told
            cut = self.cuts(parsed, route, worker)
            predicted = 0 if cut else route.cacheable(matched)
            computed = min(route.prompt_tokens, context or 0) if cut else route.prompt_tokens - predicted
            prefill = PendingPrefill(worker, computed + parsed.other_prompt_tokens)
            probe = worker.breaker.on_send()
            worker.stats.requests += 1
            access_log.note(worker=worker.url, attempts=attempt + 1, reason=decision.reason,
                            predicted_cached_tokens=predicted)  # fmt: skip
            source = None if cut else self.kv_source(decision, parsed.cache_salt)
            access_log.note(kv_source=source)
            if source is not None:
                worker.stats.kv_fetch_hints += 1
            # The optimistic index insert (and hashing the rest of the prompt) runs once the
            # request is written to an idle connection: it does not delay it. Where a new
            # connection must be opened first it runs before that, since the requests decided
            # meanwhile must see it. A refusal, a worker that could not be reached, and an attempt
            # that ends without its answer on a worker whose KV events the index follows (the
            # client left, the worker failed) take it back. At most what the worker's context holds.
            insert = OptimisticInsert(self.policy, route, worker.url, matched // route.block_size,
                                      0 if cut else self.recorded_blocks(parsed, route, worker))  # fmt: skip
            answered = False
            resp: UpstreamResponse | None = None
            try:
                try:
                    resp = await self.upstream.open(
                        worker, path, body, headers if source is None else {**headers, KV_SOURCE_HEADER: source},
                        insert, head_timeout, insert.record,
                    )  # fmt: skip
                    # NOTE: a whole answer is read before any of it reaches the client, so one cut off
                    # after its head goes to the next worker as a failed attempt does
                    whole = not (parsed.stream and resp.status == 200)
                    try:
                        payload = await self.upstream.read_all(resp) if whole else b""
                    except BaseException:
                        resp.close()  # NOTE: a client gone mid-read too: the connection must not stay open
                        raise
                except UpstreamFailure as exc:
                    failure = exc
                    fault = fault if exc.kind == "overloaded" else exc
                    if exc.kind == "request_timeout":  # NOTE: the request's own time ran out: no retry
                        if not parsed.stream:  # nothing came in all that time: a black hole is charged
                            self._record_failure(worker, "timeout", probe)
                        break
                    if exc.kind == "overloaded":  # NOTE: it answered, so no fault: its queue is full
                        insert.take_back(self.events.synced(worker))
                        worker.breaker.record_success()
                        worker.stats.overloaded += 1
                    else:
                        self._record_failure(worker, exc.kind, probe)
                    tried.add(worker.url)
                    moved_from = worker
                    log.warning("attempt %d to %s failed: %s", attempt + 1, worker.url, exc)
                    continue
                # NOTE: any whole answer below 500, client errors included, clears the worker's faults;
                # a stream's head only closes a half-open breaker: one that breaks off is a fault
                if whole:
                    worker.breaker.record_success()
                else:
                    worker.breaker.answering(probe)
                if resp.status >= 400:
                    insert.take_back(self.events.synced(worker))
                # NOTE: the predicted hit rate's tokens are counted with the worker's usage, so both hit
                # rates cover the same answers (a stream cut off before its usage counts in neither); of a
                # batch, the prompt it was routed by, the one the index predicted (the others counted as
                # uncached tokens made [P] * 4 read a quarter of what the workers served from cache)
                tally = None if parsed.follow_up else (route.prompt_tokens, predicted)
                try:
                    if whole:
                        stream = parsed.stream
                        await self._send_full(send, watch, worker, resp, payload, started, stream, tally)
                        answered = True
                    else:
                        responses = path.endswith("/responses")
                        answered = await self._send_stream(send, watch, worker, resp, started, prefill, strip_usage,
                                                           responses, tally)  # fmt: skip
                        if answered:
                            worker.breaker.record_success()
                finally:
                    resp.close()
                return resp.status
            finally:
                if not answered:  # NOTE: refused, failed, or the client left before the answer
                    self._forget_unconfirmed(insert, worker)
                worker.breaker.abandon_probe(probe)  # NOTE: where no verdict came (the client left)
                worker.in_flight -= parsed.sequences
                prefill.release()
                worker.changed()
        if only is not None and failure is None:
            holder = self.workers.get(only)
            if (
                holder is not None
                and parsed.model is not None
                and holder.models
                and parsed.model not in holder.models
            ):
                # NOTE: up and serving, not this model: the client's error (a 503 would be retried for good)
                raise RouterError(404, f"the worker holding response {previous!r} ({only}) does not serve model "
                                  f"{parsed.model!r}", "model_not_found")  # fmt: skip
            raise RouterError(503, f"the worker holding response {previous!r} ({only}) is not available",
                              "worker_unavailable")  # fmt: skip
        if only is not None and fault is not None and fault.kind in HOLDER_DOWN:
            # NOTE: down before a health check told: the same answer as after one (not a 502 connect)
            raise RouterError(503, f"the worker holding response {previous!r} ({only}) is not available: {fault}",
                              "worker_unavailable")  # fmt: skip
        if fault is not None:  # NOTE: a 429 only where every worker tried had a full queue
            raise RouterError(
                fault.status if fault.status in (502, 503, 504) else 502, str(fault), fault.kind
            )
        if failure is not None:
            raise RouterError(
                429,
                f"every worker tried has a full queue ({failure})",
                "overloaded",
                QUEUE_FULL_RETRY_AFTER_S,
            )
        raise self.group_unavailable(group, parsed.model) or RouterError(
            503, "no healthy worker is available", "no_healthy_worker"
        )

    def group_unavailable(self, group: str | None, model: str) -> RouterError | None:
        """The error of a request no worker took where workers are up but its affinity group's overflow
        (none) keeps it off them; None otherwise (/debug/route explains it in the same words)."""
        if group is None or not self.workers.candidates(model):
            return None
        return RouterError(503, f"no worker of affinity group {group!r} is available (its overflow is none)",
                           "affinity_group_unavailable")  # fmt: skip

    def _forget_unconfirmed(self, insert: OptimisticInsert, worker: Worker) -> None:
        """An attempt that ended without its answer: its optimistic insert is taken back where
        nothing reached the worker, and where the index follows the worker's KV events (they put
        back whatever the worker did compute; a request cancelled in its queue computed nothing).
        A worker without events may have computed it: the insert stays."""
        followed = self.events.synced(worker)
        if not insert.sent or followed:
            insert.take_back(followed)

    def _record_failure(self, worker: Worker, kind: str, probe: int = 0) -> None:
        """A worker fault (``probe``: the attempt's breaker probe number; 0 after a stream's head,
        which closed the breaker: CircuitBreaker.answering)."""
        if kind == "request_timeout":
            return  # NOTE: the request's own time ran out (request_timeout_s): not a worker fault
        worker.stats.errors[kind] += 1
        worker.breaker.record_failure(time.monotonic(), probe)

    def _record_usage(self, worker: Worker, usage: Usage | None, tally: tuple[int, int] | None) -> None:
        """The worker's usage of an answer, in the access log, and in the hit rates' counters with
        ``tally`` (the router's prompt tokens and predicted cached tokens of it): the two hit rates
        count the same answers, those that reported their usage. A Responses follow-up has no tally
        (None): the router sees none of its prompt (the worker holds the conversation)."""
        if usage is None:
            return
        if tally is not None:
            stats = worker.stats
            stats.prompt_tokens += tally[0]
            stats.predicted_cached_tokens += tally[1]
            stats.usage_prompt_tokens += usage.prompt_tokens
            stats.cached_tokens += usage.cached_tokens
        access_log.note(usage_prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)

    async def _send_full(
        self, send: Callable, watch: ClientWatch, worker: Worker, resp: UpstreamResponse, payload: bytes,
        started: float, stream: bool, tally: tuple[int, int] | None,
    ) -> None:  # fmt: skip
        """A whole answer (``payload``, read): a non-stream one, or a stream request's refusal
        (``stream``: its metrics' label stays the request's; ``tally``: see _record_usage)."""
        elapsed = time.perf_counter() - started
        self.metrics.ttft_of[stream].observe(elapsed)
        access_log.note(ttft_ms=round(elapsed * 1e3, 3))
        self.metrics.duration_of[stream].observe(elapsed)
        if resp.status == 200:
            self._record_usage(worker, body_usage(payload), tally)
        watch.stop()
        content_type = resp.headers.get("content-type", "application/json").encode("latin-1")
        await _send_bytes(send, resp.status, payload, content_type, worker.url.encode("latin-1"))

    async def _send_stream(
        self,
        send: Callable,
        watch: ClientWatch,
        worker: Worker,
        resp: UpstreamResponse,
        started: float,
        prefill: PendingPrefill,
        strip_usage: bool = False,
        responses: bool = False,
        tally: tuple[int, int] | None = None,
    ) -> bool:
        """Pass the SSE body through chunk by chunk as it arrives: no re-framing, no buffering
        (with ``strip_usage``, whole lines, without the usage chunk the client did not ask for).
        A stream that breaks off ends with an error event (``responses``: the Responses API's).
        True when the worker's stream ended whole (not broken off)."""
        scanner = SSEUsageScanner(strip_usage)
        tail = b"\n\n"  # the last bytes sent: does the client's stream end between events?
        numbers = _EventNumbers()  # Responses: the last event passed on whole (read if the stream breaks)
        error = b""  # what ends a stream that broke off
        content_type = resp.headers.get("content-type", "text/event-stream").encode("latin-1")
        await send(
            {
                "type": "http.response.start",
                "status": resp.status,
                "headers": [
                    (b"content-type", content_type),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                    (WORKER_HEADER_B, worker.url.encode("latin-1")),
                ],
            }
        )
        first, finished, whole, delivered = True, False, False, False
        try:
            async for chunk in resp.chunks():
                if first:
                    ttft = time.perf_counter() - started
                    self.metrics.ttft_of[True].observe(ttft)
                    access_log.note(ttft_ms=round(ttft * 1e3, 3))
                    prefill.release()
                    first = False
                out = scanner.feed(chunk)
                finished = resp.at_end  # the last chunk: end the client's stream in the same write
                if finished:
                    out += scanner.flush()
                    watch.stop()
                if out or finished:
                    await send({"type": "http.response.body", "body": out, "more_body": not finished})
                    if responses:
                        numbers.feed(out)
                    # NOTE: the answer's last event has reached the client (the worker's end may come in a
                    # read of its own): a client that closes now got all of it, and must not cancel this
                    if not delivered and (numbers.ended if responses else b"\ndata: [DONE]\n" in tail + out):
                        delivered = True
                        watch.stop()
                    tail = out[-2:] if len(out) >= 2 else (tail + out)[-2:]
            whole = True  # NOTE: the body ended (its last bytes may come in a read of their own)
            if not finished:  # NOTE: its end came in a read of its own: a last line held back goes out
                error = scanner.flush()
            if scanner.error is not None:  # NOTE: the worker ended it with an error event, after its 200
                access_log.note(error=scanner.error)
        except HTTPClientError as exc:
            # The worker broke mid-stream (or the request ran past request_timeout_s): bytes
            # already reached the client, so no retry; the client is told in an error event.
            total = isinstance(exc, ResponseTimeout) and exc.total
            kind = "request_timeout" if total else "stream_broken"
            access_log.note(error=kind)  # NOTE: the status stays the 200 the client already got
            self._record_failure(worker, kind)
            log.warning("stream from %s broke: %s", worker.url, exc)
            timeout = self.config.request_timeout_s
            message = (f"the request ran past the router's request timeout ({timeout:g} s)" if total
                       else f"the worker broke off the stream: {exc}")  # fmt: skip
            # NOTE: an event cut off mid-way is ended first (the client reads it as a bad event)
            cut = b"" if tail == b"\n\n" else b"\n\n"
            error = cut + stream_error_event(
                responses, 504 if total else 502, message, kind, numbers.last, numbers.response
            )
        finally:
            self._record_usage(worker, scanner.usage, tally)
            self.metrics.duration_of[True].observe(time.perf_counter() - started)
        if not finished:
            watch.stop()
            await send({"type": "http.response.body", "body": error, "more_body": False})
        return whole


_SEQUENCE_NUMBER = re.compile(rb'"sequence_number":\s*(\d+)')  # a Responses stream's event numbers
# a Responses stream's last event's name line
_FINAL_EVENT = re.compile(rb"event: ?response\.(?:completed|incomplete|failed)\r?")


class _EventNumbers:
    """The ``sequence_number`` of the last whole line of a Responses stream passed on: a line cut
    off mid-way (its number perhaps cut too: 12 read as 1) is not read; and the response object of
    its ``response.created`` event (what a ``response.failed`` the router sends fails)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.response: dict | None = None
        self.ended = False  # the data line of the stream's last event (completed, incomplete, failed) passed
        self._final = False  # the last whole line was a last event's name: its data line is next
        self._partial: list[bytes] = []  # the line not ended yet, in pieces

    def feed(self, out: bytes) -> None:
        end = out.rfind(b"\n")
        if end < 0:
            self._partial.append(out)
            return
        whole = b"".join(self._partial) + out[: end + 1] if self._partial else out[: end + 1]
        self._partial = [out[end + 1 :]] if end + 1 < len(out) else []
        found = _SEQUENCE_NUMBER.findall(whole)
        if found:
            self.last = int(found[-1])
        if not self.ended and (self._final or _FINAL_EVENT.search(whole)):
            for line in whole[:-1].split(b"\n"):
                if self._final and line.startswith(b"data:"):
                    self.ended = True
                    break
                self._final = _FINAL_EVENT.fullmatch(line) is not None
        if self.response is None and b'"response.created"' in whole:  # NOTE: the stream's first event
            for line in whole.split(b"\n"):
                if line.startswith(b"data:") and b'"response.created"' in line:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                        event = orjson.loads(line[5:])
                        if isinstance(event.get("response"), dict):
                            self.response = event["response"]
                    break


# -------------------------------------------------------------------- HTTP layer


async def _send_bytes(
    send: Callable, status: int, body: bytes, content_type: bytes, worker: bytes | None = None,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:  # fmt: skip
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or ())]
    if worker is not None:
        headers.append((WORKER_HEADER_B, worker))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
