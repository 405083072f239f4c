"""Cached KV moved between workers over HTTP: a worker about to compute a prompt whose prefix another
worker holds fetches that prefix's KV from it instead, so a request routed away from its prefix's
holder (for load) still skips that prefill. The page side (pool slots pinned, taken, read and
written; the body's layout and headers) is worker/kv_pages.py; this module is the exchange.

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
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import orjson

from router.http_client import HTTPClient, HTTPClientError
from worker.api_params import APIError, json_object, read_bounded
from worker.engine_api import EngineDeadError
from worker.kv_pages import (
    Pinned,
    body_view,
    export_begin,
    export_headers,
    import_begin,
    import_end,
    kv_layout,
    read_headers,
    transfer_chunking,
)

log = logging.getLogger("worker.kv_transfer")

EXPORT_PATH = "/v1/kv/export"


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


class KVBusy(Exception):
    """A transfer that would take this worker (or the source) past its KV transfer memory bound."""


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


class _Body:
    """An answer's body read in exact sizes, as it arrives."""

    def __init__(self, resp: Any, link: LinkRate) -> None:
        self._chunks = resp.chunks()
        self._rest = memoryview(b"")
        self.link = link  # its ``left`` goes down as the body is read
        self.taken = 0

    async def read(self, size: int) -> bytearray:
        buf, pos = bytearray(size), 0
        while pos < size:
            if not self._rest:
                chunk = await anext(self._chunks, None)
                if chunk is None:
                    raise ValueError(f"body ended {size - pos} bytes short of what its headers announce")
                self._rest = memoryview(chunk)
            k = min(len(self._rest), size - pos)
            buf[pos : pos + k] = self._rest[:k]
            self._rest, pos = self._rest[k:], pos + k
        self.link.left -= size
        self.taken += size
        return buf

    async def end(self) -> None:
        if self._rest or await anext(self._chunks, None) is not None:
            raise ValueError("body longer than its headers announce")


class KVTransfer:
    """The export endpoint and the fetch before a hinted request, for one engine.

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
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**31 for t in ids):
            raise APIError(400, "'token_ids' must be a list of token ids")
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
        counted("ok").inc()
        engine.metrics.kv_exported_tokens.inc(n)
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
        all, counted in ``link_out`` (what is left while it is sent, its rate once it is)."""
        engine, total, link = self.engine, 2 * self.layout[0], self.link_out

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
        finally:
            link.left -= left
            if pending is not None:
                pending.cancel()  # NOTE: the client is gone; a read not begun is skipped

    async def pull(
        self, source: str, prompts: Sequence[list[int]], client_gone: Callable[[], Awaitable[bool]]
    ) -> bool:
        """Fetch what ``source`` caches of each of a request's ``prompts`` beyond this worker's own
        cached prefix and cache it here: one prompt after another, all of them within one
        ``timeout_s`` (each asks for what the link brings in half the time left). Once the source
        has failed one (error, busy) or the time is up, the rest are not asked: they compute. False
        when the client has left (asked before each prompt; the rest not asked).

        A fetch's last write, which caches the pages, may still be queued on the engine when this
        returns: it runs before anything submitted after (engine calls and requests are handled in
        order), so the request finds the pages without waiting another step. Each prompt's outcome
        is counted once known (``radixgate_worker_kv_fetch_total``): ok, cached (nothing to fetch),
        miss, busy (either side at its memory or queueing bound), wasted (the KV came but this
        worker's prefix left its cache meanwhile or no pages could be freed), error."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s  # NOTE: the request's fetches, not each exchange
        for ids in prompts:
            if await client_gone():
                log.info("KV fetches from %s stopped: the client left", source)
                return False
            if loop.time() >= deadline:
                log.info("KV fetch from %s: the request's --kv-fetch-timeout-s is spent", source)
                break
            if await self._pull_counted(source, ids, deadline) in ("error", "busy"):
                break  # NOTE: the next prompt would wait for the same failure
        return True

    async def _pull_counted(self, source: str, ids: list[int], deadline: float) -> str:
        """One prompt's fetch, its outcome counted once known; returns it ("ok" once the last write is
        queued, whatever that write then finds)."""
        t0 = time.perf_counter()
        try:
            outcome = await self._pull(source, ids, deadline)
        except EngineDeadError:
            outcome = "error"  # NOTE: the submit that follows answers 503
        except Exception:  # NOTE: a bug or a device error here must not fail the request: it computes
            log.exception("KV fetch from %s failed", source)
            outcome = "error"
        if isinstance(outcome, str):
            self._counted(outcome, 0, t0)
            return outcome
        # NOTE: the last write's future: counted on the engine thread when it has run
        outcome.add_done_callback(functools.partial(self._finished, source, t0))
        return "ok"

    def _finished(self, source: str, t0: float, fut: Any) -> None:
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                log.error("KV fetch from %s failed", source, exc_info=fut.exception())
            self._counted("error", 0, t0)
        elif isinstance(got := fut.result(), str):  # NOTE: a transfer of one group found no use here
            self._counted(got, 0, t0)
        else:
            self._counted("ok" if got else "cached", got, t0)

    def _counted(self, outcome: str, fetched: int, t0: float) -> None:
        metrics = self.engine.metrics
        metrics.kv_fetch.labels(outcome).inc()
        if fetched:
            metrics.kv_fetched_tokens.inc(fetched)
        if outcome == "ok":
            metrics.kv_fetch_seconds.observe(time.perf_counter() - t0)

    def timely_tokens(self, seconds: float | None = None) -> int:
        """The most a fetch asks for: what it can bring in half ``seconds`` (default: its timeout) at
        the rate fetches have come (``LinkRate``)."""
        return self.link.timely(
            self.timeout_s if seconds is None else seconds,
            2 * self.layout[0] * self.slab_token_bytes,
            self.engine.page_size,
        )

    async def _pull(self, source: str, ids: list[int], deadline: float) -> str | Any:
        """The outcome, or the future of the last write (tokens it newly cached, or the outcome when
        the transfer was of no use here)."""
        engine, ps = self.engine, self.engine.page_size
        tokens = np.asarray(ids, dtype=np.int32)
        have = await engine.call(lambda: engine.cache.cached_prefix_len(tokens))  # NOTE: both tiers
        matchable = (tokens.size - 1) // ps * ps  # NOTE: a match always leaves a token to compute
        if matchable <= have:
            return "cached"
        if self.max_wait_s and (wait := self.link.backlog_s()) > self.max_wait_s:
            log.info(
                "KV fetch from %s skipped: fetches under way would hold it up ~%.0f ms", source, wait * 1e3
            )
            return "busy"
        timely = self.timely_tokens(deadline - asyncio.get_running_loop().time())
        cap = min(self.max_tokens, engine.capacity_tokens // 2 // ps * ps, matchable - have, timely)
        # NOTE: the source needs the prompt only as far as it may send (and one token the match leaves)
        body = {"model": engine.served_model_name, "token_ids": ids[: have + cap + 1], "start": have,
                "max_tokens": cap}  # fmt: skip
        try:
            got = await self._fetch(source, body, tokens, have, cap, deadline)
        except KVBusy as exc:
            log.info("KV fetch from %s skipped: %s", source, exc)
            return "busy"
        except (HTTPClientError, TimeoutError, ValueError) as exc:
            log.warning("KV fetch from %s failed: %s", source, str(exc) or "timed out")
            return "error"
        return "miss" if got is None else got

    async def _fetch(
        self, source: str, body: dict, tokens: np.ndarray, have: int, cap: int, deadline: float
    ) -> Any:
        """The future of the last write (the tokens it newly caches), or the outcome when the
        transfer ended before it (of no use here: ``import_begin``); None when the source has
        nothing (404). KVBusy when the source answers 503 or the transfer does not fit the bound now.
        ValueError on another answer, or when its headers announce another layout than this pool's
        or more than ``cap`` tokens (checked before the body is read) or the body is not what they
        announce."""
        if self._client is None:
            t = self.timeout_s
            self._client = HTTPClient(connect_timeout=t, read_timeout=t, total_timeout=t)
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        t0 = asyncio.get_running_loop().time()
        async with asyncio.timeout_at(deadline):
            resp = await self._client.post(source.rstrip("/"), EXPORT_PATH, orjson.dumps(body), headers)
        try:
            if resp.status != 200:
                async with asyncio.timeout_at(deadline):
                    said = (await resp.read())[:200]
                if resp.status == 404:
                    return None
                if resp.status == 503:
                    raise KVBusy(f"the source's transfers are at their bound: {said!r}")
                raise ValueError(f"answered {resp.status}: {said!r}")
            start, block_size, shape, dtype = read_headers(resp.headers)
            self._check(start, block_size, shape, dtype, have, cap)
            group, held = self.chunking(shape[2])
            if not self._hold(held):
                raise KVBusy(f"{held} bytes would pass --kv-transfer-max-mib with {self.held} under way")
            size = int(np.prod(shape)) * dtype.itemsize
            body = _Body(resp, self.link)
            self.link.left += size
            got: Any = None
            try:
                got = await self._receive(body, tokens, have, shape, dtype, group, deadline)
            finally:
                self.link.left -= size - body.taken
                if not isinstance(got, concurrent.futures.Future):
                    self._drop(held)
                else:  # NOTE: the last group's bytes are held until the engine has written them
                    loop = asyncio.get_running_loop()
                    got.add_done_callback(lambda _: loop.call_soon_threadsafe(self._drop, held))
            if resp.at_end:  # NOTE: the whole body came (not cut short: nothing left to import)
                self.link.seen(size, asyncio.get_running_loop().time() - t0)
            return got
        finally:
            resp.close()

    async def _receive(
        self, body: _Body, tokens: np.ndarray, start: int, shape: tuple[int, ...], dtype: Any, group: int,
        deadline: float,
    ) -> Any:  # fmt: skip
        """Write each group of slabs into pool pages as it arrives (while the next arrives), then
        cache them. The first group's call also takes the pages (``import_begin``) and the last's
        caches them (``import_end``), so a transfer of one group costs the engine one call. Returns
        the last call's future (the tokens it newly caches, or ``import_begin``'s outcome), posted
        and not awaited, or that outcome when the transfer ended before its last group."""
        import torch

        engine, ps = self.engine, self.engine.page_size
        cache, alloc = engine.cache, engine.allocator
        _, layers, n, heads, dim = shape
        end, total = start + n, 2 * layers
        taken: dict[str, Pinned] = {}  # NOTE: engine thread only: import_begin's pages until cached

        def give_back() -> None:
            if (pin := taken.pop("pin", None)) is not None:
                import_end(cache, alloc, ps, tokens, end, pin, False)

        def write(slabs: Any, lo: int) -> int | str:
            try:
                if lo == 0:
                    begun = import_begin(cache, alloc, ps, tokens, start, end)
                    if isinstance(begun, str):
                        return begun  # NOTE: computed here meanwhile, the prefix gone, or no room
                    taken["pin"] = begun
                pin = taken["pin"]
                engine.executor.write_kv(pin.slots, slabs[:, pin.have - start :], lo)
                if lo + slabs.shape[0] < total:
                    return -1  # more to come
                del taken["pin"]
                return import_end(cache, alloc, ps, tokens, end, pin, True)
            except BaseException:
                give_back()
                raise

        writing, last = None, None
        try:
            for lo in range(0, total, group):
                m = min(group, total - lo)
                async with asyncio.timeout_at(deadline):
                    buf = await body.read(m * n * self.slab_token_bytes)
                    if lo + m == total:
                        await body.end()
                if writing is not None and isinstance(done := await asyncio.wrap_future(writing), str):
                    return done
                slabs = torch.frombuffer(buf, dtype=dtype).view(m, n, heads, dim)
                writing = engine.post(functools.partial(write, slabs, lo))
            last = writing
            return last
        finally:
            if last is None:  # NOTE: cut off: give the pages back after every write posted
                if writing is not None:
                    writing.cancel()  # NOTE: a write not begun is skipped
                with contextlib.suppress(EngineDeadError):
                    engine.post(give_back)

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
