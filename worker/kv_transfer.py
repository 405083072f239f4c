"""Cached KV moved between workers: a worker about to compute a prompt whose prefix another worker
holds fetches that prefix's KV from it instead, so a request routed away from its prefix's holder
(for load) still skips that prefill.

A router sends the hint as the header ``x-radixgate-kv-source: <worker URL>`` (router
--kv-fetch-min-tokens). The receiving worker, before submitting the request, looks up how much of
the prompt it has cached itself; when less, it asks the source (``POST /v1/kv/export``: prompt ids,
the page-aligned position to start from, a token cap) for the KV of what the source holds beyond
that, on the device. The answer's body is that KV as raw bytes: one C-contiguous tensor [2 (K, V),
layers, tokens, KV heads, head dim] in the pool's dtype; its headers say what it is
(``x-radixgate-kv-start``, ``-block-size``, ``-shape``, ``-dtype``), so the receiver checks the layout
before reading the body, reads it into one buffer and views it as a tensor (no copies beyond the
socket's and the device's). The receiver writes it into
free pages of its pool and inserts them into its radix cache (which publishes their KV events, so
routers learn the new holder); the request then finds them as any cache hit. Export and import
run on each engine thread between steps; serialization and the HTTP exchange do not.

Nothing here can fail a request: an unreachable source, a miss, a timeout, a different model or
block size, or no free pages, and the request simply computes its prefill (each outcome counted in
``radixgate_worker_kv_fetch_total``). The KV must be what the receiver would compute: same model,
block size and dtype; anything else is refused. Base-model prompts only (not LoRA adapters).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from router.http_client import HTTPClient, HTTPClientError
from worker.api_params import APIError, json_object
from worker.engine_api import EngineDeadError
from worker.kv_pool import KVPool, slots_for

log = logging.getLogger("worker.kv_transfer")

EXPORT_PATH = "/v1/kv/export"


# ---------------------------------------------------------------------------- engine thread
def read_kv(pool: Any, slots: Any) -> Any:
    """K and V of pool ``slots`` (int64 tensor), every layer, in one C-contiguous CPU tensor
    [2, layers, n, heads, dim]: gathered on the pool's device, then copied to the host at once."""
    import torch

    device = pool.k_cache[0].device
    idx = slots.to(device)
    heads, dim = pool.k_cache[0].shape[1:]
    out = torch.empty(2, pool.num_layers, idx.numel(), heads, dim, dtype=pool.k_cache[0].dtype, device=device)
    for layer in range(pool.num_layers):
        torch.index_select(pool.k_cache[layer], 0, idx, out=out[0, layer])
        torch.index_select(pool.v_cache[layer], 0, idx, out=out[1, layer])
    return out.cpu()


def write_kv(pool: Any, slots: Any, kv: Any) -> None:
    """Write [2, layers, n, heads, dim] K and V into pool ``slots``."""
    device = pool.k_cache[0].device
    idx = slots.to(device)
    kv = kv.to(device)
    for layer in range(pool.num_layers):
        pool.k_cache[layer].index_copy_(0, idx, kv[0, layer])
        pool.v_cache[layer].index_copy_(0, idx, kv[1, layer])


def export_span(
    cache: Any, page_size: int, tokens: np.ndarray, start: int, max_tokens: int
) -> tuple[Any, int]:
    """The device pages of ``tokens``' cached prefix and the end of what an export from ``start``
    (page-aligned) sends: at most ``max_tokens`` (whole pages); end <= start when nothing."""
    match = cache.match_prefix(tokens)
    return match.pages, min(match.pages.size * page_size, start + max_tokens // page_size * page_size)


def export_kv(engine: Any, tokens: np.ndarray, start: int, max_tokens: int) -> Any | None:
    """K and V ([2, layers, n, heads, dim]) of the device-cached prefix of ``tokens`` from ``start`` (page-aligned), at most
    ``max_tokens`` of them (whole pages); None when this worker caches nothing beyond ``start``."""
    import torch

    pages, end = export_span(engine.cache, engine.page_size, tokens, start, max_tokens)
    if end <= start:
        return None
    return engine.executor.read_kv(torch.from_numpy(slots_for(pages, start, end, engine.page_size)))


def import_pages(
    cache: Any, allocator: Any, page_size: int, tokens: np.ndarray, start: int, end: int,
    write: Callable[[np.ndarray, int], None],
) -> int:  # fmt: skip
    """Cache ``tokens[start:end]`` (whole pages) behind the cached ``tokens[:start]``: free pages are
    taken (evicting LRU ones, never the prefix extended), ``write(pages, skip)`` fills them with the
    KV of ``tokens[start + skip:end]``, and they enter the radix cache. Returns the tokens newly
    cached (0 when this worker's own prefix left the device meanwhile, it already had them, or no
    pages could be freed)."""
    ps = page_size
    # NOTE: one extra token so that the match may cover all of [0, end) (it always leaves one out)
    match = cache.match_prefix(np.append(tokens[:end], 0).astype(np.int32))
    have = match.pages.size * ps  # on the device here; a host-tier part of it is imported over
    if have < start or have >= end:
        return 0
    need = (end - have) // ps
    cache.lock(match.last_node)  # NOTE: making room must not evict the prefix this run extends
    try:
        short = need - allocator.num_free
        if short > 0:
            cache.evict(short)
        pages = allocator.alloc(need)
    finally:
        cache.unlock(match.last_node)
    if pages is None:
        return 0
    write(pages, have - start)
    already = cache.insert(tokens[:end], np.concatenate([match.pages, pages]))
    duplicates = max(0, already - have) // ps
    if duplicates:
        allocator.free(pages[:duplicates])
    return end - max(have, already)


def import_kv(engine: Any, tokens: np.ndarray, start: int, kv: Any) -> int:
    """``import_pages`` of ``tokens[start:start + n]`` with the given K/V ([2, layers, n, heads, dim])."""
    import torch

    ps = engine.page_size

    def write(pages: np.ndarray, skip: int) -> None:
        slots = torch.from_numpy(slots_for(pages, 0, pages.size * ps, ps))
        engine.executor.write_kv(slots, kv[:, :, skip:])

    return import_pages(engine.cache, engine.allocator, ps, tokens, start, start + kv.shape[2], write)


# ---------------------------------------------------------------------------- wire format
_META = "x-radixgate-kv-"
_DTYPES = ("float32", "float16", "bfloat16")


def export_headers(kv: Any, start: int, block_size: int) -> dict[str, str]:
    """What an export's body is: its place in the prompt, page size, shape and dtype."""
    return {_META + "start": str(start), _META + "block-size": str(block_size),
            _META + "shape": ",".join(map(str, kv.shape)), _META + "dtype": str(kv.dtype).removeprefix("torch.")}  # fmt: skip


def body_view(kv: Any) -> memoryview:
    """The bytes of a C-contiguous tensor, without a copy."""
    import torch

    return memoryview(kv.view(-1).view(torch.uint8).numpy())


def read_headers(headers: Any) -> tuple[int, int, tuple[int, ...], Any]:
    """(start, block size, shape, torch dtype) an export's headers announce; ValueError otherwise."""
    import torch

    try:
        start, block = int(headers[_META + "start"]), int(headers[_META + "block-size"])
        shape = tuple(int(d) for d in headers[_META + "shape"].split(","))
        name = headers[_META + "dtype"]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not a KV export: {exc!r}") from None
    if name not in _DTYPES or len(shape) != 5 or min(shape) < 0:
        raise ValueError(f"not a KV export: shape {shape}, dtype {name!r}")
    return start, block, shape, getattr(torch, name)


# ---------------------------------------------------------------------------- HTTP
def kv_layout(engine: Any) -> tuple[int, int, int, Any]:
    """(layers, KV heads of every rank, head dim, dtype) of the engine's pool: a transfer's token."""
    pool = engine.executor.kv_pool
    heads, dim = pool.k_cache[0].shape[1:]
    return pool.num_layers, heads * engine.executor.tensor_parallel_size, dim, pool.k_cache[0].dtype


def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V one cached token holds, every layer and every rank's KV heads."""
    return KVPool.page_bytes(1, *kv_layout(engine))


class KVBusy(Exception):
    """A transfer that would take this worker (or the source) past its KV transfer memory bound."""


class _HeldResponse:
    """An export's answer: the KV bytes, and their share of the memory bound given back once they
    are sent (or the client is gone)."""

    def __init__(self, response: Any, release: Callable[[], None]) -> None:
        self.response, self.release = response, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


class KVTransfer:
    """The export endpoint and the fetch before a hinted request, for one engine. ``max_bytes``
    bounds the KV this worker holds in host memory for transfers at once, fetches and exports
    together, and so one transfer (0: both off); ``timeout_s`` bounds one fetch's HTTP exchange.
    ``link_ms_per_token`` > 0 (``--engine sim``) makes a fetch also wait that long per token it
    brings, for a link the loopback does not model."""

    def __init__(
        self, engine: Any, api_key: str | None = None, max_bytes: int = 1 << 30, timeout_s: float = 5.0,
        link_ms_per_token: float = 0.0,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.link_ms_per_token = link_ms_per_token
        self.api_key = api_key  # the fleet's worker key: what the source requires too
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._client: Any = None
        self.held = 0  # bytes of KV in host memory for transfers under way (event loop only)

    def _hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the bound; False (nothing counted) when they do not fit."""
        if self.held + nbytes > self.max_bytes:
            return False
        self.held += nbytes
        return True

    def _drop(self, nbytes: int) -> None:
        self.held -= nbytes

    @functools.cached_property
    def layout(self) -> tuple[int, int, int, Any]:
        """This pool's ``kv_layout`` (read on first use, once the executor holds its pool)."""
        return kv_layout(self.engine)

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of KV one page of this pool carries in a transfer."""
        return KVPool.page_bytes(self.engine.page_size, *self.layout)

    @functools.cached_property
    def max_tokens(self) -> int:
        """Whole pages of KV one transfer may carry (0: none)."""
        if self.max_bytes <= 0:
            return 0
        return self.max_bytes // self.page_bytes * self.engine.page_size

    @property
    def enabled(self) -> bool:
        """Fetches and exports are on: room for at least a page."""
        return self.max_tokens > 0

    async def export(self, request: Any) -> Any:
        """POST /v1/kv/export {"token_ids", "start", "max_tokens", "model"}: the KV this worker has
        cached for the prompt from ``start``; 404 ``kv_not_cached`` when it has none beyond it, 503
        ``kv_transfer_busy`` when the transfers under way leave no room for ``max_tokens`` of KV."""
        from starlette.responses import Response

        engine = self.engine
        if not self.enabled:
            raise APIError(409, "KV transfer is off here", "kv_transfer_unsupported")
        body = json_object(await request.body())
        ids, start = body.get("token_ids"), body.get("start", 0)
        cap = body.get("max_tokens", self.max_tokens)
        if body.get("model", engine.served_model_name) != engine.served_model_name:
            raise APIError(400, f"this worker serves {engine.served_model_name!r}, not {body.get('model')!r}")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**31 for t in ids):
            raise APIError(400, "'token_ids' must be a list of token ids")
        for name, value in (("start", start), ("max_tokens", cap)):
            if type(value) is not int or value < 0 or value % engine.page_size:
                raise APIError(400, f"'{name}' must be a non-negative multiple of {engine.page_size}")
        tokens = np.asarray(ids, dtype=np.int32)
        cap = min(cap, self.max_tokens)
        need = cap // engine.page_size * self.page_bytes
        if not self._hold(need):
            raise APIError(503, "KV transfers under way fill this worker's --kv-transfer-max-mib; try later",
                           "kv_transfer_busy")  # fmt: skip
        try:
            found = await engine.call(lambda: export_kv(engine, tokens, start, cap))
        except BaseException:
            self._drop(need)
            raise
        sent = 0 if found is None else found.numel() * found.element_size()
        self._drop(need - sent)  # NOTE: what it found; the rest of the bound is free again now
        if found is None:
            raise APIError(404, "no KV cached here beyond 'start' for this prompt", "kv_not_cached")
        engine.metrics.kv_exported_tokens.inc(found.shape[2])
        answer = Response(body_view(found), media_type="application/octet-stream",
                          headers=export_headers(found, start, engine.page_size))  # fmt: skip
        return _HeldResponse(answer, functools.partial(self._drop, sent))

    async def pull(self, source: str, ids: list[int]) -> str:
        """Fetch what ``source`` caches of prompt ``ids`` beyond this worker's own cached prefix and
        cache it here. Returns the outcome: ok, cached (nothing to fetch), miss, busy (this worker's
        or the source's transfers are at their memory bound), error."""
        engine = self.engine
        t0 = time.perf_counter()
        try:
            outcome = await self._pull(source, ids)
        except EngineDeadError:
            outcome = "error"  # NOTE: the submit that follows answers 503
        engine.metrics.kv_fetch.labels(outcome).inc()
        if outcome == "ok":
            engine.metrics.kv_fetch_seconds.observe(time.perf_counter() - t0)
        return outcome

    async def _pull(self, source: str, ids: list[int]) -> str:
        engine, ps = self.engine, self.engine.page_size
        tokens = np.asarray(ids, dtype=np.int32)
        have = await engine.call(lambda: engine.cache.cached_prefix_len(tokens))
        matchable = (tokens.size - 1) // ps * ps  # NOTE: a match always leaves a token to compute
        if matchable <= have:
            return "cached"
        cap = min(self.max_tokens, engine.capacity_tokens // 2 // ps * ps, matchable - have)  # NOTE: + room
        body = {"model": engine.served_model_name, "token_ids": ids, "start": have,
                "max_tokens": cap}  # fmt: skip
        try:
            async with asyncio.timeout(self.timeout_s):  # NOTE: the whole exchange, not each read
                kv = await self._fetch(source, body, have, cap)
        except KVBusy as exc:
            log.info("KV fetch from %s skipped: %s", source, exc)
            return "busy"
        except (HTTPClientError, TimeoutError, ValueError) as exc:
            log.warning("KV fetch from %s failed: %s", source, str(exc) or "timed out")
            return "error"
        if kv is None:
            return "miss"
        try:
            imported = await engine.call(lambda: import_kv(engine, tokens, have, kv))
        finally:
            self._drop(kv.numel() * kv.element_size())
        engine.metrics.kv_fetched_tokens.inc(imported)
        return "ok" if imported else "cached"

    async def _fetch(self, source: str, body: dict, have: int, cap: int) -> Any | None:
        """The export's KV, counted against this worker's memory bound (the caller gives it back);
        None when the source has nothing (404). KVBusy when the source answers 503 or the KV does
        not fit the bound now. ValueError on another answer, or when its headers announce another
        layout than this pool's or more than ``cap`` tokens (checked before the body is read) or
        the body is not what they announce."""
        import torch

        if self._client is None:
            t = self.timeout_s
            self._client = HTTPClient(connect_timeout=t, read_timeout=t, total_timeout=t)
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        resp = await self._client.post(source.rstrip("/"), EXPORT_PATH, orjson.dumps(body), headers)
        try:
            if resp.status == 404:
                return None
            if resp.status == 503:
                raise KVBusy(f"the source's transfers are at their bound: {(await resp.read())[:200]!r}")
            if resp.status != 200:
                raise ValueError(f"answered {resp.status}: {(await resp.read())[:200]!r}")
            start, block_size, shape, dtype = read_headers(resp.headers)
            self._check(start, block_size, shape, dtype, have, cap)
            size = int(np.prod(shape)) * dtype.itemsize
            if not self._hold(size):
                raise KVBusy(f"{size} bytes would pass --kv-transfer-max-mib with {self.held} under way")
            try:
                buf, pos = bytearray(size), 0
                async for chunk in resp.chunks():
                    if pos + len(chunk) > size:
                        raise ValueError(f"body longer than the {size} bytes announced")
                    buf[pos : pos + len(chunk)] = chunk
                    pos += len(chunk)
                if pos != size:
                    raise ValueError(f"body of {pos} bytes; {size} announced")
                if self.link_ms_per_token > 0:  # NOTE: --engine sim: the modelled link's time
                    await asyncio.sleep(shape[2] * self.link_ms_per_token / 1e3)
            except BaseException:
                self._drop(size)
                raise
        finally:
            resp.close()
        return torch.frombuffer(buf, dtype=dtype).view(shape)

    def _check(
        self, start: int, block_size: int, shape: tuple[int, ...], dtype: Any, have: int, cap: int
    ) -> None:
        """ValueError unless an export is this pool's layout from ``have``, whole pages, <= ``cap``."""
        kind, layers, n, heads, dim = shape
        own_layers, own_heads, own_dim, own_dtype = self.layout
        if block_size != self.engine.page_size or start != have:
            raise ValueError(f"export from {start} in blocks of {block_size}; asked from {have} in blocks "
                             f"of {self.engine.page_size}")  # fmt: skip
        if (kind, layers, heads, dim) != (2, own_layers, own_heads, own_dim):
            raise ValueError(f"KV shape {shape} is not this model's")
        if dtype != own_dtype or n % block_size or not 0 < n <= cap:
            raise ValueError(f"KV of {n} tokens in {dtype}; asked for <= {cap} in {own_dtype}")

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
