"""Router admission: at most ``max_concurrent`` requests are being forwarded at once; the next ones
wait in a bounded queue, lowest ``priority`` first (the request body's, as workers read it), first
come first served within one, and are routed only when a slot frees (so the policy sees the load
of that moment). A full queue is 429; a wait past ``timeout_s`` is 503.

Per router replica (several replicas each admit their own). Never loses a slot: a waiter that
leaves (client gone, timeout) after being handed one passes it on."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

from router.errors import QUEUE_FULL_RETRY_AFTER_S, RouterError


class _QueueTimeout(Exception):
    pass


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(_QueueTimeout())


class AdmissionGate:
    """Slots for concurrent requests; ``max_concurrent`` 0 admits everything at once."""

    def __init__(self, max_concurrent: int, max_queued: int, timeout_s: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.active = 0  # requests holding a slot
        self._waiters: list[tuple[int, int, asyncio.Future]] = []  # heap of (priority, arrival, future)
        self._arrivals = itertools.count()
        self.rejected = 0  # queue full (429)
        self.timed_out = 0  # waited longer than timeout_s (503)
        self.waited_s = 0.0  # total time admitted requests spent queued
        self.admitted_after_wait = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting for one if all are held (lower ``priority`` first). Raises
        RouterError 429 / 503."""
        if self.max_concurrent <= 0:
            self.active += 1
            return
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            self.rejected += 1
            raise RouterError(
                429, f"the router is at {self.max_concurrent} concurrent requests and "
                f"{self.max_queued} queued; try again later", "router_queue_full", QUEUE_FULL_RETRY_AFTER_S,
            )  # fmt: skip
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), waiter))
        started = time.perf_counter()
        expiry = loop.call_later(self.timeout_s, _expire, waiter)
        try:
            # NOTE: awaited directly (no wait_for), so a cancel that races the hand-over still
            # raises here and _leave passes the slot on
            await waiter
        except _QueueTimeout:
            self._leave(waiter)
            self.timed_out += 1
            raise RouterError(
                503, f"no capacity within {self.timeout_s:g} s (the router queues at most "
                f"{self.max_concurrent} concurrent requests)", "router_queue_timeout",
            ) from None  # fmt: skip
        except BaseException:  # the client went away while waiting
            self._leave(waiter)
            raise
        finally:
            expiry.cancel()
        self.waited_s += time.perf_counter() - started
        self.admitted_after_wait += 1

    def _leave(self, waiter: asyncio.Future) -> None:
        """A waiter gives up: out of the queue, or, if a slot was handed to it meanwhile, pass it on."""
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self.release()
            return
        waiter.cancel()
        kept = [entry for entry in self._waiters if entry[2] is not waiter]  # NOTE: may be gone already
        if len(kept) != len(self._waiters):
            self._waiters = kept
            heapq.heapify(self._waiters)

    def release(self) -> None:
        """Give a slot back: to the first waiter, lowest priority then oldest (the slot moves,
        ``active`` stays), or free it."""
        while self._waiters:
            waiter = heapq.heappop(self._waiters)[2]
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1
