"""The router's ASGI app: the two completion endpoints go straight to Router.handle_completion
(router/gateway.py, no framework on the hot path); models, health, readiness, metrics, the admin
/workers endpoint and /debug/route are a small Starlette app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
import yarl
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.api_keys import bearer_token, token_matches
from router.circuit_breaker import BreakerState
from router.config import RouterConfig
from router.errors import HTTP_ERROR_HANDLERS, RouterError, error_response, router_error_response
from router.gateway import Router
from router.http_client import worker_base_url
from router.proxy import UpstreamFailure, forwarded_headers
from router.request_id import RequestId
from router.request_parsing import read_body
from router.route_explain import explain
from router.workers import Worker

log = logging.getLogger("radixgate.router")

COMPLETION_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}


_NOT_POST = ["GET", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _endpoint_of(body: Any) -> str:
    """The endpoint a /debug/route body is for, by its input: ``messages`` (chat), ``input``
    without ``prompt`` (responses), else completions."""
    if isinstance(body, dict) and "messages" in body:
        return "chat"
    if isinstance(body, dict) and "input" in body and "prompt" not in body:
        return "responses"
    return "completions"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def _method_not_allowed(request: Request) -> Response:
    """Any method but POST on a completion endpoint (POSTs never reach the Starlette app): answered
    by the app's handler of Starlette's own errors (router/errors.http_error)."""
    raise HTTPException(405, headers={"Allow": "POST"})


def build_app(config: RouterConfig, on_shutdown: list[Callable[[], None]] | None = None) -> RouterApp:
    """The router app; ``on_shutdown`` callbacks run when it stops (e.g. stopping launched workers)."""
    router = Router(config)

    def keyed(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """``handler`` behind the API key check (router/api_keys.py)."""

        async def endpoint(request: Request) -> Response:
            try:
                router.api_keys.check(request.headers.get("authorization"))
            except RouterError as exc:
                return router_error_response(exc)
            return await handler(request)

        return endpoint

    started = int(time.time())  # NOTE: a model's ``created``: when this router began serving it

    def model_entry(m: str) -> dict[str, Any]:
        """``max_model_len``: the largest any healthy worker serving it reports when they all count
        tokens as the router does (a prompt goes to one whose context holds it: Router.decide), else
        the smallest (the request may land on any of them); ``parent``: a LoRA adapter's base model."""
        entry: dict[str, Any] = {"id": m, "object": "model", "created": started, "owned_by": "radixgate"}
        serving = [w for w in router.workers if w.healthy and m in w.max_model_len]
        if serving:
            exact = all(w.counts_like(router.tokenizer.name) for w in serving)
            entry["max_model_len"] = (max if exact else min)(w.max_model_len[m] for w in serving)
        parent = next((w.parents[m] for w in router.workers if m in w.parents), None)
        if parent is not None:
            entry["parent"] = parent
        return entry

    async def models(request: Request) -> Response:
        """The workers' models."""
        return _json({"object": "list", "data": [model_entry(m) for m in sorted(router.workers.models())]})

    async def model(request: Request) -> Response:
        """One of the workers' models (GET /v1/models/{model}); 404 for one no worker serves."""
        m = request.path_params["model"]
        if m not in router.workers.models():
            return error_response(404, f"model {m!r} is not served by any worker", "model_not_found")
        return _json(model_entry(m))

    async def health(request: Request) -> Response:
        healthy = sum(1 for w in router.workers if w.healthy)
        return _json({"status": "ok", "workers": len(router.workers), "healthy_workers": healthy})

    async def ready(request: Request) -> Response:
        if router.draining:
            return error_response(503, "shutting down", "draining")
        healthy = sum(1 for w in router.workers if w.healthy)
        if healthy == 0:
            return error_response(503, "no healthy worker", "not_ready")
        return _json({"status": "ready", "healthy_workers": healthy})

    async def metrics(request: Request) -> Response:
        return Response(await router.metrics.render(), media_type="text/plain; version=0.0.4")

    def authorized(request: Request) -> bool:
        if not config.admin_token:
            return True
        return token_matches(bearer_token(request.headers.get("authorization")), config.admin_token)

    async def workers_endpoint(request: Request) -> Response:
        if not authorized(request):
            return error_response(
                401, "admin endpoints need 'Authorization: Bearer <admin token>'", "unauthorized"
            )
        if request.method == "GET" and not config.admin_token:  # NOTE: the fleet no more open than its models
            try:
                router.api_keys.check(request.headers.get("authorization"))
            except RouterError as exc:
                return router_error_response(exc)
        if request.method != "GET" and not config.admin_token and (config.api_keys or config.worker_api_key):
            # NOTE: a router that guards its clients or its workers with keys must not let anyone
            # register a worker: it would be sent the worker key and the clients' prompts
            return error_response(
                403, "changing workers on a router with API keys needs --admin-token", "admin_token_required"
            )
        if request.method == "GET":
            return _json(
                {
                    "workers": router.workers.describe(),
                    "affinity_groups": router.affinity.describe(router.workers.served()),
                    "replica_sync": router.replica_sync.describe() if router.replica_sync else None,
                    "discovery": router.discovery.describe() if router.discovery else None,
                }
            )
        url = request.query_params.get("url")
        if url is None:
            try:
                body = orjson.loads(await read_body(request, 65536, config.body_timeout_s) or b"{}")
            except RouterError as exc:  # NOTE: too large, or too slow
                return router_error_response(exc)
            except orjson.JSONDecodeError:
                return error_response(400, 'expected a JSON body {"url": ...} or ?url=', "invalid_request")
            url = body.get("url") if isinstance(body, dict) else None
        try:
            url = worker_base_url(url)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request")
        if request.method == "POST" and config.names_this_router(url):
            return error_response(400, f"{url} is this router's own address: it would route to itself",
                                  "invalid_request")  # fmt: skip
        if request.method == "POST":
            existed = router.workers.get(url) is not None
            worker = router.workers.add(url)
            if router.discovery is not None:  # NOTE: the operator's now: discovery never removes it
                router.discovery.found.discard(url)
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
            raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
            body = orjson.loads(raw) if raw else None
            endpoint = _endpoint_of(body)
            parsed = await router.parse_soon(raw, endpoint)
            router.check_model(parsed.model)
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON", "invalid_json")
        except RouterError as exc:
            return router_error_response(exc)
        # NOTE: the headers as routing reads them: a repeated header's last value
        return _json(explain(router, parsed, endpoint, dict(request.headers.items())))

    def least_loaded(model: str | None) -> Worker:
        """The least loaded healthy worker serving ``model``; RouterError 503 when there is none."""
        workers = router.workers.candidates(model)
        if not workers:
            raise RouterError(503, "no healthy worker is available", "no_healthy_worker")
        return min(workers, key=lambda w: w.load)

    async def to_one_worker(request: Request) -> Response:
        """/tokenize and /detokenize: answered by the least loaded healthy worker serving the body's
        model (a model's workers share its tokenizer); nothing is routed by prefix or counted."""
        try:
            raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)
            body = orjson.loads(raw)
            model = body.get("model") if isinstance(body, dict) else None
            if model is not None and not isinstance(model, str):
                return error_response(400, "'model' must be a string", "invalid_type")
            router.check_model(model)  # NOTE: none named in a fleet of several models: a 400, as for the API
            worker = least_loaded(model)
        except orjson.JSONDecodeError:
            return error_response(400, "request body is not valid JSON", "invalid_json")
        except RouterError as exc:
            return router_error_response(exc)
        try:
            resp = await router.upstream.open(
                worker, request.url.path, raw, forwarded_headers(request.headers)
            )
            try:
                payload = await router.upstream.read_all(resp)
            finally:
                resp.close()
        except UpstreamFailure as exc:
            return error_response(exc.status, str(exc), exc.kind)
        except RouterError as exc:  # NOTE: the router's own (out of file descriptors)
            return router_error_response(exc)
        content_type = resp.headers.get("content-type", "application/json")
        return Response(payload, resp.status, {"x-radixgate-worker": worker.url}, content_type)

    async def stored_response(request: Request) -> Response:
        """GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items (its query passed on):
        answered by the worker the id names (another backend's id: by the least loaded healthy worker)."""
        rid = request.path_params["response_id"]
        url = router.response_holder(rid)
        holder = None if url is None else router.workers.get(url)
        try:
            # NOTE: not available(): that may turn an open breaker half-open with no probe sent
            if holder is not None and (not holder.healthy or holder.breaker.state is BreakerState.OPEN):
                raise RouterError(503, f"the worker holding response {rid!r} ({url}) is not available",
                                  "worker_unavailable")  # fmt: skip
            url = url or least_loaded(None).url
            session = router.upstream.session
            assert session is not None
            timeout = aiohttp.ClientTimeout(
                total=config.first_byte_timeout_s, connect=config.connect_timeout_s
            )
            headers = forwarded_headers(request.headers)
            if router.upstream.authorization is not None:  # NOTE: the session sends the worker key
                headers.pop("authorization", None)
            # NOTE: the id percent-encoded whole: sent decoded, an id of '..' named GET /v1/ and one
            # of '%41' the id 'A'
            suffix = "/input_items" if request.url.path.endswith("/input_items") else ""
            target = yarl.URL(f"{url}/v1/responses/{quote(rid, safe='')}{suffix}", encoded=True)
            if request.query_params:
                target = target.with_query(list(request.query_params.multi_items()))
            async with session.request(request.method, target, timeout=timeout,
                                       headers=headers) as resp:  # fmt: skip
                payload = await resp.read()
                content_type = resp.headers.get("content-type", "application/json")
        except RouterError as exc:
            return router_error_response(exc)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            failed = (
                "did not answer in time" if isinstance(exc, asyncio.TimeoutError) else f"unreachable: {exc}"
            )
            if holder is not None:  # NOTE: down before a health check told: as after one
                return error_response(503, f"the worker holding response {rid!r} ({url}) is not available: "
                                      f"{failed}", "worker_unavailable")  # fmt: skip
            if isinstance(exc, asyncio.TimeoutError):
                return error_response(504, f"worker {url} {failed}", "timeout")
            return error_response(502, f"worker {url} {failed}", "connect")
        return Response(payload, resp.status, {"x-radixgate-worker": url}, content_type)

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
            Route("/v1/chat/completions", _method_not_allowed, methods=_NOT_POST),
            Route("/v1/completions", _method_not_allowed, methods=_NOT_POST),
            Route("/v1/responses", _method_not_allowed, methods=_NOT_POST),
            Route("/v1/responses/{response_id}", keyed(stored_response), methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", keyed(stored_response), methods=["GET"]),
            Route("/v1/models", keyed(models), methods=["GET"]),
            Route("/v1/models/{model:path}", keyed(model), methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/workers", workers_endpoint, methods=["GET", "POST", "DELETE"]),
            Route("/debug/route", keyed(debug_route), methods=["POST"]),
            Route("/tokenize", keyed(to_one_worker), methods=["POST"]),
            Route("/detokenize", keyed(to_one_worker), methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers=HTTP_ERROR_HANDLERS,
    )
    app.state.router = router
    return RouterApp(router, app)


class RouterApp:
    """The ASGI entry point: POSTs to the two completion endpoints take the router's direct path
    (Router.handle_completion); everything else, lifespan included, goes to the Starlette app."""

    def __init__(self, router: Router, app: Starlette) -> None:
        self.router = router
        self.app = app
        self.state = app.state
        self._entry = RequestId(self._dispatch)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self._entry(scope, receive, send)

    async def _dispatch(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = COMPLETION_ENDPOINTS.get(scope["path"])
            if endpoint is not None:
                await self.router.handle_completion(scope, receive, send, endpoint)
                return
        await self.app(scope, receive, send)
