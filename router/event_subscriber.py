"""KV events from workers into the prefix index: Redis Streams, or each worker's HTTP event stream.

Every router replica reads every event (no consumer groups). Per worker it tracks (epoch, seq); on
subscribe, on a gap and on a new epoch it re-syncs from the worker's snapshot, so a router that
joins mid-stream still learns what was cached before it joined. Malformed batches are dropped (and
logged); they never stop the subscriber. On a worker's own HTTP stream one re-syncs that worker; on a
Redis stream its worker cannot be told, so the gap its loss leaves (or, at the stream's end, the seq
the worker's health reports) re-syncs it. A re-sync runs beside the readers, one at a
time per worker, holding that worker's batches meanwhile: a worker whose snapshot is slow delays
only its own events, never those of the workers sharing its stream. Batches of a worker's earlier
life (an epoch before the one its last snapshot read), read late, are dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from router.http_client import worker_base_url
from router.kv_events import EventFormatError, KVEventBatch, decode
from router.request_parsing import PARSE_INLINE_BYTES
from router.workers import Worker

if TYPE_CHECKING:
    from router.gateway import Router

log = logging.getLogger("radixgate.router.events")

STREAM_PREFIX = "radixgate:kv:"  # + model name: one Redis Stream per model
_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
_SNAPSHOT_SLICE = 128  # stored runs of a snapshot read or applied between two yields to the event loop
_READ_SLICE = 32  # Redis entries handled between two yields
_HELD_BATCHES = 4096  # batches of one worker held while its re-sync runs; past it they are dropped
# NOTE: a worker whose batches stop arriving (Redis down, a worker publishing nowhere) is re-synced
# from the seq its health reports; each such re-sync with no batch applied since the last doubles
# the wait before the next, from 2 s to 30 s: every health interval, each router would pull every
# worker's whole snapshot (for as long as Redis is down), and each worker would write one for each
_LOST_RESYNC_S = (2.0, 30.0)
_PAST_EPOCHS = 8  # a worker's earlier lives remembered: their batches, read late, are dropped


def reconnect_delay(attempt: int) -> float:
    """Seconds to wait before reconnecting after ``attempt`` failures in a row (0, 1, ...)."""
    return _BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)]


@dataclass
class _Cursor:
    epoch: str | None = None
    seq: int = -1


class EventSubscriber:
    def __init__(self, router: Router, mode: str, redis_url: str | None) -> None:
        self._router = router
        if mode == "auto":
            mode = "redis" if redis_url else "http"
        self.mode = mode
        self._redis_url = redis_url
        self._cursors: dict[str, _Cursor] = {}
        self._tasks: dict[str, asyncio.Task] = {}  # worker url (http) or stream key (redis) -> reader
        self._resyncs: set[asyncio.Task] = set()
        # worker url -> (the worker whose re-sync runs, its batches that arrive meanwhile)
        self._held: dict[str, tuple[Worker, list[KVEventBatch]]] = {}
        # worker url -> (epoch, seq) its last /health told, and the seq applied here then
        self._reported: dict[str, tuple[str, int, int | None]] = {}
        self._silent: set[str] = set()  # workers warned about: none of their batches came from Redis
        self._first: dict[str, asyncio.Event] = {}  # worker url -> set once its first sync attempt ended
        self._syncing: Counter[str] = Counter()  # worker url -> its snapshot re-syncs under way
        # worker url -> (when the next re-sync for batches lost may start, the wait before it)
        self._lost_wait: dict[str, tuple[float, float]] = {}
        self._streaming: set[str] = set()  # http: workers whose event stream is open
        # worker url -> the epoch of its last snapshot read, and the epochs before it (lives that ended)
        self._epoch: dict[str, str] = {}
        self._past: dict[str, deque[str]] = {}
        self._redis = None
        self._applying = asyncio.Lock()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self.mode == "off":
            return
        registry = self._router.workers
        registry.on_added.append(self._watch)
        registry.on_removed.append(self._unwatch)
        if self.mode == "redis":
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(self._redis_url, socket_timeout=10, socket_connect_timeout=2)
        for worker in registry:
            self._watch(worker)

    async def stop(self) -> None:
        tasks = list(self._tasks.values()) + list(self._resyncs)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._redis is not None:
            await self._redis.aclose()

    async def first_sync(self, workers: list[Worker], timeout_s: float) -> list[str]:
        """Wait until the first snapshot of each of ``workers`` is in the index, or its first attempt
        failed (no snapshot, no event stream), for at most ``timeout_s``; returns the URLs still
        waiting then. A router that serves before that routes blind to the caches its workers
        already hold."""
        waits = {w.url: self._first[w.url] for w in workers if w.url in self._first}
        tasks = [asyncio.create_task(event.wait()) for event in waits.values() if not event.is_set()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout_s)
            for task in late:
                task.cancel()
        return [url for url, event in waits.items() if not event.is_set()]

    def synced(self, worker: Worker) -> bool:
        """Whether the index follows ``worker``'s cache: a snapshot of it was read, and its events
        name the router's blocks (``matches``)."""
        cursor = self._cursors.get(worker.url)
        return cursor is not None and cursor.epoch is not None and self.matches(worker)

    def matches(self, worker: Worker) -> bool:
        """Whether ``worker``'s KV events name the blocks the router hashes: it counts tokens as the
        router does and cuts them into blocks of the router's size. The block hashes of a worker that
        counts otherwise (another model's tokenizer, another block size) never match a prompt's."""
        router = self._router
        return worker.counts_like(router.tokenizer.name) and worker.block_size == router.block_size

    def _unmatched(self, worker: Worker) -> bool:
        """Known not to match (its cache info read): its stored and removed blocks are not applied,
        so the index keeps the router's own predictions for it, as for a worker without events.
        NOTE: a worker whose cache info is not read yet (just added) is applied meanwhile"""
        return worker.cache_info is not None and not self.matches(worker)

    def _first_attempt_ended(self, worker: Worker) -> None:
        event = self._first.get(worker.url)
        if event is not None:
            event.set()

    def _watch(self, worker: Worker) -> None:
        self._first.setdefault(worker.url, asyncio.Event())
        if self.mode == "http":
            if worker.url not in self._tasks:
                self._tasks[worker.url] = asyncio.get_running_loop().create_task(self._http_reader(worker))
        elif self.mode == "redis":
            self._ensure_redis_readers()
            self.resync_soon(worker)

    def models_learned(self, worker: Worker) -> None:
        """The health checker learned what ``worker`` serves. In Redis mode its models' streams are
        read from now on and, if the worker was never synced (it was down when watched), its
        snapshot is read now: a worker that starts after the router is followed like any other."""
        if self._redis is None:
            return  # not started (start() watches every worker) or not Redis mode
        self._ensure_redis_readers()
        if worker.url not in self._cursors:
            self.resync_soon(worker)

    def reported_seq(self, worker: Worker, epoch: str, seq: int) -> None:
        """A health report of ``worker``: the seq of the last batch it published. A batch that
        never reaches this router (trimmed off a Redis Stream read too slowly, dropped by the worker
        while Redis was down) shows as a gap only when the worker publishes again, and an idle
        worker may not. So a cursor behind the seq reported one health check before, that has not
        moved since (a whole interval for the batch to arrive; a reader that lags but applies
        batches is not stuck), means a lost batch: re-sync. In Redis mode, a worker without a
        cursor (its last re-sync failed) is re-synced again."""
        cursor = self._cursors.get(worker.url)
        before = self._reported.get(worker.url)
        self._reported[worker.url] = (epoch, seq, None if cursor is None else cursor.seq)
        if self.mode == "redis" and cursor is None and worker.models and not self._holding(worker):
            # NOTE: its last re-sync failed (a snapshot late behind a long step): try again, once a
            # health check, for a worker whose batches do not reach Redis has nothing else to ask
            self.resync_soon(worker)
            return
        if self.mode == "off" or before is None or cursor is None or self._holding(worker):
            return
        told_epoch, told_seq, applied_then = before
        if cursor.epoch is not None and told_epoch == epoch != cursor.epoch:
            # NOTE: a snapshot of its last life, read before it restarted, was applied after its health
            # told the new epoch (restarted() waited for it); an idle new life shows no gap. Two
            # reports in a row, so a check answered just before the restart does not count
            self.restarted(worker, epoch)
            return
        if told_epoch == epoch == cursor.epoch and cursor.seq < told_seq and cursor.seq == applied_then:
            now = time.monotonic()
            not_before, wait = self._lost_wait.get(worker.url, (0.0, 0.0))
            if now < not_before:
                return  # NOTE: re-synced for lost batches a moment ago, and none arrived since
            wait = min(_LOST_RESYNC_S[1], max(_LOST_RESYNC_S[0], 2 * wait))
            self._lost_wait[worker.url] = (now + wait, wait)
            log.info("%s: KV event batches up to seq %d never arrived (the last applied is %d): re-syncing",
                     worker.url, told_seq, cursor.seq)  # fmt: skip
            if self.mode == "redis" and worker.stats.kv_event_batches == 0 and worker.url not in self._silent:
                self._silent.add(worker.url)  # NOTE: once: it is followed by snapshots meanwhile
                log.warning("%s publishes KV events, but none has arrived from Redis: is it started with the "
                            "router's --redis-url? Following it by snapshots meanwhile", worker.url)  # fmt: skip
            self.resync_soon(worker)

    def _unwatch(self, worker: Worker) -> None:
        self._first_attempt_ended(worker)  # NOTE: nobody waits for a worker that is gone
        self._first.pop(worker.url, None)
        self._cursors.pop(worker.url, None)
        self._reported.pop(worker.url, None)
        self._lost_wait.pop(worker.url, None)
        self._epoch.pop(worker.url, None)
        self._past.pop(worker.url, None)
        self._silent.discard(worker.url)  # NOTE: a worker added again at this URL is warned about afresh
        task = self._tasks.pop(worker.url, None)
        if task is not None:
            task.cancel()
        if self._redis is not None:  # NOTE: the last worker of a model: its stream's reader stops
            self._ensure_redis_readers()
        if self._holding(worker):  # NOTE: its re-sync ends unapplied; the URL's next worker starts afresh
            del self._held[worker.url]

    def _held_of(self, worker: Worker) -> list[KVEventBatch] | None:
        """The batches a re-sync of this very worker (not an earlier one at its URL) holds; None
        when none runs."""
        entry = self._held.get(worker.url)
        return entry[1] if entry is not None and entry[0] is worker else None

    def _holding(self, worker: Worker) -> bool:
        return self._held_of(worker) is not None

    # ---------------------------------------------------------------- applying
    def _worker_for(self, name: str) -> Worker | None:
        """Map a batch's ``worker`` field (the worker's advertised URL) to a registered worker."""
        worker = self._router.workers.get(name)  # NOTE: the spelling registered: no parse on every batch
        if worker is None:
            with contextlib.suppress(ValueError):  # NOTE: not a URL (a worker may advertise any name): below
                worker = self._router.workers.get(worker_base_url(name))
        if worker is not None:
            return worker
        for w in self._router.workers:
            if w.cache_info is not None and w.cache_info.get("worker") == name:
                return w
        return None

    def apply(self, worker: Worker, batch: KVEventBatch) -> bool:
        """Apply one batch in order. Returns False (and applies nothing) on a gap or new epoch."""
        cursor = self._cursors.setdefault(worker.url, _Cursor())
        if batch.epoch == cursor.epoch and batch.seq <= cursor.seq:
            return True  # already covered by the snapshot we synced from
        if batch.epoch != cursor.epoch and batch.epoch in self._past.get(worker.url, ()):
            # NOTE: a life that ended (a snapshot of a later one was read): its batches, read late (Redis
            # back, a router paused), say nothing of the cache; each re-synced all over again
            return True
        if batch.epoch != cursor.epoch or batch.seq != cursor.seq + 1:
            return False
        self._apply_batch(worker, batch)
        cursor.seq = batch.seq
        if self._lost_wait:  # NOTE: its batches arrive again: a later loss is re-synced at once
            self._lost_wait.pop(worker.url, None)
        self._router.metrics.event_lag.observe(max(0.0, time.time() - batch.ts))
        return True

    def _apply_batch(self, worker: Worker, batch: KVEventBatch) -> None:
        if self._unmatched(worker):  # NOTE: a cleared cache is one whatever the hashes: its predictions go
            self._router.index.apply_events(worker.url, (), (), batch.cleared)
        else:
            self._router.index.apply_events(worker.url, batch.stored, batch.removed, batch.cleared)
        worker.stats.kv_event_batches += 1

    def restarted(self, worker: Worker, epoch: str) -> None:
        """A health check found ``worker`` restarted (a new ``epoch``): what the index holds of its
        old cache is gone. Re-synced once, whichever notices first: nothing to do where a snapshot
        of the new life was read or is being read; in http mode, a stream not open yet re-syncs
        when it opens (a restart closes it)."""
        cursor = self._cursors.get(worker.url)
        if (cursor is not None and cursor.epoch == epoch) or self._syncing[worker.url]:
            return  # NOTE: clearing now would also cut a snapshot being applied short
        self._router.index.clear_worker(worker.url)
        self._cursors.pop(worker.url, None)
        if self.mode != "http" or worker.url in self._streaming:
            self.resync_soon(worker)

    def rehash(self) -> None:
        """The router's block size changed: what the index holds of each worker is hashed in blocks of
        the old size, never matched again. It goes; each watched worker whose events name the router's
        blocks now is re-synced from its snapshot (in http mode once its stream is open, as after a
        restart), so what it holds is predicted again without waiting for its next batch."""
        for worker in list(self._router.workers):
            if self._syncing[worker.url]:
                continue  # NOTE: its snapshot, being applied, is read under the new size's rule
            self._router.index.clear_worker(worker.url)
            self._cursors.pop(worker.url, None)
            watched = worker.url in self._first and (self.mode != "http" or worker.url in self._streaming)
            if watched and self.matches(worker):
                self.resync_soon(worker)

    async def resync(self, worker: Worker) -> bool:
        """Replace what the index holds for ``worker`` by the worker's snapshot."""
        self._syncing[worker.url] += 1
        try:
            return await self._resync(worker)
        finally:
            self._syncing[worker.url] -= 1
            if not self._syncing[worker.url]:
                del self._syncing[worker.url]
            if worker in self._router.workers:  # NOTE: not a later worker at its URL
                self._first_attempt_ended(worker)

    async def _resync(self, worker: Worker) -> bool:
        session = self._router.upstream.session
        assert session is not None
        try:
            async with session.get(
                worker.url + "/v1/cache/snapshot", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    return False
                raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.info("snapshot of %s unavailable: %r", worker.url, exc)
            return False
        # NOTE: one snapshot decoded and applied at a time: many at once (a Redis stream readable again
        # re-syncs every worker) would each take a slice per loop turn, and requests wait behind them all
        async with self._applying:
            return await self._apply_snapshot(worker, raw)

    async def _apply_snapshot(self, worker: Worker, raw: bytes) -> bool:
        try:  # NOTE: a large snapshot is decoded in a thread: ~100 ms of the loop for 20k blocks
            snapshot = decode(raw) if len(raw) <= PARSE_INLINE_BYTES else await asyncio.to_thread(decode, raw)
        except EventFormatError as exc:
            log.info("snapshot of %s unavailable: %r", worker.url, exc)
            return False
        if worker not in self._router.workers:
            return False
        # NOTE: a snapshot is applied a slice of runs at a time, yielding between slices, so a large one
        # does not stall routing (the worker's batches are held meanwhile, as during the fetch). By
        # difference: what it still names stays (and matches throughout), the rest goes in one step
        # NOTE: the snapshot of a worker the index cannot match leaves its predictions as they are
        runs = (
            ()
            if self._unmatched(worker)
            else self._router.index.resync_steps(worker.url, snapshot.stored, _SNAPSHOT_SLICE)
        )
        for _ in runs:
            await asyncio.sleep(0)
            if worker not in self._router.workers:
                return False  # NOTE: removed meanwhile: its index entries are gone, keep it so
        self._cursors[worker.url] = _Cursor(snapshot.epoch, snapshot.seq)
        before = self._epoch.get(worker.url)
        if before is not None and before != snapshot.epoch:
            self._past.setdefault(worker.url, deque(maxlen=_PAST_EPOCHS)).append(before)
        self._epoch[worker.url] = snapshot.epoch
        worker.stats.kv_resyncs += 1
        log.info(
            "re-synced %s from its snapshot (epoch %s, seq %d)", worker.url, snapshot.epoch, snapshot.seq
        )
        return True

    def resync_soon(self, worker: Worker) -> None:
        """Re-sync ``worker`` in the background (unless it is already), holding its batches that
        arrive meanwhile, then applying those the snapshot does not cover."""
        if self.mode == "off" or self._holding(worker) or worker not in self._router.workers:
            return  # NOTE: one at a time; none for a worker removed (its URL may be another's now)
        self._cursors.pop(worker.url, None)
        self._held[worker.url] = (worker, [])
        task = asyncio.get_running_loop().create_task(self._resync_and_replay(worker))
        self._resyncs.add(task)
        task.add_done_callback(self._resyncs.discard)

    async def _resync_and_replay(self, worker: Worker) -> None:
        try:
            synced = await self.resync(worker)
        finally:
            held = self._held_of(worker)
            if held is not None:
                del self._held[worker.url]
        if not synced:
            return  # NOTE: the worker's next batch asks again (a gap: no cursor)
        for batch in held or ():
            if not self.apply(worker, batch):  # a batch was lost meanwhile: once more
                self.resync_soon(worker)
                return

    async def _handle(self, raw: bytes, expected: Worker | None = None) -> None:
        try:
            batch = decode(raw)
        except EventFormatError as exc:
            log.warning("dropping malformed KV event batch: %s", exc)
            if expected is not None:
                self.resync_soon(expected)
            return
        worker = expected or self._worker_for(batch.worker)
        if worker is None:
            return  # a worker this router does not route to
        held = self._held_of(worker)
        if held is not None:  # NOTE: its re-sync runs: applied after it, if the snapshot lacks it
            if len(held) < _HELD_BATCHES:
                held.append(batch)
            elif len(held) == _HELD_BATCHES:  # NOTE: the replay will find a gap and re-sync again
                held.append(batch)
                log.warning("%s: %d KV event batches held during its re-sync; dropping more", worker.url,
                            _HELD_BATCHES)  # fmt: skip
            return
        if not self.apply(worker, batch):
            self.resync_soon(worker)
            if (held := self._held_of(worker)) is not None:  # NOTE: not for a worker removed meanwhile
                held.append(batch)

    # ---------------------------------------------------------------- transports
    async def _http_reader(self, worker: Worker) -> None:
        """Follow GET /v1/cache/events (SSE); after (re)connecting, sync from the snapshot."""
        attempt = 0
        session = self._router.upstream.session
        assert session is not None
        while worker in self._router.workers:
            try:
                silence = self._router.config.event_stream_timeout_s
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=2, sock_read=silence)
                async with session.get(worker.url + "/v1/cache/events", timeout=timeout) as resp:
                    if resp.status == 404:
                        log.info("%s has no KV event stream: routing on predictions only", worker.url)
                        self._first_attempt_ended(worker)
                        return
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                    attempt = 0
                    self._cursors.pop(worker.url, None)
                    self._streaming.add(worker.url)
                    await self.resync(worker)  # after subscribing, so nothing falls between
                    # NOTE: not `async for line in resp.content`: aiohttp caps a line at 128 KiB and
                    # one batch for a long prompt (its token ids) can be larger.
                    # NOTE: a line longer than a chunk is gathered in a list, not by re-copying (and
                    # re-splitting) the growing buffer at every chunk: linear, not quadratic, in its length
                    parts: list[bytes] = []
                    async for chunk in resp.content.iter_any():
                        parts.append(chunk)
                        if b"\n" not in chunk:
                            continue
                        *lines, rest = b"".join(parts).split(b"\n")
                        parts = [rest] if rest else []
                        for line in lines:
                            if line.startswith(b"data:"):
                                await self._handle(line[5:].strip(), worker)
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.debug("event stream of %s interrupted: %r", worker.url, exc)
            except Exception:  # a bug must not end the subscription for good
                log.exception("event stream of %s failed", worker.url)
            finally:
                self._streaming.discard(worker.url)
            self._first_attempt_ended(worker)  # NOTE: a stream that could not be read: none to wait for
            await asyncio.sleep(reconnect_delay(attempt))
            attempt += 1

    def _ensure_redis_readers(self) -> None:
        """One reader per base model some worker serves, and none for another name: a worker publishes
        to its served model's stream (its LoRA adapters' events too), so there is nothing else to read.
        None before the health checker learns a model; a model no worker serves any more (its last
        worker removed, or restarted serving another) has its reader stopped."""
        streams = {STREAM_PREFIX + model for model in self._router.workers.base_models()}
        for key in [k for k in self._tasks if k.startswith(STREAM_PREFIX) and k not in streams]:
            self._tasks.pop(key).cancel()
        for key in streams - self._tasks.keys():
            self._tasks[key] = asyncio.get_running_loop().create_task(self._redis_reader(key))

    async def _redis_reader(self, key: str) -> None:
        """Read one model's stream from its current end; every worker was re-synced on watch, and
        its workers are re-synced again after the stream could not be read: a Redis that restarted
        (or failed over) lost the entries it held, and a worker that publishes nothing more would
        show no gap."""
        import redis.exceptions

        assert self._redis is not None
        model = key[len(STREAM_PREFIX) :]
        last_id = "$"
        attempt = 0
        while True:
            try:
                if attempt:
                    await self._redis.ping()  # NOTE: not the blocking read: re-sync as soon as it is back
                    log.info("redis stream %s readable again: re-syncing its workers", key)
                    for worker in list(self._router.workers):
                        if model in worker.models:
                            self.resync_soon(worker)
                    attempt = 0
                if last_id == "$":
                    newest = await self._redis.xrevrange(key, count=1)
                    last_id = newest[0][0] if newest else "0-0"
                reply = await self._redis.xread({key: last_id}, block=5000, count=256)
                for _stream, entries in reply or []:
                    for i, (entry_id, fields) in enumerate(entries):
                        last_id = entry_id
                        raw = fields.get(b"batch")
                        if raw is not None:
                            await self._handle(raw)
                        if i % _READ_SLICE == _READ_SLICE - 1:
                            await asyncio.sleep(0)  # NOTE: 256 entries at once would stall routing
            except asyncio.CancelledError:
                raise
            except (redis.exceptions.RedisError, OSError) as exc:
                if attempt == 5 or attempt % 50 == 0:  # NOTE: 1st, 6th, every 50th: a try every 5 s
                    log.warning("redis stream %s: %r", key, exc)
                await asyncio.sleep(reconnect_delay(attempt))
                attempt += 1
            except Exception:  # NOTE: a bug must not end the model's stream for good
                log.exception("redis stream %s failed", key)
                await asyncio.sleep(reconnect_delay(attempt))
                attempt += 1
