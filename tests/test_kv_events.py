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
