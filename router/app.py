"""The router's ASGI app: parse and validate OpenAI requests, pick a worker, stream the answer back.

Data flows one way: parse -> tokenize + hash -> policy picks -> proxy streams. Bad input gets an
OpenAI-shaped 4xx and never touches a worker; no request path leaves a worker's load counted."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.block_hash import block_hashes
from router.circuit_breaker import CircuitBreaker
from router.config import RouterConfig
from router.errors import RouterError, error_response
from router.event_subscriber import EventSubscriber
from router.health import HealthChecker
from router.metrics import RouterMetrics
from router.policies import Candidate, Decision, RouteRequest, make_policy
from router.prefix_index import PrefixIndex
from router.proxy import FORWARDED_HEADERS, SSEUsageScanner, Upstream, UpstreamFailure, Usage, parse_usage
from router.request_parsing import ParsedRequest, parse_request, read_body
from router.tokenization import load_tokenizer
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("radixgate.router")

WORKER_HEADER = "x-radixgate-worker"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work`` but cancel it (closing its upstream connection) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone
    finally:
        watcher.cancel()


class _UpstreamStream(StreamingResponse):
    """A streamed upstream answer whose cleanup runs however the response ends, even if the
    client vanished before the first chunk was pulled (a generator's finally would not run)."""

    def __init__(self, content: Any, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Router:
    """All router state; one instance per app."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.block_size = config.block_size
        self.index = PrefixIndex(max_entries=config.max_index_entries)
        self.policy = make_policy(config.policy, self.index, config.policy_params)
        self.workers = WorkerRegistry(
            lambda: CircuitBreaker(
                failure_threshold=config.breaker_failure_threshold, open_seconds=config.breaker_open_s
            )
        )
        self.workers.on_added.append(lambda w: self.index.add_worker(w.url))
        self.workers.on_removed.append(lambda w: self.index.remove_worker(w.url))
        self.metrics = RouterMetrics(self.workers, lambda: (self.index.num_entries, self.index.num_nodes))
        self.upstream = Upstream(
            config.connect_timeout_s, config.first_byte_timeout_s, config.request_timeout_s
        )
        self.health = HealthChecker(self, config.health_interval_s, config.health_timeout_s)
        self.events = EventSubscriber(self, config.kv_events, config.redis_url)
        for url in config.workers:
            self.workers.add(url)

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.upstream.start()
        await self.health.check_all()
        healthy = [w.url for w in self.workers if w.healthy]
        log.info("workers: %d configured, healthy: %s", len(self.workers), ", ".join(healthy) or "none")
        self.health.start()
        await self.events.start()

    async def stop(self) -> None:
        await self.events.stop()
        await self.health.stop()
        await self.upstream.close()

    # ---------------------------------------------------------------- parsing
    def parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        return parse_request(raw, chat, self.tokenizer)

    def namespace(self, model: str | None) -> str:
        """Root of the block-hash chain: the model name, as the workers use for their events."""
        if model is not None:
            return model
        models = self.workers.models()
        return next(iter(models)) if len(models) == 1 else ""

    # ---------------------------------------------------------------- routing
    def route_request(self, parsed: ParsedRequest) -> RouteRequest:
        hashes = block_hashes(parsed.token_ids, self.block_size, self.namespace(parsed.model))
        return RouteRequest(hashes, len(parsed.token_ids), self.block_size)

    def check_model(self, model: str | None) -> None:
        if not len(self.workers):
            raise RouterError(503, "no workers are registered", "no_workers")
        if model is not None and not self.workers.serves(model):
            raise RouterError(404, f"model {model!r} is not served by any worker", "model_not_found")

    def decide(self, route: RouteRequest, model: str | None, exclude: set[str]) -> Decision | None:
        candidates = self.workers.candidates(model, exclude)
        if not candidates:
            return None
        return self.policy.select(route, [Candidate(w.url, w.load) for w in candidates])

    async def forward(self, request: Request, parsed: ParsedRequest, path: str, started: float) -> Response:
        t0 = time.perf_counter()
        route = self.route_request(parsed)
        headers = {"content-type": "application/json"}
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                headers[name] = value
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        for attempt in range(self.config.max_retries + 1):
            decision = self.decide(route, parsed.model, tried)
            if attempt == 0:
                self.metrics.decision.observe(time.perf_counter() - t0)
            if decision is None:
                break
            worker = self.workers.get(decision.url)
            assert worker is not None
            self.policy.on_routed(route, worker.url)
            worker.in_flight += 1
            worker.breaker.on_send()
            worker.stats.requests += 1
            try:
                resp = await _unless_disconnected(
                    request, self.upstream.open(worker, path, parsed.raw, headers)
                )
            except UpstreamFailure as exc:
                worker.in_flight -= 1
                self._record_failure(worker, exc.kind)
                worker.stats.retries += 1
                tried.add(worker.url)
                failure = exc
                log.warning("attempt %d to %s failed: %s", attempt + 1, worker.url, exc)
                continue
            except BaseException:
                worker.in_flight -= 1
                raise
            worker.breaker.record_success()  # any answer below 500, client errors included
            worker.stats.prompt_tokens += route.prompt_tokens
            worker.stats.predicted_cached_tokens += decision.matched_tokens.get(worker.url, 0)
            if parsed.stream and resp.status == 200:
                return self._stream_response(worker, resp, started)
            return await self._full_response(request, worker, resp, started)
        if failure is not None:
            raise RouterError(
                failure.status if failure.status in (502, 503, 504) else 502, str(failure), failure.kind
            )
        raise RouterError(503, "no healthy worker is available", "no_healthy_worker")

    def _record_failure(self, worker: Worker, kind: str) -> None:
        worker.stats.errors[kind] += 1
        worker.breaker.record_failure(time.monotonic())

    def _record_usage(self, worker: Worker, usage: Usage | None) -> None:
        if usage is not None:
            worker.stats.usage_prompt_tokens += usage.prompt_tokens
            worker.stats.cached_tokens += usage.cached_tokens

    async def _full_response(
        self, request: Request, worker: Worker, resp: aiohttp.ClientResponse, started: float
    ) -> Response:
        try:
            payload = await _unless_disconnected(request, self.upstream.read_all(resp))
        except UpstreamFailure as exc:
            self._record_failure(worker, exc.kind)
            raise RouterError(exc.status, str(exc), exc.kind) from None
        finally:
            resp.close()
            worker.in_flight -= 1
        elapsed = time.perf_counter() - started
        self.metrics.ttft.labels("false").observe(elapsed)
        self.metrics.duration.labels("false").observe(elapsed)
        if resp.status == 200:
            with contextlib.suppress(orjson.JSONDecodeError):
                self._record_usage(worker, parse_usage(orjson.loads(payload)))
        return Response(
            payload,
            status_code=resp.status,
            media_type=resp.headers.get("content-type", "application/json"),
            headers={WORKER_HEADER: worker.url},
        )

    def _stream_response(self, worker: Worker, resp: aiohttp.ClientResponse, started: float) -> Response:
        scanner = SSEUsageScanner()
        closed = False

        async def chunks():
            first = True
            try:
                async for chunk in resp.content.iter_any():
                    if first:
                        self.metrics.ttft.labels("true").observe(time.perf_counter() - started)
                        first = False
                    scanner.feed(chunk)
                    yield chunk
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                # The worker broke mid-stream: bytes already reached the client, so no retry; the
                # client sees the stream end without [DONE].
                self._record_failure(worker, "stream_broken")
                log.warning("stream from %s broke: %r", worker.url, exc)

        def on_close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            resp.close()
            worker.in_flight -= 1
            self._record_usage(worker, scanner.usage)
            self.metrics.duration.labels("true").observe(time.perf_counter() - started)

        return _UpstreamStream(
            chunks(),
            on_close,
            status_code=resp.status,
            media_type=resp.headers.get("content-type", "text/event-stream"),
            headers={WORKER_HEADER: worker.url, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    # ---------------------------------------------------------------- explain
    def explain(self, parsed: ParsedRequest) -> dict[str, Any]:
        route = self.route_request(parsed)
        decision = self.decide(route, parsed.model, set())
        matched = self.index.match(route.block_hashes)
        return {
            "worker": None if decision is None else decision.url,
            "reason": "no healthy worker" if decision is None else decision.reason,
            "policy": self.policy.name,
            "prompt_tokens": route.prompt_tokens,
            "block_size": route.block_size,
            "blocks": len(route.block_hashes),
            "block_hashes": [str(h) for h in route.block_hashes],  # strings: exact in any JSON client
            "candidates": [
                {
                    "url": w.url,
                    "healthy": w.healthy,
                    "available": w.available(time.monotonic()),
                    "load": w.load,
                    "in_flight": w.in_flight,
                    "matched_tokens": (
                        decision.matched_tokens.get(w.url, 0)
                        if decision is not None and w.url in decision.matched_tokens
                        else matched.get(w.url, 0) * route.block_size
                    ),
                }
                for w in self.workers
            ],
        }


# -------------------------------------------------------------------- HTTP layer
def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def build_app(config: RouterConfig, on_shutdown: list[Callable[[], None]] | None = None) -> Starlette:
    """The router app; ``on_shutdown`` callbacks run when it stops (e.g. stopping launched workers)."""
    router = Router(config)

    async def completion(request: Request, chat: bool, path: str, endpoint: str) -> Response:
        started = time.perf_counter()
        status = 500
        try:
            raw = await read_body(request, config.max_body_bytes)
            parsed = router.parse(raw, chat)
            router.check_model(parsed.model)
            response = await router.forward(request, parsed, path, started)
            status = response.status_code
            return response
        except RouterError as exc:
            status = exc.status
            if exc.status >= 500:
                log.warning("%s: %d %s", endpoint, exc.status, exc.message)
            else:
                log.info("%s: rejected %d %s", endpoint, exc.status, exc.message)
            return error_response(exc.status, exc.message, exc.code)
        except (ClientGone, ClientDisconnect):
            status = 499  # the client closed the connection; nobody reads this answer
            return Response(status_code=499)
        finally:
            router.metrics.requests.labels(endpoint, str(status)).inc()

    async def chat_completions(request: Request) -> Response:
        return await completion(request, True, "/v1/chat/completions", "chat")

    async def completions(request: Request) -> Response:
        return await completion(request, False, "/v1/completions", "completions")

    async def models(request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "owned_by": "radixgate"} for m in sorted(router.workers.models())
        ]
        return _json({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        healthy = sum(1 for w in router.workers if w.healthy)
        return _json({"status": "ok", "workers": len(router.workers), "healthy_workers": healthy})

    async def ready(request: Request) -> Response:
        healthy = sum(1 for w in router.workers if w.healthy)
        if healthy == 0:
            return error_response(503, "no healthy worker", "not_ready")
        return _json({"status": "ready", "healthy_workers": healthy})

    async def metrics(request: Request) -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    def authorized(request: Request) -> bool:
        if not config.admin_token:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {config.admin_token}".encode())

    async def workers_endpoint(request: Request) -> Response:
        if not authorized(request):
            return error_response(
                401, "admin endpoints need 'Authorization: Bearer <admin token>'", "unauthorized"
            )
        if request.method == "GET":
            return _json({"workers": router.workers.describe()})
        url = request.query_params.get("url")
        if url is None:
            try:
                body = orjson.loads(await read_body(request, 65536) or b"{}")
            except (orjson.JSONDecodeError, RouterError):
                return error_response(400, 'expected a JSON body {"url": ...} or ?url=', "invalid_request")
            url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return error_response(400, "'url' must be an http(s) URL", "invalid_request")
        url = url.rstrip("/")
        if request.method == "POST":
            existed = router.workers.get(url) is not None
            worker = router.workers.add(url)
            if not existed:
                await router.health.check(worker)
                log.info("worker added: %s (healthy=%s)", url, worker.healthy)
            return _json(
                {"added": not existed, "worker": url, "healthy": worker.healthy}, 200 if existed else 201
            )
        if not router.workers.remove(url):
            return error_response(404, f"worker {url} is not registered", "worker_not_found")
        log.info("worker removed: %s", url)
        return _json({"removed": url})

    async def debug_route(request: Request) -> Response:
        try:
            raw = await read_body(request, config.max_body_bytes)
            body = orjson.loads(raw) if raw else None
            chat = isinstance(body, dict) and "messages" in body
            parsed = router.parse(raw, chat)
            router.check_model(parsed.model)
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON", "invalid_json")
        except RouterError as exc:
            return error_response(exc.status, exc.message, exc.code)
        return _json(router.explain(parsed))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await router.start()
        log.info("router listening on http://%s:%d (policy %s)", config.host, config.port, config.policy)
        try:
            yield
        finally:
            await router.stop()
            for callback in on_shutdown or ():
                callback()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/workers", workers_endpoint, methods=["GET", "POST", "DELETE"]),
            Route("/debug/route", debug_route, methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = router
    return app
