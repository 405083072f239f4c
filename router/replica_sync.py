"""Replica sync: router replicas tell each other, over Redis pub/sub, how many requests and how many
pending prefill tokens each has on each worker, so a replica's load counts the others' work live.

Without it a replica learns the others' traffic only from the workers' health reports, up to a
health interval old. A miss's prefill lasts tens of milliseconds, so two replicas routing misses in
the same second often pick the same worker. In the fleet simulator, announcements heard within 1 ms
gave 2 and 4 replicas the tail latency of one router (docs/benchmarks/routing.md).

Wire format, one JSON object per message on channel ``radixgate:router-load`` (no persistence:
a message missed is corrected by the next one):

    {"replica": "3f2a9c01d4e7", "full": false, "workers": {"http://w1:8001": [2, 1450], ...}}

``workers`` maps a worker URL to the sender's absolute [in-flight requests, pending prefill tokens]
there. A replica publishes the workers whose counts changed, coalesced per event-loop turn, and every
``heartbeat_s`` all its workers with ``full: true`` (a worker not listed in a full message is 0).
A replica not heard from for ``expire_s`` is forgotten: its counts leave every worker's load.
Workers are matched by URL, so replicas must be given the same worker URLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import orjson

from router.workers import Worker, WorkerRegistry

log = logging.getLogger("radixgate.router.replica_sync")

CHANNEL = "radixgate:router-load"
_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class ReplicaSync:
    def __init__(
        self, registry: WorkerRegistry, redis_url: str, channel: str = CHANNEL, heartbeat_s: float = 1.0,
        expire_s: float = 3.0,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.redis_url = redis_url
        self.channel = channel
        self.heartbeat_s = heartbeat_s
        self.expire_s = expire_s
        self.replica = uuid.uuid4().hex[:12]
        self._dirty: dict[str, Worker] = {}
        self._wake = asyncio.Event()
        self._heard: dict[str, float] = {}  # replica -> monotonic time of its last message
        self._tasks: list[asyncio.Task] = []
        self._redis: Any = None
        self.stats = {"sent": 0, "received": 0, "malformed": 0, "publish_errors": 0, "expired": 0}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2)
        for worker in self.registry:
            worker.on_change = self._changed
        self.registry.on_added.append(self._added)
        self.registry.on_removed.append(self._removed)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(f()) for f in (self._publisher, self._subscriber, self._heartbeat)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._redis is not None:
            with contextlib.suppress(Exception):  # NOTE: tell the others we are gone, if Redis lets us
                await self._publish({}, full=True)
            await self._redis.aclose()

    def _added(self, worker: Worker) -> None:
        worker.on_change = self._changed

    def _removed(self, worker: Worker) -> None:
        worker.on_change = None
        self._dirty.pop(worker.url, None)

    # ---------------------------------------------------------------- publishing
    def _changed(self, worker: Worker) -> None:
        self._dirty[worker.url] = worker
        self._wake.set()

    async def _publisher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            dirty, self._dirty = self._dirty, {}
            await self._publish(
                {url: [w.in_flight, w.pending_prefill] for url, w in dirty.items()}, full=False
            )

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._publish({w.url: [w.in_flight, w.pending_prefill] for w in self.registry}, full=True)
            self.expire(time.monotonic())

    async def _publish(self, workers: dict[str, list[int]], full: bool) -> None:
        message = orjson.dumps({"replica": self.replica, "full": full, "workers": workers})
        try:
            await self._redis.publish(self.channel, message)
            self.stats["sent"] += 1
        except Exception as exc:  # NOTE: Redis down: the health reports still carry the others' load
            self.stats["publish_errors"] += 1
            if self.stats["publish_errors"] in (1, 10, 100) or self.stats["publish_errors"] % 1000 == 0:
                log.warning("replica sync: publish failed (%d so far): %s", self.stats["publish_errors"], exc)

    # ---------------------------------------------------------------- receiving
    async def _subscriber(self) -> None:
        failures = 0
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                failures = 0
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self.apply(message["data"], time.monotonic())
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]
                failures += 1
                log.warning("replica sync: subscription failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def apply(self, raw: bytes | str, now: float) -> None:
        """One message from the channel; our own and malformed ones are ignored (malformed counted)."""
        try:
            obj = orjson.loads(raw)
            replica, full, workers = obj["replica"], obj["full"], obj["workers"]
            if not isinstance(replica, str) or not isinstance(full, bool) or not isinstance(workers, dict):
                raise TypeError("replica, full, workers")
            counts = {url: _counts(value) for url, value in workers.items()}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.stats["malformed"] += 1
            return
        if replica == self.replica:
            return
        self.stats["received"] += 1
        if full and not counts:
            self.forget(replica)  # NOTE: a replica shutting down says so with an empty full message
            return
        self._heard[replica] = now
        if full:
            for worker in self.registry:
                if worker.url not in counts:
                    worker.set_peer(replica, 0, 0)
        for url, (in_flight, pending) in counts.items():
            worker = self.registry.get(url)
            if worker is not None:
                worker.set_peer(replica, in_flight, pending)

    def expire(self, now: float) -> None:
        """Forget replicas not heard from for ``expire_s`` (stopped or cut off from Redis)."""
        for replica, heard in list(self._heard.items()):
            if now - heard > self.expire_s:
                self.stats["expired"] += 1
                log.info("replica sync: no word from replica %s for %.1fs; forgetting its load", replica,
                         now - heard)  # fmt: skip
                self.forget(replica)

    def forget(self, replica: str) -> None:
        self._heard.pop(replica, None)
        for worker in self.registry:
            worker.set_peer(replica, 0, 0)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        peers = {r: round(now - t, 3) for r, t in self._heard.items()}
        return {"replica": self.replica, "channel": self.channel, "peers_last_heard_s": peers, **self.stats}


def _counts(value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(type(v) is int and v >= 0 for v in value)
    ):  # fmt: skip
        raise ValueError("a worker's counts must be [in-flight, pending prefill], non-negative integers")
    return value[0], value[1]
