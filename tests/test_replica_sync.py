"""Replica sync: what one router replica does with the others' announcements (unit), and two real
router processes sharing their load over a real Redis (integration)."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from router.circuit_breaker import CircuitBreaker
from router.replica_sync import ReplicaSync
from router.workers import PendingPrefill, WorkerRegistry
from tests.support import REDIS, free_port, wait_until

A, B = "http://a:1", "http://b:1"


def sync_over(*urls: str) -> ReplicaSync:
    registry = WorkerRegistry(CircuitBreaker, 100.0)
    for url in urls:
        registry.add(url)
    return ReplicaSync(registry, "redis://unused", expire_s=3.0)


def message(replica: str, workers: dict, full: bool = False) -> bytes:
    return orjson.dumps({"replica": replica, "full": full, "workers": workers})


def test_announced_counts_add_to_the_load_and_replace_the_senders_earlier_ones():
    sync = sync_over(A, B)
    a = sync.registry.get(A)
    a.in_flight = 1
    sync.apply(message("r1", {A: [2, 300]}), now=0.0)
    sync.apply(message("r2", {A: [1, 0]}), now=0.0)
    assert (a.peer_queue, a.peer_prefill) == (3, 300)
    assert a.load == pytest.approx(1 + 3 + 300 / 100)
    sync.apply(message("r1", {A: [0, 0]}), now=0.1)  # absolute counts: r1 is done there
    assert (a.peer_queue, a.peer_prefill) == (1, 0)
    a.apply_report(5, 0)  # the report's rest beyond ours and the peers' is someone else's
    assert a.others_queue == 3 and a.load == 1 + 1 + 3


def test_a_full_message_zeroes_workers_it_does_not_list_and_an_empty_one_means_gone():
    sync = sync_over(A, B)
    a, b = sync.registry.get(A), sync.registry.get(B)
    sync.apply(message("r1", {A: [1, 10], B: [2, 20]}), now=0.0)
    sync.apply(message("r1", {B: [1, 5]}, full=True), now=1.0)
    assert (a.peer_queue, b.peer_queue, b.peer_prefill) == (0, 1, 5)
    sync.apply(message("r1", {}, full=True), now=1.5)  # r1 stopping
    assert b.peer_queue == 0 and b.peers == {} and sync.describe()["peers_last_heard_s"] == {}


def test_silent_replicas_are_forgotten_and_our_own_messages_ignored():
    sync = sync_over(A)
    a = sync.registry.get(A)
    sync.apply(message("r1", {A: [4, 400]}), now=10.0)
    sync.apply(message(sync.replica, {A: [9, 900]}), now=10.0)
    assert a.peer_queue == 4
    sync.expire(now=12.9)
    assert a.peer_queue == 4
    sync.expire(now=13.1)
    assert (a.peer_queue, a.peer_prefill) == (0, 0) and sync.stats["expired"] == 1


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", message("r1", {A: [1]}), message("r1", {A: [-1, 0]}), message("r1", {A: [1.5, 0]}),
     orjson.dumps({"replica": 7, "full": False, "workers": {}}), orjson.dumps({"replica": "r1"})],
)  # fmt: skip
def test_malformed_messages_are_counted_and_change_nothing(raw):
    sync = sync_over(A)
    sync.apply(raw, now=0.0)
    assert sync.registry.get(A).peer_queue == 0 and sync.stats["malformed"] == 1


def test_our_own_changes_are_marked_for_announcement():
    sync = sync_over(A, B)
    for w in sync.registry:
        w.on_change = sync._changed
    a = sync.registry.get(A)
    a.in_flight += 1
    pending = PendingPrefill(a, 50)
    assert list(sync._dirty) == [A]
    sync._dirty.clear()
    pending.release()
    assert list(sync._dirty) == [A]


def test_a_worker_removed_while_our_requests_there_run_is_announced_until_they_end():
    sync = sync_over(A, B)
    sync.registry.on_added.append(sync._added)
    sync.registry.on_removed.append(sync._removed)
    for w in sync.registry:
        w.on_change = sync._changed
    old = sync.registry.get(A)
    old.in_flight = 2
    pending = PendingPrefill(old, 30)
    sync.registry.remove(A)  # DELETE /workers while two requests there still run
    assert sync.own_counts() == {B: [0, 0], A: [2, 30]}  # a full heartbeat: not zeroed in the peers' view
    again = sync.registry.add(A)  # and added again meanwhile: both objects' requests count at its URL
    again.in_flight = 1
    assert sync.own_counts() == {B: [0, 0], A: [3, 30]}
    pending.release()
    old.in_flight = 0
    sync._dirty.clear()
    old.changed()  # the last of them ended
    assert list(sync._dirty) == [A] and sync.own_counts(sync._dirty) == {A: [1, 0]}
    assert sync.own_counts() == {A: [1, 0], B: [0, 0]} and old.on_change is None
    again.in_flight = 0
    sync.registry.remove(A)  # removed idle: announced once more, as 0
    assert A in sync._dirty
    assert sync.own_counts([A]) == {A: [0, 0]} and sync.own_counts() == {B: [0, 0]}


@pytest.mark.redis
@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_two_router_processes_see_each_others_requests_at_once(launch):
    port = free_port()
    worker = launch.module(
        "worker", "--engine", "sim", "--sim-prefill-ms-per-token", "20", "--chunked-prefill-tokens", "32",
        "--advertise-url", f"http://127.0.0.1:{port}", port=port,
    )  # fmt: skip
    redis_url = launch.redis()
    config = _heartbeat_yaml(launch.tmp_dir, 0.2)  # a replica silent for 3 heartbeats is forgotten
    common = [
        "--redis-url",
        redis_url,
        "--kv-events",
        "http",
        "--health-interval-s",
        "60",
        "--config",
        config,
    ]
    a, b = launch.router([worker.url], *common), launch.router([worker.url], *common)

    def view(router) -> dict:
        return httpx.get(router.url + "/workers", timeout=5).json()

    wait_until(lambda: len(view(b)["replica_sync"]["peers_last_heard_s"]) == 1, 30, what="b hears a")
    body = {"model": "tiny", "prompt": "x" * 160, "max_tokens": 2, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, a.url + "/v1/completions", json=body, timeout=60)
        wait_until(lambda: view(b)["workers"][0]["peer_in_flight"] == 1, 10, what="a's request in b's view")
        w = view(b)["workers"][0]
        assert w["in_flight"] == 0 and w["reported_queue"] == 0  # b itself sent nothing, no report yet
        assert w["peer_pending_prefill_tokens"] == 160  # a's prediction: nothing cached
        assert w["load"] == pytest.approx(1 + 160 / 256)
        debug = httpx.post(b.url + "/debug/route", json=body, timeout=5).json()["candidates"][0]
        assert (debug["peer_in_flight"], debug["peer_pending_prefill_tokens"], debug["in_flight"]) == (
            1,
            160,
            0,
        )
        assert sent.result().status_code == 200
    wait_until(lambda: view(b)["workers"][0]["peer_in_flight"] == 0, 10, what="a's request done in b's view")
    time.sleep(1.0)  # idle for longer than the expiry: a's heartbeats keep it known
    metrics = httpx.get(b.url + "/metrics", timeout=5).text
    assert "radixgate_replica_sync_peers 1.0" in metrics
    # a dies without a word: b forgets it after 3 heartbeats of silence
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    wait_until(lambda: view(b)["replica_sync"]["peers_last_heard_s"] == {}, 10, what="a forgotten")


def _heartbeat_yaml(tmp_dir: str, seconds: float) -> str:
    path = f"{tmp_dir}/replica-sync.yaml"
    with open(path, "w") as f:
        f.write(f"replica_sync_heartbeat_s: {seconds}\nlog_level: warning\n")
    return path


@pytest.mark.redis
def test_announcements_to_a_redis_that_reads_nothing_are_bounded_and_the_connection_made_again():
    """A frozen Redis (stopped, or partitioned without a reset) keeps the connection open and reads
    nothing: announcements must not pile up in the write buffer without bound; the connection is
    dropped (not closed politely: that waits for Redis to read) and made again, and once Redis
    reads again the other replicas hear this one."""
    import asyncio
    import os

    from router import replica_sync
    from tests.support import start_redis

    if REDIS is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    redis = start_redis(port)
    url = f"redis://127.0.0.1:{port}"
    try:

        async def run() -> tuple[int, int, bool, bool]:
            registry = WorkerRegistry(CircuitBreaker, 100.0)
            workers = [registry.add(f"http://10.0.0.{i}:8000") for i in range(8)]
            sync = ReplicaSync(registry, url, heartbeat_s=60.0, expire_s=180.0)
            peer = ReplicaSync(WorkerRegistry(CircuitBreaker, 100.0), url, heartbeat_s=60.0, expire_s=180.0)
            await sync.start()
            await peer.start()
            try:
                for _ in range(500):
                    if sync._pub is not None and peer.stats["received"] == 0:
                        workers[0].in_flight += 1
                        workers[0].changed()
                    if peer.stats["received"]:
                        break
                    await asyncio.sleep(0.01)
                first = sync._pub
                os.kill(redis.pid, signal.SIGSTOP)
                most = 0
                for i in range(60_000):  # each request moves a worker's count up and down
                    w = workers[i % 8]
                    w.in_flight += 1
                    w.changed()
                    await asyncio.sleep(0)
                    w.in_flight -= 1
                    w.changed()
                    await asyncio.sleep(0)
                    if sync._pub is not None and not sync._pub.is_closed:
                        most = max(most, sync._pub.unsent)
                for _ in range(500):  # NOTE: still stopped: a new connection (the kernel accepts it)
                    if sync._pub is not first:
                        break
                    await asyncio.sleep(0.01)
                made_again = sync._pub is not first
                os.kill(redis.pid, signal.SIGCONT)
                heard = peer.stats["received"]
                for _ in range(1000):
                    workers[1].in_flight += 1
                    workers[1].changed()
                    await asyncio.sleep(0.01)
                    if peer.stats["received"] > heard + 1:
                        break
                return most, sync.stats["publish_errors"], made_again, peer.stats["received"] > heard + 1
            finally:
                os.kill(redis.pid, signal.SIGCONT)
                await sync.stop()
                await peer.stop()

        most, errors, made_again, heard_again = asyncio.run(run())
    finally:
        os.kill(redis.pid, signal.SIGCONT)
        redis.terminate()
        redis.wait(10)
    assert most <= replica_sync.MAX_UNSENT + 4096 and errors >= 1, (most, errors)
    assert made_again and heard_again


def test_a_redis_gone_without_a_word_is_connected_to_again():
    """Redis lost on the way (its host gone, an address moved to another one: no end reaches either
    connection): the subscription only reads, so nothing ended it, and this replica heard no peer
    again for good. Its own announcements stop coming back: both connections are made again."""
    import asyncio

    from tests.support import SilencingProxy, start_redis

    if REDIS is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    redis = start_redis(port)
    proxy = SilencingProxy(port)
    try:

        def registry_of(*urls: str) -> WorkerRegistry:
            registry = WorkerRegistry(CircuitBreaker, 100.0)
            for url in urls:
                registry.add(url)
            return registry

        async def wait_for(condition, what: str) -> None:
            for _ in range(1000):
                if condition():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"timed out waiting for {what}")

        async def run() -> None:
            registry = registry_of(A)
            through_proxy = proxy.url.replace("http", "redis", 1)
            sync = ReplicaSync(registry, through_proxy, heartbeat_s=0.2, expire_s=0.6)
            peer = ReplicaSync(registry_of(), f"redis://127.0.0.1:{port}", heartbeat_s=0.2, expire_s=0.6)
            await sync.start()
            await peer.start()
            try:
                await wait_for(lambda: sync.stats["received"] and peer.stats["received"], "each other")
                proxy.silence()
                heard, told = sync.stats["received"], peer.stats["received"]
                await wait_for(lambda: sync.stats["received"] > heard + 2, "the peer heard again")
                await wait_for(lambda: peer.stats["received"] > told + 2, "this replica heard again")
            finally:
                await sync.stop()
                await peer.stop()

        asyncio.run(run())
    finally:
        redis.terminate()
        redis.wait(10)


@pytest.mark.redis
def test_a_redis_that_refuses_the_commands_is_logged_and_asked_again_with_backoff(caplog):
    """A Redis that takes the connection but refuses SUBSCRIBE and PUBLISH (a password or an ACL the
    URL does not meet): each connection is logged as refused and made again, backing off (the
    refusals were dropped in silence: no line in the log, and the connection counted as working)."""
    import asyncio
    import logging
    import socket

    from router.launcher import redis_server

    if REDIS is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    redis = redis_server(port, "--requirepass", "sekrit")

    def connections() -> int:  # the server's own count of the connections it took
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"AUTH sekrit\r\nINFO stats\r\nQUIT\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        line = next(x for x in data.decode().splitlines() if x.startswith("total_connections_received:"))
        return int(line.split(":")[1])

    try:

        async def run() -> dict:
            registry = WorkerRegistry(CircuitBreaker, 100.0)
            worker = registry.add("http://10.0.0.1:8000")
            sync = ReplicaSync(registry, f"redis://127.0.0.1:{port}", heartbeat_s=0.2, expire_s=5.0)
            await sync.start()
            try:
                for _ in range(30):
                    worker.in_flight += 1
                    worker.changed()
                    await asyncio.sleep(0.1)
                return dict(sync.stats)
            finally:
                await sync.stop()

        before = connections()
        with caplog.at_level(logging.WARNING, logger="radixgate.router.replica_sync"):
            stats = asyncio.run(run())
        made = connections() - before - 1  # NOTE: less the count's own connection
    finally:
        redis.terminate()
        redis.wait(10)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert any("subscription" in m and "NOAUTH" in m for m in refused), caplog.text
    assert any("publish connection" in m for m in refused), caplog.text
    assert stats["publish_errors"] >= 1 and stats["received"] == 0
    assert 4 <= made <= 12, made  # made again, backing off (1 s, 2 s, ...): not in a tight loop
