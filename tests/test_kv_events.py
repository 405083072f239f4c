"""Contract 3: the KV event wire format is pinned by golden bytes and validated on decode."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from router.kv_events import EventFormatError, KVEventBatch, StoredBlocks, decode, encode

GOLDEN = (
    b'{"version":1,"worker":"http://127.0.0.1:9001","epoch":"e1","seq":7,"ts":1700000000.5,"block_size":2,'
    b'"stored":[{"block_hashes":[1,18446744073709551615],"parent_hash":5,"token_ids":[1,2,3,4]}],'
    b'"removed":[9],"cleared":false}'
)
BATCH = KVEventBatch(
    worker="http://127.0.0.1:9001",
    epoch="e1",
    seq=7,
    ts=1700000000.5,
    block_size=2,
    stored=[StoredBlocks([1, 2**64 - 1], 5, [1, 2, 3, 4])],
    removed=[9],
)


def test_golden_bytes_round_trip():
    assert encode(BATCH) == GOLDEN
    assert decode(GOLDEN) == BATCH
    assert decode(GOLDEN.decode()) == BATCH


def _mutated(**changes) -> bytes:
    obj = orjson.loads(GOLDEN)
    obj.update(changes)
    return orjson.dumps(obj)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        _mutated(version=2),
        _mutated(seq=-1),
        _mutated(seq="7"),
        _mutated(block_size=0),
        _mutated(removed=[-1]),
        GOLDEN.replace(b'"removed":[9]', b'"removed":[18446744073709551616]'),
        _mutated(cleared="no"),
        _mutated(
            stored=[{"block_hashes": [1], "parent_hash": 5, "token_ids": [1]}]
        ),  # 1 token for a 2-token block
        _mutated(stored=[{"block_hashes": [1], "token_ids": [1, 2]}]),
        b'{"version":1}',
    ],
)
def test_malformed_batches_raise_format_error(raw):
    with pytest.raises(EventFormatError):
        decode(raw)


async def test_a_resync_keeps_what_the_snapshot_still_names_matchable_while_it_runs(monkeypatch):
    """A worker re-synced from its snapshot keeps matching the blocks the snapshot still names
    while the re-sync runs (it is applied in slices between other work: the router keeps routing),
    and ends holding exactly the snapshot's blocks, as if its entries had been cleared and the
    snapshot applied."""
    from router import event_subscriber
    from router.block_hash import block_hashes, root_hash
    from router.config import RouterConfig
    from router.gateway import Router
    from router.prefix_index import PrefixIndex

    monkeypatch.setattr(event_subscriber, "_SNAPSHOT_SLICE", 2)
    url, other = "http://127.0.0.1:42001", "http://127.0.0.1:42002"
    router = Router(RouterConfig(workers=[url, other], kv_events="off"))
    worker = router.workers.get(url)
    worker.cache_info = {"tokenizer": router.tokenizer.name, "block_size": router.block_size}  # counts alike
    prompts = [[i] * 3 + list(range(100 * i, 100 * i + 6)) for i in range(16)]
    chains = [block_hashes(p, 1) for p in prompts]
    for c in chains[:10]:
        router.index.apply_stored(url, root_hash(""), c)
    router.index.insert(other, chains[0])
    # the worker evicted conversation 9 and the tail of 8, and cached 10 to 15 meanwhile
    root = root_hash("")
    runs = [StoredBlocks(c, root, list(range(len(c)))) for c in chains[:8]]
    runs += [StoredBlocks(chains[8][:4], root, [0, 1, 2, 3])]
    runs += [StoredBlocks(c, root, list(range(len(c)))) for c in chains[10:]]
    raw = encode(
        KVEventBatch(
            worker=url, epoch="e2", seq=41, ts=0.0, block_size=1,
            stored=runs,
        )
    )  # fmt: skip
    seen: list[int] = []

    async def route_meanwhile() -> None:
        while not task.done():
            seen.append(router.index.match(chains[7]).get(url, 0))
            await asyncio.sleep(0)

    task = asyncio.ensure_future(router.events._apply_snapshot(worker, raw))
    await asyncio.gather(task, route_meanwhile())
    assert task.result() is True
    assert len(seen) >= 2 and set(seen) == {len(chains[7])}, "conversation 7 went cold during the re-sync"
    expected = PrefixIndex()
    for r in runs:
        expected.apply_stored(url, r.parent_hash, r.block_hashes)
    expected.insert(other, chains[0])
    for c in chains:
        assert router.index.match(c) == expected.match(c)
    assert (
        router.index.worker_entries(url)
        == expected.worker_entries(url)
        == sum(len(r.block_hashes) for r in runs)
    )
    assert router.events.synced(worker) and router.events._cursors[url].seq == 41
    assert worker.stats.kv_resyncs == 1


async def test_a_snapshot_of_the_last_life_applied_after_the_new_epoch_was_seen_is_re_synced(monkeypatch):
    """A worker restarts while a re-sync of it fetched its last life's snapshot: its health tells
    the new epoch while that snapshot waits to be applied (so no second re-sync starts), then it is
    applied. An idle worker publishes nothing (nor does one whose batches miss Redis), so no gap
    shows: its health reports, still telling the new epoch, re-sync it, and the blocks of the last
    life stop matching."""
    from router.block_hash import block_hashes, root_hash
    from router.config import RouterConfig
    from router.gateway import Router

    url = "http://127.0.0.1:42801"
    router = Router(RouterConfig(workers=[url], kv_events="redis", redis_url="redis://127.0.0.1:42802"))
    events, worker = router.events, router.workers.get(url)
    old = block_hashes(list(range(16)), 4)
    root = root_hash("")
    old_life = encode(KVEventBatch(worker=url, epoch="e1", seq=9, ts=0.0, block_size=4,
                                   stored=[StoredBlocks(old, root, list(range(16)))]))  # fmt: skip
    new_life = encode(KVEventBatch(worker=url, epoch="e2", seq=0, ts=0.0, block_size=4, stored=[]))
    snapshots = [old_life, new_life]
    release = asyncio.Event()

    async def fetch_and_apply(w):  # the snapshot fetch, without a worker to ask
        raw = snapshots.pop(0)
        if raw is old_life:
            await release.wait()  # read before the restart, applied after it
        return await events._apply_snapshot(w, raw)

    monkeypatch.setattr(events, "_resync", fetch_and_apply)
    worker.epoch = "e1"
    events.resync_soon(worker)
    await asyncio.sleep(0)
    events.restarted(worker, "e2")  # the health check's new epoch, while that re-sync runs
    worker.epoch = "e2"
    release.set()
    for _ in range(50):
        if not events._resyncs:
            break
        await asyncio.sleep(0)
    assert router.index.match(old) == {url: 4}  # the last life's cache, as the snapshot said
    for _ in range(3):  # health checks: the idle new life publishes nothing (seq 0)
        events.reported_seq(worker, "e2", 0)
        for _ in range(50):
            if not events._resyncs:
                break
            await asyncio.sleep(0)
    assert router.index.match(old) == {}, "the index still holds the last life's cache"
    assert events._cursors[url].epoch == "e2"


async def test_batches_of_a_life_that_ended_read_late_are_dropped_not_re_synced_from(monkeypatch):
    """A router cut off from Redis while a worker restarted re-syncs from the new life's snapshot (its health
    tells the new epoch); the old life's batches, read when Redis is back, each set off another snapshot
    fetch of the same cache (9 in 76 ms; 15 with 1,300 left over). They are dropped now."""
    from router.block_hash import block_hashes, root_hash
    from router.config import RouterConfig
    from router.gateway import Router

    url = "http://127.0.0.1:42811"
    router = Router(RouterConfig(workers=[url], kv_events="redis", redis_url="redis://127.0.0.1:42812"))
    events, worker = router.events, router.workers.get(url)
    root, chain = root_hash(""), block_hashes(list(range(8)), 4)
    for epoch in ("e1", "e2"):  # the old life's snapshot, then the new life's
        snapshot = KVEventBatch(worker=url, epoch=epoch, seq=3, ts=0.0, block_size=4, stored=[])
        assert await events._apply_snapshot(worker, encode(snapshot))
    fetched = []
    monkeypatch.setattr(events, "resync_soon", fetched.append)
    for seq in range(4, 10):  # the old life's batches, read late
        stale = KVEventBatch(worker=url, epoch="e1", seq=seq, ts=0.0, block_size=4,
                             stored=[StoredBlocks(chain, root, list(range(8)))])  # fmt: skip
        await events._handle(encode(stale))
    assert fetched == [] and router.index.match(chain) == {}
    assert events._cursors[url].epoch == "e2" and events._cursors[url].seq == 3
    fresh = KVEventBatch(worker=url, epoch="e2", seq=4, ts=0.0, block_size=4,
                         stored=[StoredBlocks(chain, root, list(range(8)))])  # fmt: skip
    await events._handle(encode(fresh))
    assert router.index.match(chain) == {url: 2}  # the new life's batches apply as before
    unknown = KVEventBatch(worker=url, epoch="e3", seq=0, ts=0.0, block_size=4, stored=[])
    await events._handle(encode(unknown))  # a life not seen yet: re-synced from, as before
    assert fetched == [worker]


def test_a_batch_names_its_worker_in_any_spelling_of_the_url_it_is_registered_under():
    from router.config import RouterConfig
    from router.gateway import Router

    router = Router(RouterConfig(workers=["http://127.0.0.1:42001"], kv_events="off"))
    worker = router.workers.get("http://127.0.0.1:42001")
    for name in ("http://127.0.0.1:42001", "http://127.0.0.1:042001/"):
        assert router.events._worker_for(name) is worker
    for name in ("http://127.0.0.1:42002", "not a url"):
        assert router.events._worker_for(name) is None


@pytest.mark.redis
async def test_redis_streams_are_read_for_the_base_models_workers_serve_and_no_others(launch):
    """A worker publishes its LoRA adapters' events on its served model's stream: one reader (one
    blocking XREAD connection) per base model, none for an adapter, and a model no worker serves any
    more (its worker restarted with another, or removed) has its reader stopped."""
    import redis.asyncio as aioredis

    from router.config import RouterConfig
    from router.gateway import Router
    from tests.support import REDIS, free_port

    if REDIS is None:
        pytest.skip("redis-server not installed")
    redis_url = launch.redis()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: its snapshots fail, as a worker down would
    router = Router(RouterConfig(workers=[url], kv_events="redis", redis_url=redis_url))
    probe = aioredis.from_url(redis_url)

    async def readers(expected: int) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            clients = await probe.client_list()
            reading = sum(1 for c in clients if c["cmd"] == "xread")
            if reading == expected:
                return
            assert asyncio.get_running_loop().time() < deadline, f"{reading} XREAD clients, not {expected}"
            await asyncio.sleep(0.05)

    def serves(worker, models: dict[str, str | None]) -> None:  # model -> its base (an adapter) or None
        worker.models = frozenset(models)
        worker.parents = {m: base for m, base in models.items() if base is not None}
        router.workers.served_changed()
        router.events.models_learned(worker)

    await router.upstream.start()
    await router.events.start()
    try:
        worker = router.workers.get(url)
        serves(worker, {"base": None, "lora_a": "base", "lora_b": "base"})
        await readers(1)
        serves(worker, {"base": None})  # its adapters unloaded
        await readers(1)
        serves(worker, {"other": None})  # restarted serving another model
        await readers(1)
        router.workers.remove(url)
        await readers(0)
    finally:
        await router.events.stop()
        await router.upstream.close()
        await probe.aclose()
