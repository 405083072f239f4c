"""The small RESP client replica sync uses: the parser on split input, and a real redis-server
(password, publish without waiting, a subscription, a server that goes away)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from router.launcher import redis_server
from router.resp import INCOMPLETE, RespConnection, RespError, command, parse
from tests.support import REDIS, free_port

MESSAGE = b"*3\r\n$7\r\nmessage\r\n$4\r\nchan\r\n$11\r\nhello\r\nbulk\r\n"


def test_only_tcp_urls_are_taken():
    from router.resp import tcp_url_options

    assert tcp_url_options("redis://u:p@h:7000/2")["port"] == 7000
    with pytest.raises(ValueError):
        tcp_url_options("unix:///tmp/redis.sock")


def test_commands_are_arrays_of_bulk_strings():
    assert command("PUBLISH", "c", b"a\r\nb") == b"*3\r\n$7\r\nPUBLISH\r\n$1\r\nc\r\n$4\r\na\r\nb\r\n"


def test_every_kind_of_reply_parses_and_a_cut_anywhere_is_incomplete():
    replies = b"+OK\r\n-ERR no\r\n:42\r\n$-1\r\n" + MESSAGE
    values, pos = [], 0
    while pos < len(replies):
        value, pos = parse(replies, pos)
        values.append(value)
    assert values[0] == "OK" and isinstance(values[1], RespError) and str(values[1]) == "ERR no"
    assert values[2:] == [42, None, [b"message", b"chan", b"hello\r\nbulk"]]
    for cut in range(len(MESSAGE)):  # a message split at any byte waits for the rest
        assert parse(MESSAGE[:cut]) == (INCOMPLETE, 0)
    with pytest.raises(ValueError):
        parse(b"?what\r\n")


def _redis(port: int, *args: str) -> subprocess.Popen:
    assert REDIS is not None
    return redis_server(port, *args)


@pytest.mark.redis
@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_publish_and_subscribe_with_a_password_against_a_real_server():
    port = free_port()
    server = _redis(port, "--requirepass", "s3cret")
    try:

        async def scenario() -> None:
            url = f"redis://:s3cret@127.0.0.1:{port}/3"
            received: list = []
            sub = await RespConnection.open(url, received.append)
            sub.send(command("SUBSCRIBE", "chan"))
            replies: list = []
            pub = await RespConnection.open(url, replies.append)
            for _ in range(100):
                if received:  # the subscription is confirmed
                    break
                await asyncio.sleep(0.01)
            for i in range(50):
                pub.send(command("PUBLISH", "chan", b"m%d" % i))  # no reply awaited
            for _ in range(200):
                if len(received) == 51:
                    break
                await asyncio.sleep(0.01)
            assert received[0] == [b"subscribe", b"chan", 1]
            assert [m[2] for m in received[1:]] == [b"m%d" % i for i in range(50)]
            assert replies == [1] * 50  # one subscriber heard each
            with pytest.raises(RespError):
                await RespConnection.open(f"redis://:wrong@127.0.0.1:{port}/0", print)
            server.terminate()
            await asyncio.wait_for(pub.closed, 10)
            assert pub.is_closed
            sub.close()

        asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.redis
@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_replica_sync_comes_back_after_redis_restarts():
    from router.circuit_breaker import CircuitBreaker
    from router.replica_sync import ReplicaSync
    from router.workers import WorkerRegistry

    port = free_port()
    server = _redis(port)
    try:

        async def scenario() -> None:
            nonlocal server
            url = f"redis://127.0.0.1:{port}/0"
            syncs = []
            for _ in range(2):
                registry = WorkerRegistry(CircuitBreaker, 100.0)
                registry.add("http://w:1")
                syncs.append(ReplicaSync(registry, url, heartbeat_s=0.2, expire_s=5.0))
            for s in syncs:
                await s.start()
            a, b = (s.registry.get("http://w:1") for s in syncs)

            async def until(predicate, what: str) -> None:
                for _ in range(300):
                    if predicate():
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"timed out waiting for {what}")

            await until(lambda: syncs[1].stats["received"] > 0, "b hears a's heartbeat")
            a.in_flight = 3
            a.changed()
            await until(lambda: b.peer_queue == 3, "a's change in b's view")
            server.terminate()
            server.wait(10)
            await asyncio.sleep(0.3)
            server = _redis(port)
            a.in_flight = 5
            a.changed()  # may be lost while the connections come back: the heartbeat repeats it
            await until(lambda: b.peer_queue == 5, "a's count after the restart")
            assert syncs[0].stats["publish_errors"] >= 1
            for s in syncs:
                await s.stop()

        asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(10)
