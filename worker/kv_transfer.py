"""Cached KV moved between workers over HTTP: a worker about to compute a prompt whose prefix another
worker holds fetches that prefix's KV from it instead, so a request routed away from its prefix's
holder (for load) still skips that prefill. The page side (pool slots pinned, taken, read and
written; the body's layout and headers) is worker/kv_pages.py; this module is the exchange: the
bounds both sides share and the export side, the fetch side being worker/kv_fetch.py.

A router sends the hint as the header ``x-radixgate-kv-source: <worker URL>`` (router
--kv-fetch-min-tokens). The receiving worker, before submitting the request, looks up how much of
the prompt it has cached itself (both tiers); when less, it asks the source (``POST /v1/kv/export``:
prompt ids, the page-aligned position to start from, a token cap) for the KV of what the source
holds beyond that, in either tier (a host-tier part is loaded back to the device first, as for a
local hit: routers see one cache). The answer's body is that KV as raw bytes, its headers saying
what it is, so the receiver checks the layout before reading the body. The transfer streams, a
group of layers at a time: the source pins the pages and reads each group from its pool between its
engine's steps while the one before is sent; the receiver takes free pages of its pool once the
headers arrive, writes each group into them as its bytes arrive, and then inserts them into its
radix cache (which publishes their KV events, so routers learn the new holder); the request then
finds them as any cache hit. Neither side holds more than two groups in host memory, whatever the
prompt's length. Pool reads and writes run on each engine thread between steps; serialization and
the HTTP exchange do not.

A request's prompts are fetched one after another within one timeout; once the source fails one, the
rest are not asked. Nothing here can fail a request: an unreachable source, a miss, a timeout, a
different model or block size, or no free pages, and the request simply computes its prefill (each
outcome counted in ``radixgate_worker_kv_fetch_total``). The KV must be what the receiver would
compute: same model, block size and dtype; anything else is refused. Base-model prompts only (not
LoRA adapters).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from worker.api_params import APIError, json_object, read_bounded
from worker.engine_api import EngineDeadError
from worker.kv_fetch import KVFetch
from worker.kv_pages import (
    Pinned,
    body_view,
    export_begin,
    export_headers,
    kv_layout,
    transfer_chunking,
)

log = logging.getLogger("worker.kv_transfer")


class LinkRate:
    """The rate transfers one way have gone at (recent ones weigh most, large ones by their size);
    what a fetch can bring in half its timeout at that rate (a long prefix on a slow link fetches
    what it can and computes the rest instead of timing out); and how long the transfers under way
    (``left`` of their amount) hold up a new one."""

    def __init__(self) -> None:
        self.amount = self.seconds = 0.0
        self.left = 0.0  # what the transfers under way have still to move

    def seen(self, amount: float, seconds: float) -> None:
        self.amount, self.seconds = self.amount * 0.9 + amount, self.seconds * 0.9 + seconds

    def backlog_s(self) -> float:
        """Seconds the transfers under way take yet at this rate (0 until one has been seen)."""
        return self.left * self.seconds / self.amount if self.amount > 0 else 0.0

    def timely(self, timeout_s: float, per_token: float, page_size: int) -> int:
        """Whole pages of tokens (``per_token`` of the amount each) that come in ``timeout_s / 2``;
        unbounded until a fetch has been seen."""
        if self.seconds <= 0:
            return 1 << 62
        return max(
            page_size, int(self.amount / self.seconds * timeout_s / 2 / per_token) // page_size * page_size
        )


class _HeldResponse:
    """An export's answer, and what it holds (its pinned pages, its share of the memory bound)
    given back once it is sent (or the client is gone)."""

    def __init__(self, response: Any, release: Callable[[], None]) -> None:
        self.response, self.release = response, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


class KVTransfer(KVFetch):
    """The export endpoint and the fetch before a hinted request (its methods: KVFetch,
    worker/kv_fetch.py), for one engine.

    A transfer streams: the source reads a group of slabs (worker/kv_pages.py) from its pool at a
    time, between its engine's steps, and sends each while it reads the next; the receiver takes the
    pool pages it needs with the first group and writes each group as its bytes arrive, while the
    next arrives. ``max_bytes`` bounds the KV this worker holds in host memory for transfers at
    once, fetches and exports together: each holds two groups (a group is at most 1/16 of the bound,
    or one slab where a slab is larger), so one transfer carries at most ``max_bytes / 2`` per slab
    (0: transfers off). ``timeout_s`` bounds a request's fetches, all its prompts' together.
    ``link_ms_per_token`` > 0 (``--engine sim``) makes an export take that long per token it sends,
    for a link the loopback does not model. A transfer that would wait more than ``max_wait_s``
    behind those under way the same way (``LinkRate.backlog_s``) is refused: an export answers 503,
    a fetch is not asked for (both ``busy``)."""

    def __init__(
        self, engine: Any, api_key: str | None = None, max_bytes: int = 1 << 30, timeout_s: float = 5.0,
        link_ms_per_token: float = 0.0, max_wait_s: float = 0.2,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.max_wait_s = max_wait_s  # a transfer queued behind more than this is refused (0: never)
        self.link_ms_per_token = link_ms_per_token
        self.api_key = api_key  # the fleet's worker key: what the source requires too
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._client: Any = None
        self.held = 0  # bytes of KV in host memory for transfers under way (event loop only)
        self.peak_held = 0  # the most ``held`` has been (benchmarks reset it)
        self.link = LinkRate()  # fetches, in bytes
        self.link_out = LinkRate()  # exports, in bytes
        engine.metrics.kv_transfer_held.set_function(lambda: self.held)

    def _hold(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the bound; False (nothing counted) when they do not fit."""
        if self.held + nbytes > self.max_bytes:
            return False
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)
        return True

    def _drop(self, nbytes: int) -> None:
        self.held -= nbytes

    @functools.cached_property
    def layout(self) -> tuple[int, int, int, Any]:
        """This pool's ``kv_layout`` (read on first use, once the executor holds its pool)."""
        return kv_layout(self.engine)

    @functools.cached_property
    def slab_token_bytes(self) -> int:
        """Bytes of one token in one slab: K or V of one layer, every KV head."""
        _, heads, dim, dtype = self.layout
        return heads * dim * dtype.itemsize

    def chunking(self, n: int) -> tuple[int, int]:
        """(slabs a group of an ``n``-token transfer carries, host bytes the transfer holds)."""
        return transfer_chunking(n * self.slab_token_bytes, 2 * self.layout[0], self.max_bytes)

    @functools.cached_property
    def max_tokens(self) -> int:
        """Whole pages of KV one transfer may carry (0: none)."""
        ps = self.engine.page_size
        return max(0, self.max_bytes) // (2 * self.slab_token_bytes) // ps * ps

    @property
    def enabled(self) -> bool:
        """Fetches and exports are on: room for at least a page."""
        return self.max_tokens > 0

    async def _pinned(self, begin: Callable[[], Any], undo: Callable[[Any], Any]) -> Any:
        """``begin()``'s result, run on the engine thread. Should this task be cancelled first, what
        it pinned is given back with ``undo`` once it has run."""
        fut = self.engine.post(begin)
        try:
            return await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:

            def orphan(f: Any) -> None:
                if not f.cancelled() and f.exception() is None and f.result() is not None:
                    undo(f.result())

            fut.add_done_callback(orphan)
            raise

    def _unpin(self, pin: Pinned) -> None:
        """Unlock an export's pages, after every read queued before (engine calls run in order)."""
        with contextlib.suppress(EngineDeadError):
            self.engine.post(lambda: self.engine.cache.unlock(pin.node))

    async def export(self, request: Any) -> Any:
        """POST /v1/kv/export {"token_ids", "start", "max_tokens", "model"}: the KV this worker has
        cached for the prompt from ``start``, streamed; 404 ``kv_not_cached`` when it has none beyond
        it, 503 ``kv_transfer_busy`` when the transfers under way leave no room for this one."""
        from starlette.responses import StreamingResponse

        engine = self.engine
        if not self.enabled:
            raise APIError(409, "KV transfer is off here", "kv_transfer_unsupported")
        body = json_object(await read_bounded(request, self.max_export_body))  # NOTE: 413 past it
        ids, start = body.get("token_ids"), body.get("start", 0)
        cap = body.get("max_tokens", self.max_tokens)
        if body.get("model", engine.served_model_name) != engine.served_model_name:
            raise APIError(400, f"this worker serves {engine.served_model_name!r}, not {body.get('model')!r}")
        vocab = engine.vocab_size  # NOTE: past it: adapters' and salts' prefix keys, not exported
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
            raise APIError(400, f"'token_ids' must be a list of token ids in [0, {vocab})")
        for name, value in (("start", start), ("max_tokens", cap)):
            if type(value) is not int or value < 0 or value % engine.page_size:
                raise APIError(400, f"'{name}' must be a non-negative multiple of {engine.page_size}")
        tokens = np.asarray(ids, dtype=np.int32)
        cap = min(cap, self.max_tokens, tokens.size // engine.page_size * engine.page_size)
        counted = engine.metrics.kv_export.labels
        if self.max_wait_s and (wait := self.link_out.backlog_s()) > self.max_wait_s:
            counted("busy").inc()
            raise APIError(503, f"KV exports under way would hold this one up ~{wait * 1e3:.0f} ms "
                           "(--kv-transfer-max-wait-ms); try later", "kv_transfer_busy")  # fmt: skip
        busy = APIError(503, "KV transfers under way fill this worker's --kv-transfer-max-mib; try later",
                        "kv_transfer_busy")  # fmt: skip
        held = self.chunking(cap)[1]  # NOTE: what it may hold; made exact once it knows what it sends
        if not self._hold(held):
            counted("busy").inc()
            raise busy
        try:
            first = await self._pinned(
                lambda: self._export_first(tokens, start, cap), lambda f: self._unpin(f[0])
            )
        except BaseException:
            self._drop(held)
            raise
        if first is None:
            self._drop(held)
            counted("not_cached").inc()
            raise APIError(404, "no KV cached here beyond 'start' for this prompt", "kv_not_cached")
        pin, group, kv = first
        n = pin.slots.numel()
        exact = self.chunking(n)[1]
        self._drop(held)
        if not self._hold(exact):
            self._unpin(pin)
            counted("busy").inc()
            raise busy
        layers, heads, dim, dtype = self.layout
        headers = export_headers((2, layers, n, heads, dim), dtype, start, engine.page_size)
        size = n * 2 * layers * self.slab_token_bytes
        answer = StreamingResponse(self._export_body(pin.slots, group, kv, size), headers=headers,
                                   media_type="application/octet-stream")  # fmt: skip

        def release() -> None:
            self._unpin(pin)
            self._drop(exact)

        return _HeldResponse(answer, release)

    @functools.cached_property
    def max_export_body(self) -> int:
        """Bytes an export's body may have (counted as they arrive: a chunked body announces no
        length): the token ids of this worker's whole context (11 bytes each at most, as JSON, and a
        separator) and 64 KiB for the rest."""
        return (64 << 10) + 12 * self.engine.max_total_tokens

    def _export_first(self, tokens: np.ndarray, start: int, cap: int) -> tuple[Pinned, int, Any] | None:
        """(On the engine thread.) ``export_begin``, and the transfer's first group of slabs read,
        with the group's size: one call, so a transfer of one group costs the engine one."""
        pin = export_begin(self.engine, tokens, start, cap)
        if pin is None:
            return None
        group = self.chunking(pin.slots.numel())[0]
        try:
            return pin, group, self.engine.executor.read_kv(pin.slots, 0, min(group, 2 * self.layout[0]))
        except BaseException:
            self.engine.cache.unlock(pin.node)
            raise

    async def _export_body(self, slots: Any, group: int, kv: Any, size: int) -> Any:
        """The slabs of pool ``slots``, a group at a time from the first (``kv``, already read):
        each next read between the engine's steps while the one before is sent; ``size`` bytes in
        all, counted in ``link_out`` (what is left while it is sent, its rate once it is). The export
        is counted once its outcome is known: ok (and its tokens exported) once the last bytes are
        sent, cut when the receiver left before."""
        engine, total, link = self.engine, 2 * self.layout[0], self.link_out
        metrics, sent = engine.metrics, False

        def read(lo: int) -> Any:
            return asyncio.wrap_future(
                engine.post(lambda: engine.executor.read_kv(slots, lo, min(lo + group, total)))
            )

        def send_time(kv: Any) -> Any:  # NOTE: --engine sim: the modelled link's time for a group
            return asyncio.sleep(kv.shape[1] * self.link_ms_per_token * kv.shape[0] / total / 1e3)

        pending, left, t0 = None, size, asyncio.get_running_loop().time()
        link.left += left
        try:
            for lo in range(group, total, group):
                pending = read(lo)
                await send_time(kv)
                yield body_view(kv)
                link.left -= kv.nbytes
                left -= kv.nbytes
                kv = await pending
            await send_time(kv)
            yield body_view(kv)  # NOTE: resumed once it is sent
            link.seen(size, asyncio.get_running_loop().time() - t0)
            sent = True
            metrics.kv_export.labels("ok").inc()
            metrics.kv_exported_tokens.inc(slots.numel())
        finally:
            if not sent:
                metrics.kv_export.labels("cut").inc()
            link.left -= left
            if pending is not None:
                pending.cancel()  # NOTE: the client is gone; a read not begun is skipped
