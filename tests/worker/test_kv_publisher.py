"""KV publisher: numbered batches, a real Redis Stream whose events replay to the worker's snapshot,
Redis outages that drop (and count) instead of blocking, slow SSE subscribers cut off."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from router.kv_events import StoredBlocks, decode
from tests.support import REDIS, free_port, start_redis
from worker.kv_publisher import KVPublisher, stream_name


@pytest.fixture
def redis_port() -> Iterator[int]:
    if REDIS is None:
        pytest.skip("redis-server binary not found")
    port = free_port()
    proc = start_redis(port)
    yield port
    proc.terminate()
    proc.wait(10)


def poll(fn, what: str, deadline_s: float = 15.0):
    end = time.monotonic() + deadline_s
    while not (value := fn()):
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def run(i: int) -> StoredBlocks:
    return StoredBlocks([i], 0, [i] * 4)


def test_batches_are_numbered_and_empty_ones_skipped():
    pub = KVPublisher("http://w:1", block_size=4)
    assert pub.publish([], [], False) is None
    first = pub.publish([], [], True, force=True)
    second = pub.publish([run(1)], [], False)
    third = pub.publish([], [1], False)
    assert [b.seq for b in (first, second, third)] == [0, 1, 2]
    assert len({b.epoch for b in (first, second, third)}) == 1 and len(pub.epoch) == 32
    assert KVPublisher("http://w:1", 4).epoch != pub.epoch  # a restart is a new epoch
    snap = decode(pub.snapshot_batch([run(1)]))
    assert snap.seq == 2 and snap.cleared and snap.stored == [run(1)]


def test_a_redis_url_redis_cannot_read_drops_and_counts_every_batch(caplog):
    # NOTE: the worker's config refuses such a URL; a publisher built with one must still not lose
    # batches silently (its Redis thread dying on the first one, the rest never counted)
    pub = KVPublisher("http://w:1", 4, redis_url="127.0.0.1:6379", stream="radixgate:kv:t")
    pub.start()
    try:
        for i in range(5):
            pub.publish([run(i)], [], False)
        poll(lambda: pub.stats["redis_dropped"] == 4, "every batch but the newest (kept) counted as dropped")
        assert "Redis URL must specify one of the following schemes" in caplog.text
    finally:
        pub.close()
    assert pub.stats["redis_dropped"] == 5 and pub.stats["redis_sent"] == 0  # the kept one too, at close


@pytest.mark.redis
def test_a_full_redis_queue_drops_its_oldest_batches_not_the_newest():
    """Redis that hangs (XADD blocks) lets the queue fill: the newest batches are kept for it."""
    if REDIS is None:
        pytest.skip("redis-server binary not found")
    port = free_port()
    pub = KVPublisher("http://w:1", 4, redis_url=f"redis://127.0.0.1:{port}/0", stream="radixgate:kv:t",
                      redis_queue_size=2)  # fmt: skip
    for i in range(5):  # NOTE: the Redis thread not started yet: as if it were stuck in one XADD
        pub.publish([run(i)], [], False)
    assert pub.stats["redis_dropped"] == 3
    proc = start_redis(port)
    try:
        import redis

        pub.start()
        client = redis.Redis(port=port)
        poll(lambda: client.xlen("radixgate:kv:t") == 2, "the queued batches sent")
        assert [decode(e[1][b"batch"]).seq for e in client.xrange("radixgate:kv:t")] == [3, 4]
    finally:
        pub.close()
        proc.terminate()
        proc.wait(10)


@pytest.mark.redis
def test_redis_outage_keeps_the_newest_batch_and_sends_it_when_redis_is_back():
    """Batches published while Redis is down are dropped and counted, except the newest, which
    reaches Redis once it is back though nothing more is published: consumers see the gap (or the
    change, e.g. a flush) without waiting for the engine's next batch."""
    if REDIS is None:
        pytest.skip("redis-server binary not found")
    port = free_port()  # nothing listens here yet
    pub = KVPublisher("http://w:1", 4, redis_url=f"redis://127.0.0.1:{port}/0", stream="radixgate:kv:t")
    pub.start()
    proc = None
    try:
        for i in range(20):
            pub.publish([run(i)], [], False)  # returns at once even though Redis is down
        poll(lambda: pub.stats["redis_dropped"] == 19, "all but the newest batch dropped")
        proc = start_redis(port)
        import redis

        client = redis.Redis(port=port)
        poll(lambda: client.xlen("radixgate:kv:t") == 1, "the kept batch sent with no new one", deadline_s=30)
        kept = decode(client.xrange("radixgate:kv:t")[0][1][b"batch"])
        assert kept.seq == 19 and kept.stored == [run(19)]  # the dropped ones left a seq gap
        pub.publish([run(20)], [], False)
        poll(lambda: client.xlen("radixgate:kv:t") == 2, "the next batch sent")
        # NOTE: the publisher counts a send once XADD returns, which can be after Redis shows the entry
        poll(lambda: pub.stats["redis_sent"] == 2, "the send counted")
        assert pub.stats == {"published": 21, "redis_sent": 2, "redis_dropped": 19, "subscribers_dropped": 0}
    finally:
        pub.close()
        if proc is not None:
            proc.terminate()
            proc.wait(10)


async def test_slow_sse_subscriber_is_cut_off_without_blocking_the_publisher():
    pub = KVPublisher("http://w:1", 4, subscriber_queue_size=4)
    slow = pub.subscribe()
    engine = threading.Thread(target=lambda: [pub.publish([run(i)], [], False) for i in range(10)])
    engine.start()
    engine.join(10)
    assert not engine.is_alive()
    await asyncio.wait_for(_until(lambda: pub.stats["subscribers_dropped"] == 1), 10)
    assert pub.num_subscribers == 0
    assert await slow.queue.get() is None  # the stream ends; the client re-syncs from the snapshot


async def test_ending_the_streams_ends_every_subscriber_and_any_opened_later():
    """The server is stopping: each stream ends after nothing more (queued batches dropped), and a
    stream opened after that ends at once; publishing goes on without subscribers."""
    pub = KVPublisher("http://w:1", 4)
    subs = [pub.subscribe(), pub.subscribe()]
    pub.publish([run(0)], [], False)
    await asyncio.wait_for(_until(lambda: all(s.queue.qsize() == 1 for s in subs)), 10)
    pub.end_streams()
    assert pub.num_subscribers == 0
    for sub in subs:
        assert await asyncio.wait_for(sub.queue.get(), 10) is None and sub.queue.empty()
    late = pub.subscribe()
    assert pub.num_subscribers == 0 and late.queue.get_nowait() is None
    assert pub.publish([run(1)], [], False) is not None and late.queue.empty()


async def _until(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


@pytest.mark.redis
async def test_engine_events_in_redis_are_consecutive_and_replay_to_the_snapshot(redis_port):
    import redis

    from worker.assembly import build_engine
    from worker.config import WorkerConfig
    from worker.sampling import SamplingParams

    cfg = WorkerConfig(
        model="tiny", device="cpu", kv_cache_tokens=1024, redis_url=f"redis://127.0.0.1:{redis_port}/0"
    )
    engine = build_engine(cfg)
    engine.start()
    try:

        async def complete(prompt: str) -> None:
            handle = engine.submit(list(prompt.encode()), SamplingParams(temperature=0.0, max_tokens=20))
            while (await asyncio.wait_for(handle.outputs.get(), 30)).finish_reason is None:
                pass

        system = "Shared instructions for every request in this test. " * 3
        await asyncio.gather(*(complete(system + f"question {i}") for i in range(4)))
        await engine.flush_cache()
        # 1024-token pool: these evict each other, so removals are in the stream too
        for i in range(6):
            await complete(f"{i} " * 80)
        snapshot = decode(await engine.snapshot_events())
        client = redis.Redis(port=redis_port)
        key = stream_name("tiny")
        poll(
            lambda: engine.publisher.stats["redis_sent"] == engine.publisher.stats["published"], "Redis sends"
        )
        batches = [decode(fields[b"batch"]) for _, fields in client.xrange(key)]
    finally:
        engine.stop()
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert batches[-1].seq == snapshot.seq and {b.epoch for b in batches} == {snapshot.epoch}
    assert batches[0].cleared and any(b.cleared for b in batches[1:])  # start and flush
    assert any(b.removed for b in batches) and engine.snapshot().evicted_pages > 0
    blocks: set[int] = set()
    for b in batches:
        if b.cleared:
            blocks.clear()
        for s in b.stored:
            blocks.update(s.block_hashes)
        blocks.difference_update(b.removed)
    assert blocks == {h for s in snapshot.stored for h in s.block_hashes} and blocks
