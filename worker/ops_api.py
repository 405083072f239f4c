"""The worker's operational endpoints: the model list, health, Prometheus metrics, and the radix
cache's info, flush, snapshot and KV event stream (what routers and operators read)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from router.api_keys import bearer_token, token_matches
from router.block_hash import HASH_VERSION
from router.errors import error_response
from router.kv_events import EVENT_VERSION
from worker.api_params import APIError, json_object, read_bounded
from worker.engine import Engine
from worker.engine_api import EngineDeadError
from worker.kv_pages import kv_bytes_per_token, kv_layout

SSE_PING_S = 15.0  # comment line on idle event streams, so dead clients are noticed


# /v1/cache/info's name for the fp8 projections' inputs under each --fp8-activations (none: the dtype's)
_INPUTS = {"dynamic": "fp8 per token", "static": "fp8 static"}


def weights_info(model: Any) -> dict[str, Any]:
    """The model's weights as /v1/cache/info reports them: their dtype, and whether its projections are in
    fp8 (``fp8_projections``: null, or where they come from, their scales (a block's rows and columns, or
    "row") and their inputs' precision: "fp8 per token" under --fp8-activations dynamic, "fp8 static" under
    static (the checkpoint's input scales), else the dtype's), and whether an fp8 pool holds K and V over
    the checkpoint's KV scales (``kv_scales``: "checkpoint", or null)."""
    c, dtype = model.config, str(model.dtype).removeprefix("torch.")
    fp8 = None
    if c.fp8_projections:
        fp8 = {"source": "checkpoint" if c.fp8_weights else "quantized at load",
               "scales": list(c.fp8_weight_block) if c.fp8_weight_block else "row",
               "activations": _INPUTS.get(c.input_quantization, dtype)}  # fmt: skip
    return {"weight_dtype": dtype, "fp8_projections": fp8, "kv_scales": "checkpoint" if c.kv_scales else None}


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class OpsAPI:
    """Routes bound to one engine."""

    def __init__(self, engine: Engine, admin_token: str | None = None) -> None:
        self.engine = engine
        self.admin_token = admin_token
        self.created = int(time.time())

    def _model_entries(self) -> list[dict]:
        base = self.engine.served_model_name
        model = {"id": base, "object": "model", "created": self.created, "owned_by": "radixgate",
                 "max_model_len": self.engine.max_total_tokens}  # fmt: skip
        return [model, *({**model, "id": name, "parent": base} for name in self.engine.served_models()[1:])]

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": self._model_entries()})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the base model or one of its adapters; 404 otherwise."""
        name = request.path_params["model"]
        found = next((m for m in self._model_entries() if m["id"] == name), None)
        if found is None:
            raise APIError(404, f"model {name!r} is not served here", "model_not_found")
        return _json(found)

    async def health(self, request: Request) -> Response:
        snap = self.engine.snapshot()
        alive = self.engine.alive
        ready = alive and self.engine.ready.is_set()  # not before the warm-up is over
        status = "ok" if ready else ("starting" if alive else "dead")
        if ready and self.engine.stalled:  # NOTE: a step that does not end (a hung rank): send no work
            ready, status = False, "stalled"
        body = {
            "status": status,
            "running": snap.running,
            "waiting": snap.waiting,
            "prefill_backlog_tokens": snap.prefill_backlog_tokens,
            "kv_usage": round(snap.kv_usage, 6),
            "epoch": self.engine.publisher.epoch,
            "kv_event_seq": max(self.engine.publisher.last_seq, 0),  # NOTE: a router behind it re-syncs
            "model": self.engine.served_model_name,
            "models": self.engine.served_models(),  # NOTE: routers re-read /v1/models when this changes
            "kv_pages_total": snap.kv_pages_total,
            "kv_pages_free": snap.kv_pages_free,
            "kv_pages_cached": snap.kv_pages_cached,
            "kv_pages_active": snap.kv_pages_active,
        }
        if snap.host_pages_total:
            body["host_pages_total"] = snap.host_pages_total
            body["host_pages_cached"] = snap.host_pages_cached
        if self.engine.simulated:
            body["simulated"] = True
        return _json(body, 200 if ready else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def cache_info(self, request: Request) -> Response:
        e = self.engine
        body = {
            "block_size": e.page_size,
            "capacity_tokens": e.capacity_tokens,
            "host_capacity_tokens": e.cache.host.num_pages * e.page_size if e.cache.host else 0,
            "namespace": self.engine.served_model_name,
            "model": self.engine.served_model_name,
            "tokenizer": e.tokenizer.name,
            "epoch": e.publisher.epoch,
            "worker": e.publisher.worker,
            "hash_version": HASH_VERSION,
            "event_version": EVENT_VERSION,
            "redis_stream": e.publisher.stream if e.publisher.redis_url else None,
        }
        if e.simulated:
            body["simulated"] = True
        elif getattr(e.executor, "kv_pool", None) is not None:  # NOTE: what a cached token costs here
            body["kv_dtype"] = str(kv_layout(e)[3]).removeprefix("torch.")
            body["kv_bytes_per_token"] = kv_bytes_per_token(e)
            body |= weights_info(e.executor.model)  # type: ignore[attr-defined]
        return _json(body)

    def _not_admin(self, request: Request) -> Response | None:
        """401 when ``--admin-token`` is set and the request does not carry it."""
        if self.admin_token:
            bearer = bearer_token(request.headers.get("authorization"))
            header = request.headers.get("x-admin-token", "").encode()
            # NOTE: both compared (no short cut), in constant time: timing says nothing of the token
            ok = token_matches(bearer, self.admin_token) | token_matches(header, self.admin_token)
            if not ok:
                # NOTE: behind --api-key the Authorization header carries the API key: this one is the way
                return error_response(
                    401, "admin token required (Authorization: Bearer <token>, or X-Admin-Token: <token>)"
                )
        return None

    async def load_adapter(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"}: a PEFT LoRA directory served as
        model lora_name from now on (loaded off the engine thread, then added between steps)."""
        from worker.model.lora import add_adapter, load_adapter

        if (denied := self._not_admin(request)) is not None:
            return denied
        body = await _adapter_body(request, "lora_name", "lora_path")
        name, path = body["lora_name"], body["lora_path"]
        engine = self.engine
        if engine.simulated:
            raise APIError(400, "LoRA adapters need --engine model")
        if name in engine.served_models():
            raise APIError(400, f"model {name!r} is already served")
        model = engine.executor.model  # type: ignore[attr-defined]
        try:
            adapter = await run_in_threadpool(load_adapter, name, path, model)
            adapter_id = await engine.call(lambda: add_adapter(engine, adapter))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "engine_dead") from None
        return _json({"lora_name": name, "rank": adapter.rank, "adapter_id": adapter_id})

    async def unload_adapter(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter {"lora_name"}: stop serving it and free its weights; 409
        while requests of it are queued or running."""
        from worker.model.lora import AdapterBusyError, AdapterMissingError, remove_adapter

        if (denied := self._not_admin(request)) is not None:
            return denied
        name = (await _adapter_body(request, "lora_name"))["lora_name"]
        try:
            # NOTE: checked on the engine thread: another unload of it may be queued ahead
            freed = await self.engine.call(lambda: remove_adapter(self.engine, name))
        except AdapterBusyError as exc:
            raise APIError(409, str(exc), "adapter_in_use") from None
        except AdapterMissingError as exc:
            raise APIError(404, str(exc), "model_not_found") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "engine_dead") from None
        return _json({"lora_name": name, "unloaded": True, "freed_tokens": freed * self.engine.page_size})

    async def cache_flush(self, request: Request) -> Response:
        if (denied := self._not_admin(request)) is not None:
            return denied
        try:
            device, host = await self.engine.flush_cache()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "engine_dead") from None
        ps = self.engine.page_size
        # NOTE: flushed_pages / flushed_tokens stay the device pool's (as before the host tier existed)
        return _json({"flushed_pages": device, "flushed_tokens": device * ps,
                      "flushed_host_pages": host, "flushed_host_tokens": host * ps})  # fmt: skip

    async def cache_snapshot(self, request: Request) -> Response:
        try:
            data = await self.engine.snapshot_events()
        except EngineDeadError as exc:
            raise APIError(503, str(exc), "engine_dead") from None
        return Response(data, media_type="application/json")

    async def cache_events(self, request: Request) -> Response:
        publisher = self.engine.publisher
        sub = publisher.subscribe()

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b": kv events " + publisher.epoch.encode() + b"\n\n"
                while True:
                    try:
                        data = await asyncio.wait_for(sub.queue.get(), SSE_PING_S)
                    except asyncio.TimeoutError:
                        yield b": ping\n\n"
                        continue
                    if data is None:  # fell behind: end the stream; the client re-syncs
                        break
                    yield b"data: " + data + b"\n\n"
            finally:
                publisher.unsubscribe(sub)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )


async def _adapter_body(request: Request, *fields: str) -> dict:
    body = json_object(await read_bounded(request, 1 << 16))  # NOTE: names and a path: small
    if not all(isinstance(body.get(f), str) and body[f] for f in fields):
        raise APIError(
            400, f"the body must be a JSON object with non-empty string fields {', '.join(fields)}"
        )
    return body
