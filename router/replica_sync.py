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
``heartbeat_s`` all its workers with ``full: true`` (a worker not listed in a full message is 0),
a worker removed from it (``DELETE /workers``) among them until its requests there end.
A replica not heard from for ``expire_s`` is forgotten: its counts leave every worker's load.
Workers are matched by URL (in its one spelling, router.http_client.worker_base_url), so replicas
must be given the same workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from router.event_subscriber import reconnect_delay
from router.resp import RespConnection, RespError, command, tcp_url_options
from router.workers import Worker, WorkerRegistry

log = logging.getLogger("radixgate.router.replica_sync")

CHANNEL = "radixgate:router-load"
MAX_UNSENT = 1 << 20  # bytes queued for a Redis that does not read them (frozen): the connection is dropped


class ReplicaSync:
    def __init__(
        self, registry: WorkerRegistry, redis_url: str, channel: str = CHANNEL, heartbeat_s: float = 1.0,
        expire_s: float = 3.0,
    ) -> None:  # fmt: skip
        tcp_url_options(redis_url)  # NOTE: a bad URL stops the router at start-up, not a task later
        self.registry = registry
        self.redis_url = redis_url
        self.channel = channel
        self.heartbeat_s = heartbeat_s
        self.expire_s = expire_s
        self.replica = uuid.uuid4().hex[:12]
        self._dirty: set[str] = set()  # URLs whose counts moved since the last announcement
        # workers removed from the registry while our requests there still run (by id: a worker may be
        # added again at its URL meanwhile): announced until those end, not zeroed in the peers' view
        self._leaving: dict[int, Worker] = {}
        self._flush_soon = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pub: RespConnection | None = None
        self._sub: RespConnection | None = None
        self._heard: dict[str, float] = {}  # replica -> monotonic time of its last message
        # when our own announcement last came back on the subscription (or a connection was made), and
        # whether one came back since the connections were last made again for want of it
        self._echoed = time.monotonic()
        self._echo_heard = False
        self._tasks: list[asyncio.Task] = []
        self.stats = {"sent": 0, "received": 0, "malformed": 0, "publish_errors": 0, "expired": 0}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for worker in self.registry:
            worker.on_change = self._changed
        self.registry.on_added.append(self._added)
        self.registry.on_removed.append(self._removed)
        self._tasks = [
            self._loop.create_task(f()) for f in (self._publisher, self._subscriber, self._heartbeat)
        ]

    async def stop(self) -> None:
        if self._pub is not None and not self._pub.is_closed:
            self._send({}, full=True)  # NOTE: tell the others we are gone
            await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._pub = None

    def _added(self, worker: Worker) -> None:
        worker.on_change = self._changed

    def _removed(self, worker: Worker) -> None:
        if worker.in_flight or worker.pending_prefill:
            self._leaving[id(worker)] = worker
        else:
            worker.on_change = None
        self._changed(worker)

    # ---------------------------------------------------------------- publishing
    def _changed(self, worker: Worker) -> None:
        """Our counts on ``worker`` moved: announce them at the end of this event-loop turn."""
        if not (worker.in_flight or worker.pending_prefill) and self._leaving.pop(id(worker), None):
            worker.on_change = None  # NOTE: the last of our requests on a removed worker ended
        self._dirty.add(worker.url)
        if not self._flush_soon and self._loop is not None:
            self._flush_soon = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        dirty, self._dirty = self._dirty, set()
        self._send(self.own_counts(dirty), full=False)

    def _send(self, workers: dict[str, list[int]], full: bool) -> None:
        if self._pub is None or self._pub.is_closed:
            self.stats["publish_errors"] += 1  # NOTE: Redis away: the health reports still carry the load
            return
        unsent = self._pub.unsent
        if unsent > MAX_UNSENT:  # NOTE: a Redis that holds the connection but reads nothing
            log.warning("replica sync: Redis has not read %d bytes of announcements; reconnecting", unsent)
            self._pub.abort()
            self.stats["publish_errors"] += 1
            return
        message = orjson.dumps({"replica": self.replica, "full": full, "workers": workers})
        self._pub.send(command("PUBLISH", self.channel, message))
        self.stats["sent"] += 1

    def _publish_reply(self, value: Any) -> None:
        if isinstance(value, RespError):
            self.stats["publish_errors"] += 1

    async def _publisher(self) -> None:
        """Keeps the publishing connection up (replies are only counted, never awaited)."""

        def opened(conn: RespConnection) -> None:
            self._pub = conn
            self._echoed = time.monotonic()

        await self._keep_connected("publish connection", self._publish_reply, opened)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._send(self.own_counts(), full=True)
            self.expire(time.monotonic())
            self._check_round_trip(time.monotonic())

    # ---------------------------------------------------------------- receiving
    async def _subscriber(self) -> None:
        def opened(conn: RespConnection) -> None:
            self._sub = conn
            self._echoed = time.monotonic()
            conn.send(command("SUBSCRIBE", self.channel))

        await self._keep_connected("subscription", self._on_message, opened)

    def _check_round_trip(self, now: float) -> None:
        """Our own announcements come back on the subscription. None for ``expire_s`` while both
        connections are open: Redis went away without either seeing an end (its host lost, or an
        address moved to another one), so both are made again.
        NOTE: nothing else ends a subscription, which only reads (this replica would hear no peer again
        for good); the publishing connection would wait out TCP's retries (~15 min)."""
        sub, pub = self._sub, self._pub
        closed = sub is None or pub is None or sub.is_closed or pub.is_closed
        if closed or now - self._echoed <= self.expire_s:
            return
        if self._echo_heard:  # NOTE: once: while Redis stays away, _keep_connected logs its tries
            log.warning("replica sync: none of our announcements came back from Redis for %.1fs; "
                        "connecting again", now - self._echoed)  # fmt: skip
        self._echoed, self._echo_heard = now, False
        sub.abort()
        pub.abort()

    async def _keep_connected(
        self, what: str, on_value: Callable[[Any], None], on_open: Callable[[RespConnection], None]
    ) -> None:
        """Open a connection to Redis, hand it to ``on_open``, wait until it drops; again, backing
        off while Redis cannot be reached."""
        failures = 0
        while True:
            answered = False  # NOTE: a connection counts as made once Redis answers on it (a stopped
            # one still accepts connections): until then the backoff keeps growing
            refused: list[RespError] = []  # NOTE: Redis refused a command (NOAUTH, an ACL's NOPERM)
            opened: list[RespConnection] = []

            def heard(
                value: Any, was_down: bool = failures > 0, refused: list = refused, opened: list = opened
            ) -> None:
                nonlocal answered
                on_value(value)
                if isinstance(value, RespError):  # NOTE: it would go on refusing: reconnect, backing off
                    refused.append(value)
                    opened[0].close()
                    return
                if not answered and was_down:
                    log.info("replica sync: %s to Redis works again", what)
                answered = True

            try:
                conn = await RespConnection.open(self.redis_url, heard)
                opened.append(conn)
                on_open(conn)
                try:
                    await conn.closed
                finally:
                    conn.close()
                if refused:
                    if failures <= 1 or failures == 5 or failures % 50 == 0:
                        log.warning("replica sync: Redis refused the %s's command (%s); reconnecting",
                                    what, refused[0])  # fmt: skip
                elif answered:
                    log.warning("replica sync: %s to Redis lost; reconnecting", what)
                    failures = 0
                elif failures <= 1 or failures == 5 or failures % 50 == 0:
                    log.warning("replica sync: %s to Redis answered nothing; reconnecting", what)
            except (OSError, asyncio.TimeoutError, RespError) as exc:
                if failures <= 1 or failures == 5 or failures % 50 == 0:  # NOTE: 1: the first after a loss
                    log.warning(
                        "replica sync: %s to Redis failed (%s); retrying", what, exc or type(exc).__name__
                    )
            await asyncio.sleep(reconnect_delay(failures))
            failures += 1

    def _on_message(self, value: Any) -> None:
        if isinstance(value, list) and len(value) == 3 and value[0] == b"message":
            self.apply(value[2], time.monotonic())

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
            self._echoed, self._echo_heard = now, True
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

    def own_counts(self, urls: Iterable[str] | None = None) -> dict[str, list[int]]:
        """This replica's [in-flight, pending prefill] per worker URL (of ``urls``, else all), as
        announced: the registry's workers and those removed while our requests there still run."""
        if urls is None:
            urls = [w.url for w in self.registry] + [w.url for w in self._leaving.values()]
        counts: dict[str, list[int]] = {}
        for url in urls:
            worker = self.registry.get(url)
            counts[url] = [0, 0] if worker is None else [worker.in_flight, worker.pending_prefill]
        for worker in self._leaving.values():
            if worker.url in counts:
                counts[worker.url][0] += worker.in_flight
                counts[worker.url][1] += worker.pending_prefill
        return counts

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
