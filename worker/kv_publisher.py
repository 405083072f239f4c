"""KV event publisher: turns radix-cache events into numbered batches (contract 3) and hands them to a
Redis Stream and to in-process SSE subscribers. It never blocks the engine: every queue is bounded,
and a batch that cannot be delivered is dropped and counted (consumers re-sync on the seq gap)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from router.kv_events import KVEventBatch, StoredBlocks, encode

log = logging.getLogger("worker.kv_publisher")

STREAM_PREFIX = "radixgate:kv:"


def stream_name(served_model_name: str) -> str:
    """The Redis Stream that carries one model's KV events (every router replica reads all of it)."""
    return STREAM_PREFIX + served_model_name


class Subscriber:
    """One SSE client: a bounded queue of encoded batches; ``None`` ends the stream (dropped)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=maxsize)
        self.dropped = False

    def _offer(self, data: bytes) -> bool:
        """Runs on the subscriber's loop. False when it fell behind and was cut off."""
        if self.dropped:
            return False
        try:
            self.queue.put_nowait(data)
            return True
        except asyncio.QueueFull:
            self.end()  # NOTE: the client reconnects and re-syncs from the snapshot
            return False

    def end(self) -> None:
        """Runs on the subscriber's loop: end the stream after nothing more (what is queued is dropped)."""
        self.dropped = True
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class KVPublisher:
    """Numbers batches (``epoch`` per start, ``seq`` +1 per batch) and fans them out.

    ``publish`` is called on the engine thread only; ``subscribe`` on an event loop.
    """

    def __init__(
        self,
        worker: str,
        block_size: int,
        redis_url: str | None = None,
        stream: str = STREAM_PREFIX + "default",
        stream_maxlen: int = 100_000,  # entries kept in the Redis Stream (approximate trim)
        redis_queue_size: int = 1024,  # batches waiting for Redis before the oldest are dropped
        subscriber_queue_size: int = 1024,  # batches buffered per SSE client before it is cut off
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex
        self.last_seq = -1  # seq of the last published batch
        self.redis_url = redis_url
        self.stream = stream
        self.stream_maxlen = stream_maxlen
        self.subscriber_queue_size = subscriber_queue_size
        self._clock = clock
        self._subscribers: set[Subscriber] = set()
        self._streams_ended = False  # the server is stopping: every SSE stream ends, new ones at once
        self._lock = threading.Lock()
        self._redis_queue: queue.Queue[bytes | None] = queue.Queue(maxsize=redis_queue_size)
        self._redis_thread: threading.Thread | None = None
        self.stats = {"published": 0, "redis_sent": 0, "redis_dropped": 0, "subscribers_dropped": 0}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.redis_url and self._redis_thread is None:
            self._redis_thread = threading.Thread(target=self._redis_loop, name="kv-redis", daemon=True)
            self._redis_thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the Redis thread after it sends what is queued (up to ``timeout`` s)."""
        if self._redis_thread is not None:
            with contextlib.suppress(queue.Full):
                self._redis_queue.put(None, timeout=timeout)
            self._redis_thread.join(timeout)
            self._redis_thread = None

    # ------------------------------------------------------------------ publishing (engine thread)
    def _queue_for_redis(self, data: bytes) -> None:
        """Queue a batch for the Redis thread; full (Redis hangs), the oldest queued one is dropped
        for it: consumers re-sync at the gap, and the newest change still reaches them."""
        while True:
            try:
                self._redis_queue.put_nowait(data)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._redis_queue.get_nowait()
                    self.stats["redis_dropped"] += 1

    def publish(
        self, stored: list[StoredBlocks], removed: list[int], cleared: bool, force: bool = False
    ) -> KVEventBatch | None:
        """Number and send one batch; empty batches are skipped unless ``force``."""
        if not (stored or removed or cleared or force):
            return None
        self.last_seq += 1
        batch = KVEventBatch(
            worker=self.worker,
            epoch=self.epoch,
            seq=self.last_seq,
            ts=self._clock(),
            block_size=self.block_size,
            stored=stored,
            removed=removed,
            cleared=cleared,
        )
        data = encode(batch)
        self.stats["published"] += 1
        if self.redis_url:
            self._queue_for_redis(data)
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            try:
                sub.loop.call_soon_threadsafe(self._deliver, sub, data)
            except RuntimeError:  # its loop is closed
                self.unsubscribe(sub)
        return batch

    def snapshot_batch(self, stored: list[StoredBlocks]) -> bytes:
        """The whole cache as one batch: cleared=true, seq = the last published seq, so a consumer
        applies it and then every batch with a larger seq (call on the engine thread, after
        publishing pending events)."""
        batch = KVEventBatch(
            worker=self.worker,
            epoch=self.epoch,
            seq=max(self.last_seq, 0),
            ts=self._clock(),
            block_size=self.block_size,
            stored=stored,
            removed=[],
            cleared=True,
        )
        return encode(batch)

    def _deliver(self, sub: Subscriber, data: bytes) -> None:
        if not sub._offer(data) and sub in self._subscribers:
            self.stats["subscribers_dropped"] += 1
            self.unsubscribe(sub)

    # ------------------------------------------------------------------ SSE subscribers (event loop)
    def subscribe(self) -> Subscriber:
        sub = Subscriber(asyncio.get_running_loop(), self.subscriber_queue_size)
        with self._lock:
            if not self._streams_ended:
                self._subscribers.add(sub)
                return sub
        sub.end()
        return sub

    def end_streams(self) -> None:
        """End every SSE stream, and any opened later at once: the server is stopping. A stream never
        ends by itself, so its graceful shutdown (requests in flight finish) would otherwise wait out
        its whole timeout whenever a router listens."""
        with self._lock:
            self._streams_ended = True
            subscribers = list(self._subscribers)
            self._subscribers.clear()
        for sub in subscribers:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing to end
                sub.loop.call_soon_threadsafe(sub.end)

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            self._subscribers.discard(sub)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ------------------------------------------------------------------ Redis (own thread)
    def _redis_loop(self) -> None:
        import redis

        client = None
        pending: bytes | None = None  # the newest batch not sent yet: Redis refused it, or the backoff
        retry_at = 0.0  # monotonic s: after a failure, only the newest batch is kept until then
        failures = 0
        while True:
            try:
                wait = None if pending is None else max(0.0, retry_at - time.monotonic())
                data = self._redis_queue.get(timeout=wait)
                if data is None:
                    break
                if pending is not None:
                    self.stats["redis_dropped"] += 1  # NOTE: consumers re-sync on the seq gap
                pending = data
            except queue.Empty:
                pass  # NOTE: the backoff is over and nothing newer came: send the kept batch, so
                # consumers learn of the gap (or get the change) without waiting for the next one
            if time.monotonic() < retry_at:
                continue
            try:
                if client is None:
                    client = redis.Redis.from_url(
                        self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
                    )
                client.xadd(self.stream, {"batch": pending}, maxlen=self.stream_maxlen, approximate=True)
                self.stats["redis_sent"] += 1
                pending = None
                failures = 0
            except (redis.RedisError, OSError, ValueError) as exc:  # ValueError: a URL redis cannot read
                failures += 1
                backoff = min(5.0, 0.2 * 2 ** min(failures, 5))
                retry_at = time.monotonic() + backoff
                if failures == 1 or failures % 50 == 0:
                    log.warning("KV events: Redis publish failed (%s); retrying the newest batch in %.1fs, "
                                "dropping older ones", exc, backoff)  # fmt: skip
                try:
                    if client is not None:
                        client.close()
                except Exception:
                    pass
                client = None
        if pending is not None:
            self.stats["redis_dropped"] += 1
        if client is not None:
            client.close()
