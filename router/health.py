"""Periodic health and load polling of every worker.

A worker is routable only after a passing check. On recovery it learns the worker's models and
cache info again; a new epoch (the worker restarted) drops what the index believed was cached."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from typing import TYPE_CHECKING

import aiohttp
import orjson

from router.workers import Worker

if TYPE_CHECKING:
    from router.gateway import Router

log = logging.getLogger("radixgate.router.health")
ROUND_SLICE = 16  # workers whose health checks start together (HealthChecker._round)
# checks in a row that got no answer in time before a worker's requests still waiting for their
# response head are given up on and retried elsewhere: a hung worker (a stuck GPU, a stopped
# process) would hold them until first_byte_timeout_s (request_timeout_s for a non-stream request)
STALLED_CHECKS = 3


def _number(value: object) -> float:
    """A count from a worker's report; anything else (absent, null, text, negative, NaN) is 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        return 0.0
    return float(value)


class HealthChecker:
    def __init__(self, router: Router, interval_s: float, timeout_s: float) -> None:
        self._router = router
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._task: asyncio.Task | None = None
        self._unanswered: dict[str, int] = {}  # worker url -> its checks in a row that timed out
        self._checking: dict[int, asyncio.Task] = {}  # id(worker) -> its check under way
        self._unlearned: set[str] = set()  # worker urls whose last /v1/models or cache info got no answer
        self._other_sizes: dict[
            str, int
        ] = {}  # the workers of other block sizes than the router's, as logged
        router.workers.on_removed.append(self._forget)

    def _forget(self, worker: Worker) -> None:
        self._unanswered.pop(worker.url, None)
        self._unlearned.discard(worker.url)
        self._adopt_block_size()  # NOTE: the size it advertised may have been the fleet's

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        checks = list(self._checking.values())  # NOTE: stopped: the checks under way go too
        for check in checks:
            check.cancel()
        await asyncio.gather(*checks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._round()
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")

    async def _round(self) -> None:
        """One interval's checks, started in slices of ``ROUND_SLICE`` workers spread over the
        interval (each worker still checked once an interval): started all at once, hundreds of
        checks took tens of ms of CPU in one burst (~0.1 ms each), and every request waited.
        Nothing waits for a check to end: a worker whose last check is still under way (a silent
        one, up to ``health_timeout_s``) is skipped this round; the others keep their cadence (a
        round that waited for its slowest check checked every worker once per interval + timeout)."""
        workers = list(self._router.workers)
        slices = max(1, -(-len(workers) // ROUND_SLICE))
        for i in range(slices):
            await asyncio.sleep(self._interval / slices)
            for worker in workers[i::slices]:
                if id(worker) not in self._checking:
                    task = self._checking[id(worker)] = asyncio.create_task(self.check(worker))
                    task.add_done_callback(functools.partial(self._checked, id(worker)))

    def _checked(self, key: int, task: asyncio.Task) -> None:
        self._checking.pop(key, None)
        if not task.cancelled() and task.exception() is not None:  # a bug here must not go unseen
            log.error("health check failed", exc_info=task.exception())

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self._router.workers))

    async def _get_json(self, url: str) -> tuple[int, object]:
        session = self._router.upstream.session
        assert session is not None
        async with session.get(url, timeout=self._timeout) as resp:
            payload = await resp.read()
            try:
                return resp.status, orjson.loads(payload) if payload else None
            except orjson.JSONDecodeError:
                return resp.status, None

    async def check(self, worker: Worker) -> None:
        timed_out = False
        try:
            status, body = await self._get_json(worker.url + "/health")
            ok = status == 200
        except asyncio.TimeoutError:
            ok, body, timed_out = False, None, True
        except (aiohttp.ClientError, OSError):
            ok, body = False, None
        if worker not in self._router.workers:
            return  # removed while we were asking (its count went with it)
        if timed_out:
            self._stalled(worker)
        else:
            self._unanswered.pop(worker.url, None)
        if not ok:
            if worker.healthy:
                log.warning("worker %s failed its health check: not routable", worker.url)
            worker.healthy = False
            return
        report = body if isinstance(body, dict) else {}
        queue = (_number(report.get(k)) for k in ("running", "waiting"))
        worker.apply_report(sum(queue), _number(report.get("prefill_backlog_tokens")))
        epoch = report.get("epoch") if isinstance(report.get("epoch"), str) else None
        restarted = epoch is not None and worker.epoch is not None and epoch != worker.epoch
        listed = _listed_models(report)
        if not worker.healthy or restarted:
            await self._learn(worker, listed, fresh=epoch is None or epoch != worker.epoch)
            # NOTE: a new process (a new epoch; or one that tells none, whose restart cannot be told from
            # a flap) starts with a closed breaker; the same process back from failed checks keeps its
            # breaker as it was: passing checks say nothing of its answers
            if epoch is None or epoch != worker.epoch:
                worker.breaker.reset()
            log.info("worker %s is healthy%s", worker.url, " (restarted: new epoch)" if restarted else "")
        elif not worker.models or worker.url in self._unlearned or _models_changed(report, worker):
            # NOTE: the last try to learn its models or cache info failed (a slow answer), or the worker
            # now serves other models (a LoRA adapter loaded or unloaded): ask again
            await self._learn(worker, listed)
        if worker not in self._router.workers:
            return  # NOTE: removed while it learned (maybe added again: the index is the new one's)
        if restarted:
            self._router.events.restarted(worker, epoch)
        elif epoch is not None and type(report.get("kv_event_seq")) is int:
            self._router.events.reported_seq(worker, epoch, report["kv_event_seq"])
        if epoch is not None:
            worker.epoch = epoch
        worker.healthy = True

    def _stalled(self, worker: Worker) -> None:
        """Another check of ``worker`` got no answer in time: from STALLED_CHECKS in a row on, its
        requests still waiting for their response head go to other workers (nothing of them reached
        a client yet). Only a silent worker: one that answers, even 503 while it drains, keeps its
        requests, as one that refuses connections does (they fail at once on their own)."""
        count = self._unanswered[worker.url] = self._unanswered.get(worker.url, 0) + 1
        if count >= STALLED_CHECKS:
            moved = self._router.upstream.client.abandon_heads(
                worker.url, f"{count} health checks in a row got no answer"
            )
            if moved:
                log.warning(
                    "worker %s stopped answering: %d requests waiting on it go elsewhere", worker.url, moved
                )

    async def _learn(self, worker: Worker, listed: frozenset[str] | None = None, fresh: bool = False) -> None:
        """Served models and, for radixgate workers, cache info (block size, namespace); what does not
        answer is asked again at the next check. ``listed``: the models its health report lists, which
        stand in while its /v1/models does not answer (the contexts and adapters' parents it tells are
        read at a later check). ``fresh``: a new process, whose contexts are not its last life's."""
        learned = info_read = False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            status, body = await self._get_json(worker.url + "/v1/models")
            if status == 200 and isinstance(body, dict) and isinstance(body.get("data"), list):
                served = [m for m in body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
                worker.models = frozenset(m["id"] for m in served)
                worker.max_model_len = {
                    m["id"]: m["max_model_len"] for m in served if type(m.get("max_model_len")) is int
                }
                worker.parents = {m["id"]: m["parent"] for m in served if isinstance(m.get("parent"), str)}
                self._router.workers.served_changed()
                learned = True
        if not learned:
            if fresh and (worker.max_model_len or worker.parents):
                # NOTE: a restarted worker may serve its model with another context (not its last life's)
                worker.max_model_len, worker.parents = {}, {}
                self._router.workers.served_changed()
            if listed and listed != worker.models:
                # NOTE: a worker of unknown models takes requests for any model no other worker tells it
                # serves, and a restarted one's last models may be another process's
                worker.models = listed
                worker.max_model_len = {m: n for m, n in worker.max_model_len.items() if m in listed}
                worker.parents = {m: p for m, p in worker.parents.items() if m in listed}
                self._router.workers.served_changed()
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            status, body = await self._get_json(worker.url + "/v1/cache/info")
            info_read = status < 500  # NOTE: a 404 is another backend's (none to read); a 5xx is asked again
            if status == 200 and isinstance(body, dict) and isinstance(body.get("block_size"), int):
                worker.cache_info = body
                self._adopt_block_size()
                if isinstance(body.get("epoch"), str) and worker.epoch is None:
                    worker.epoch = body["epoch"]
        if learned and info_read:
            self._unlearned.discard(worker.url)
        else:
            self._unlearned.add(worker.url)
        self._router.events.models_learned(worker)

    def _adopt_block_size(self) -> None:
        """One block size hashes every prompt: the one most workers advertise (a tie: the smallest), so
        which one a fleet mixing sizes is routed by does not hang on which worker was learned last (router
        replicas agree, whatever order they learned the workers in), and one worker of another size
        restarting does not switch it; asked again as workers are learned and removed. The others' prefixes stop matching. A change re-hashes the index: what it
        holds of every worker is in blocks of the old size (EventSubscriber.rehash)."""
        sizes = Counter(w.block_size for w in self._router.workers if w.block_size)
        if not sizes:
            return
        size = max(sizes, key=lambda s: (sizes[s], -s))
        others = {w.url: w.block_size for w in self._router.workers if w.block_size and w.block_size != size}
        if others and others != self._other_sizes:
            log.warning("workers advertise block sizes %s: prefix matching follows %d (most workers'); the "
                        "prefixes of %s stop matching: give every worker the same --block-size",
                        dict(sizes), size, others)  # fmt: skip
        self._other_sizes = others
        if size == self._router.block_size:
            return
        if not others:
            log.info("block size %d advertised by the workers", size)
        self._router.block_size = size
        self._router.events.rehash()


def _listed_models(report: dict) -> frozenset[str] | None:
    """The models a radixgate worker's /health lists (None: it lists none, as other backends)."""
    listed = report.get("models")
    return frozenset(m for m in listed if isinstance(m, str)) if isinstance(listed, list) else None


def _models_changed(report: dict, worker: Worker) -> bool:
    """A radixgate worker's /health lists the models it serves; True when they are not the ones
    the router learned."""
    listed = _listed_models(report)
    return listed is not None and listed != worker.models
