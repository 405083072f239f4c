"""Contract 3: the KV event wire format is pinned by golden bytes and validated on decode."""

from __future__ import annotations

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
