"""The fetch side of KV moved between workers: before a hinted request, ask the source worker for the
KV of what it caches beyond this worker's own prefix, write it into this pool a group of layers at a
time as it streams in, and cache it. worker/kv_transfer.py has the exchange's overview, the bounds
both sides share and the export side; worker/kv_pages.py the page side.

Nothing here can fail a request: every outcome (ok, cached, miss, busy, wasted, error, cut) is counted
and the request computes what was not fetched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from router.http_client import HTTPClient, HTTPClientError
from worker.engine_api import EngineDeadError
from worker.kv_pages import EXPORT_PATH, Pinned, import_begin, import_end, read_headers

if TYPE_CHECKING:
    from worker.kv_transfer import LinkRate

log = logging.getLogger("worker.kv_transfer")


def _finite(slabs: Any) -> bool:
    """No inf or NaN in received KV: a source's bytes cannot be checked against the prompt, but these no
    pool computes, and cached they would answer every later request of the prefix (tokens of no
    logprob) and be published to routers as this worker's."""
    import torch

    if slabs.element_size() == 1:  # NOTE: float8: isfinite has no CPU kernel for it
        slabs = slabs.float()
    return bool(torch.isfinite(slabs).all())


class KVBusy(Exception):
    """A transfer that would take this worker (or the source) past its KV transfer memory bound."""


class _Body:
    """An answer's body read in exact sizes, as it arrives."""

    def __init__(self, resp: Any, link: LinkRate) -> None:
        self._chunks = resp.chunks()
        self._rest = memoryview(b"")
        self.link = link  # its ``left`` goes down as the body is read
        self.taken = 0

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` (bytes) with the body's next ``len(out)`` bytes, as they arrive."""
        size, pos = len(out), 0
        while pos < size:
            if not self._rest:
                chunk = await anext(self._chunks, None)
                if chunk is None:
                    raise ValueError(f"body ended {size - pos} bytes short of what its headers announce")
                self._rest = memoryview(chunk)
            k = min(len(self._rest), size - pos)
            out[pos : pos + k] = self._rest[:k]
            self._rest, pos = self._rest[k:], pos + k
        self.link.left -= size
        self.taken += size

    async def end(self) -> None:
        if self._rest or await anext(self._chunks, None) is not None:
            raise ValueError("body longer than its headers announce")


class KVFetch:
    """KVTransfer's fetch half (worker/kv_transfer.py, which holds the state these methods share with
    the export side: the engine, the memory bound, the pool's layout, the link rates)."""

    # NOTE: KVTransfer's, declared here for the reader (and type checkers)
    engine: Any
    api_key: str | None
    timeout_s: float
    max_wait_s: float
    held: int
    link: LinkRate
    _client: Any
    layout: tuple[int, int, int, Any]
    slab_token_bytes: int
    max_tokens: int

    _hold: Callable[[int], bool]  # count bytes against the memory bound (False: they do not fit)
    _drop: Callable[[int], None]
    chunking: Callable[[int], tuple[int, int]]  # (slabs per group, host bytes) of an n-token transfer

    async def pull(self, source: str, prompts: Sequence[list[int]]) -> None:
        """Fetch what ``source`` caches of each of a request's ``prompts`` beyond this worker's own
        cached prefix and cache it here: one prompt after another, all of them within one
        ``timeout_s`` (each asks for what the link brings in half the time left). Once the source
        has failed one (error, busy) or the time is up, the rest are not asked: they compute. Cancelled
        (the client left: ``WorkerAPI.while_there``), the fetch under way stops and gives its pages back.

        A fetch's last write, which caches the pages, may still be queued on the engine when this
        returns: it runs before anything submitted after (engine calls and requests are handled in
        order), so the request finds the pages without waiting another step. Each prompt's outcome
        is counted once known (``radixgate_worker_kv_fetch_total``): ok, cached (nothing to fetch),
        miss, busy (either side at its memory or queueing bound), wasted (the KV came but this
        worker's prefix left its cache meanwhile or no pages could be freed), error, cut (cancelled)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s  # NOTE: the request's fetches, not each exchange
        for ids in prompts:
            if loop.time() >= deadline:
                log.info("KV fetch from %s: the request's --kv-fetch-timeout-s is spent", source)
                break
            if await self._pull_counted(source, ids, deadline) in ("error", "busy"):
                break  # NOTE: the next prompt would wait for the same failure

    async def _pull_counted(self, source: str, ids: list[int], deadline: float) -> str:
        """One prompt's fetch, its outcome counted once known; returns it ("ok" once the last write is
        queued, whatever that write then finds)."""
        t0 = time.perf_counter()
        try:
            outcome = await self._pull(source, ids, deadline)
        except EngineDeadError:
            outcome = "error"  # NOTE: the submit that follows answers 503
        except asyncio.CancelledError:
            log.info("KV fetches from %s stopped: the client left", source)
            self._counted("cut", 0, t0)
            raise
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
        # NOTE: two group buffers taken in turn: group i arrives while group i - 1 is written, and the
        # buffer of group i - 2 is free by then (its write was awaited before i - 1's was posted).
        # np.empty: never zero-filled, only ever overwritten by the body.
        ring = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        try:
            for k, lo in enumerate(range(0, total, group)):
                m = min(group, total - lo)
                size = m * n * self.slab_token_bytes
                if ring[k % 2].size < size:
                    ring[k % 2] = np.empty(size, np.uint8)
                buf = ring[k % 2][:size]
                async with asyncio.timeout_at(deadline):
                    await body.read_into(memoryview(buf))
                    if lo + m == total:
                        await body.end()
                if writing is not None and isinstance(done := await asyncio.wrap_future(writing), str):
                    return done
                slabs = torch.from_numpy(buf).view(dtype).view(m, n, heads, dim)
                if not await asyncio.to_thread(_finite, slabs):  # NOTE: off the loop (torch frees the GIL)
                    raise ValueError("the KV sent holds inf or NaN, which no pool computes")
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
