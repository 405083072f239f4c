"""Cached KV moved between workers: a worker about to compute a prompt whose prefix another worker
holds fetches that prefix's KV from it instead, so a request routed away from its prefix's holder
(for load) still skips that prefill.

A router sends the hint as the header ``x-radixgate-kv-source: <worker URL>`` (router
--kv-fetch-min-tokens). The receiving worker, before submitting the request, looks up how much of
the prompt it has cached itself; when less, it asks the source (``POST /v1/kv/export``: prompt ids,
the page-aligned position to start from, a token cap) for the KV of what the source holds beyond
that, on the device. The answer is a safetensors body: ``k`` and ``v`` [layers, tokens, KV heads,
head dim] in the pool's dtype, metadata ``start`` and ``block_size``. The receiver writes it into
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
import logging
import time
from typing import Any

import numpy as np

from worker.api_params import APIError, json_object
from worker.engine_api import EngineDeadError
from worker.kv_pool import slots_for

log = logging.getLogger("worker.kv_transfer")

EXPORT_PATH = "/v1/kv/export"


# ---------------------------------------------------------------------------- engine thread
def read_kv(pool: Any, slots: Any) -> tuple[Any, Any]:
    """K and V of pool ``slots`` (int64 tensor), every layer, on the CPU: [layers, n, heads, dim]."""
    import torch

    idx = slots.to(pool.k_cache[0].device)
    k = torch.stack([c.index_select(0, idx) for c in pool.k_cache]).cpu()
    v = torch.stack([c.index_select(0, idx) for c in pool.v_cache]).cpu()
    return k, v


def write_kv(pool: Any, slots: Any, k: Any, v: Any) -> None:
    """Write [layers, n, heads, dim] K and V into pool ``slots``."""
    device = pool.k_cache[0].device
    idx = slots.to(device)
    for layer in range(pool.num_layers):
        pool.k_cache[layer].index_copy_(0, idx, k[layer].to(device))
        pool.v_cache[layer].index_copy_(0, idx, v[layer].to(device))


def export_kv(engine: Any, tokens: np.ndarray, start: int, max_tokens: int) -> tuple[Any, Any] | None:
    """K and V of the device-cached prefix of ``tokens`` from ``start`` (page-aligned), at most
    ``max_tokens`` of them (whole pages); None when this worker caches nothing beyond ``start``."""
    import torch

    ps = engine.page_size
    match = engine.cache.match_prefix(tokens)
    end = min(match.pages.size * ps, start + max_tokens // ps * ps)
    if end <= start:
        return None
    slots = torch.from_numpy(slots_for(match.pages, start, end, ps))
    return engine.executor.read_kv(slots)


def import_kv(engine: Any, tokens: np.ndarray, start: int, k: Any, v: Any) -> int:
    """Cache ``tokens[start:start + n]`` with the given K/V (n = k.shape[1], whole pages) behind
    the cached ``tokens[:start]``; returns the tokens newly cached (0 when this worker's own prefix
    left the device meanwhile, it already had them, or no pages could be freed)."""
    import torch

    cache, ps = engine.cache, engine.page_size
    end = start + k.shape[1]
    # NOTE: one extra token so that the match may cover all of [0, end) (it always leaves one out)
    match = cache.match_prefix(np.append(tokens[:end], 0).astype(np.int32))
    have = match.pages.size * ps  # on the device here; a host-tier part of it is imported over
    if have < start or have >= end:
        return 0
    need = (end - have) // ps
    cache.lock(match.last_node)  # NOTE: making room must not evict the prefix this run extends
    try:
        short = need - engine.allocator.num_free
        if short > 0:
            cache.evict(short)
        pages = engine.allocator.alloc(need)
    finally:
        cache.unlock(match.last_node)
    if pages is None:
        return 0
    slots = torch.from_numpy(slots_for(pages, 0, need * ps, ps))
    engine.executor.write_kv(slots, k[:, have - start :], v[:, have - start :])
    already = cache.insert(tokens[:end], np.concatenate([match.pages, pages]))
    duplicates = max(0, already - have) // ps
    if duplicates:
        engine.allocator.free(pages[:duplicates])
    return end - max(have, already)


# ---------------------------------------------------------------------------- wire format
def encode(k: Any, v: Any, start: int, block_size: int) -> bytes:
    from safetensors.torch import save

    return save(
        {"k": k.contiguous(), "v": v.contiguous()}, {"start": str(start), "block_size": str(block_size)}
    )


def decode(body: bytes) -> tuple[int, int, Any, Any]:
    """(start, block_size, k, v) of an export; ValueError when it is not one."""
    import json

    from safetensors.torch import load

    try:
        tensors = load(body)
        header_len = int.from_bytes(body[:8], "little")
        meta = json.loads(body[8 : 8 + header_len]).get("__metadata__") or {}
        return int(meta["start"]), int(meta["block_size"]), tensors["k"], tensors["v"]
    except Exception as exc:  # NOTE: safetensors raises its own error types for damaged input
        raise ValueError(f"not a KV export: {exc}") from None


# ---------------------------------------------------------------------------- HTTP
def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K and V one cached token holds, every layer and every rank's KV heads."""
    pool = engine.executor.kv_pool
    heads, dim = pool.k_cache[0].shape[1:]
    per_layer = heads * engine.executor.tensor_parallel_size * dim * pool.k_cache[0].element_size()
    return 2 * pool.num_layers * per_layer


class KVTransfer:
    """The export endpoint and the fetch before a hinted request, for one engine. ``max_bytes``
    bounds one transfer either way (0: both off); ``timeout_s`` bounds one fetch's HTTP exchange."""

    def __init__(
        self, engine: Any, api_key: str | None = None, max_bytes: int = 1 << 30, timeout_s: float = 5.0
    ) -> None:
        self.engine = engine
        self.api_key = api_key  # the fleet's worker key: what the source requires too
        # NOTE: whole pages; 0 (off) when not even one page fits
        per_page = 0 if engine.simulated else kv_bytes_per_token(engine) * engine.page_size
        self.max_tokens = max_bytes // per_page * engine.page_size if per_page else 0
        self.enabled = self.max_tokens > 0
        self.timeout_s = timeout_s
        self._client: Any = None

    async def export(self, request: Any) -> Any:
        """POST /v1/kv/export {"token_ids", "start", "max_tokens", "model"}: the KV this worker has
        cached for the prompt from ``start``; 404 ``kv_not_cached`` when it has none beyond it."""
        from starlette.concurrency import run_in_threadpool
        from starlette.responses import Response

        engine = self.engine
        if not self.enabled:
            why = "a simulated worker holds no KV" if engine.simulated else "KV transfer is off here"
            raise APIError(409, why, "kv_transfer_unsupported")
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
        found = await engine.call(lambda: export_kv(engine, tokens, start, cap))
        if found is None:
            raise APIError(404, "no KV cached here beyond 'start' for this prompt", "kv_not_cached")
        k, v = found
        engine.metrics.kv_exported_tokens.inc(k.shape[1])
        payload = await run_in_threadpool(encode, k, v, start, engine.page_size)
        return Response(payload, media_type="application/octet-stream")

    async def pull(self, source: str, ids: list[int]) -> str:
        """Fetch what ``source`` caches of prompt ``ids`` beyond this worker's own cached prefix and
        cache it here. Returns the outcome: ok, cached (nothing to fetch), miss, error."""
        engine = self.engine
        t0 = time.perf_counter()
        try:
            outcome = await self._pull(source, np.asarray(ids, dtype=np.int32))
        except EngineDeadError:
            outcome = "error"  # NOTE: the submit that follows answers 503
        engine.metrics.kv_fetch.labels(outcome).inc()
        if outcome == "ok":
            engine.metrics.kv_fetch_seconds.observe(time.perf_counter() - t0)
        return outcome

    async def _pull(self, source: str, tokens: np.ndarray) -> str:
        import httpx

        engine, ps = self.engine, self.engine.page_size
        have = await engine.call(lambda: engine.cache.cached_prefix_len(tokens))
        matchable = (tokens.size - 1) // ps * ps  # NOTE: a match always leaves a token to compute
        if matchable <= have:
            return "cached"
        cap = min(self.max_tokens, engine.capacity_tokens // 2 // ps * ps, matchable - have)  # NOTE: + room
        body = {"model": engine.served_model_name, "token_ids": tokens.tolist(), "start": have,
                "max_tokens": cap}  # fmt: skip
        try:
            async with asyncio.timeout(self.timeout_s):  # NOTE: the whole exchange, not each read
                payload = await self._fetch(source, body, cap)
            if payload is None:
                return "miss"
            start, block_size, k, v = decode(payload)
            self._check(start, block_size, have, cap, k, v)
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.warning("KV fetch from %s failed: %s", source, str(exc) or "timed out")
            return "error"
        imported = await engine.call(lambda: import_kv(engine, tokens, start, k, v))
        engine.metrics.kv_fetched_tokens.inc(imported)
        return "ok" if imported else "cached"

    async def _fetch(self, source: str, body: dict, cap: int) -> bytes | None:
        """The export's body; None when the source has nothing (404). ValueError on another answer
        or a body larger than ``cap`` tokens of KV can be."""
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limit = cap * kv_bytes_per_token(self.engine) + (1 << 16)  # NOTE: + the safetensors header
        async with self._client.stream(
            "POST", source.rstrip("/") + EXPORT_PATH, json=body, headers=headers
        ) as resp:
            if resp.status_code == 404:
                return None
            if resp.status_code != 200:
                raise ValueError(f"answered {resp.status_code}: {(await resp.aread())[:200]!r}")
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise ValueError(f"answer larger than {limit} bytes")
        return b"".join(chunks)

    def _check(self, start: int, block_size: int, have: int, cap: int, k: Any, v: Any) -> None:
        """ValueError unless the export is this pool's layout from ``have``, whole pages, <= ``cap``."""
        pool = self.engine.executor.kv_pool
        layers, _, heads, dim = k.shape if k.dim() == 4 else (0, 0, 0, 0)
        heads_here = pool.k_cache[0].shape[1] * self.engine.executor.tensor_parallel_size
        if block_size != self.engine.page_size or start != have or k.shape != v.shape:
            raise ValueError(f"export from {start} in blocks of {block_size}; asked from {have} in blocks "
                             f"of {self.engine.page_size}")  # fmt: skip
        if (layers, heads, dim) != (pool.num_layers, heads_here, pool.k_cache[0].shape[2]):
            raise ValueError(f"KV shape {tuple(k.shape)} is not this model's")
        if k.dtype != pool.k_cache[0].dtype or k.shape[1] % block_size or not 0 < k.shape[1] <= cap:
            raise ValueError(f"KV of {k.shape[1]} tokens in {k.dtype}; this pool is {pool.k_cache[0].dtype}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
