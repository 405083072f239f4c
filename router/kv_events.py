"""KV cache events: the versioned wire format workers publish and routers consume.

One batch per publish. ``seq`` grows by one per batch within an ``epoch`` (a worker restart
starts a new epoch), so a consumer detects gaps and re-syncs from the worker's snapshot.
Changing the encoding means bumping ``EVENT_VERSION``; golden-bytes tests pin version 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

EVENT_VERSION = 1
_U64 = (1 << 64) - 1

# A router's hint to the worker it picked: another worker (base URL) predicted to hold more of the
# prompt's KV, which the picked worker may fetch before computing the prefill (worker/kv_transfer.py).
KV_SOURCE_HEADER = "x-radixgate-kv-source"


class EventFormatError(ValueError):
    """A batch that does not follow the format; the consumer drops it and re-syncs."""


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """A run of consecutive full blocks now cached: block i's parent is block i-1,
    block 0's parent is ``parent_hash`` (the root hash when the run starts the prompt)."""

    block_hashes: list[int]
    parent_hash: int
    token_ids: list[int]  # len(block_hashes) * block_size tokens


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    worker: str  # the worker's advertised URL or name: how routers identify it
    epoch: str  # changes on every worker start
    seq: int  # 0, 1, 2, ... within one epoch
    ts: float  # unix seconds when published
    block_size: int  # tokens per block
    stored: list[StoredBlocks] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)  # block hashes no longer cached
    cleared: bool = False  # the whole cache was dropped before ``stored`` was applied
    version: int = EVENT_VERSION


def encode(batch: KVEventBatch) -> bytes:
    """Deterministic JSON bytes (fixed key order) for a batch."""
    return orjson.dumps(
        {
            "version": batch.version,
            "worker": batch.worker,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "ts": batch.ts,
            "block_size": batch.block_size,
            "stored": [
                {"block_hashes": s.block_hashes, "parent_hash": s.parent_hash, "token_ids": s.token_ids}
                for s in batch.stored
            ],
            "removed": batch.removed,
            "cleared": batch.cleared,
        }
    )


def _u64_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v <= _U64 for v in value):
        raise EventFormatError(f"{what} must be a list of unsigned 64-bit integers")
    return value


def decode(raw: bytes | str) -> KVEventBatch:
    """Parse and validate one batch; raises EventFormatError on anything malformed."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EventFormatError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise EventFormatError("a batch must be a JSON object")
    if obj.get("version") != EVENT_VERSION:
        raise EventFormatError(f"unsupported event version {obj.get('version')!r}")
    try:
        worker, epoch, seq = obj["worker"], obj["epoch"], obj["seq"]
        ts, block_size = obj["ts"], obj["block_size"]
        stored_raw, removed_raw, cleared = obj["stored"], obj["removed"], obj["cleared"]
    except KeyError as exc:
        raise EventFormatError(f"missing field {exc.args[0]!r}") from None
    if not isinstance(worker, str) or not isinstance(epoch, str):
        raise EventFormatError("worker and epoch must be strings")
    if type(seq) is not int or seq < 0:
        raise EventFormatError("seq must be a non-negative integer")
    if type(block_size) is not int or block_size <= 0:
        raise EventFormatError("block_size must be a positive integer")
    if not isinstance(ts, (int, float)) or not isinstance(cleared, bool):
        raise EventFormatError("ts must be a number and cleared a boolean")
    if not isinstance(stored_raw, list):
        raise EventFormatError("stored must be a list")
    stored = []
    for s in stored_raw:
        if not isinstance(s, dict):
            raise EventFormatError("each stored entry must be an object")
        hashes = _u64_list(s.get("block_hashes"), "stored.block_hashes")
        parent = s.get("parent_hash")
        if type(parent) is not int or not 0 <= parent <= _U64:
            raise EventFormatError("stored.parent_hash must be an unsigned 64-bit integer")
        tokens = s.get("token_ids")
        if not isinstance(tokens, list) or len(tokens) != len(hashes) * block_size:
            raise EventFormatError("stored.token_ids must hold block_size tokens per block")
        stored.append(StoredBlocks(hashes, parent, tokens))
    removed = _u64_list(removed_raw, "removed")
    return KVEventBatch(worker, epoch, seq, float(ts), block_size, stored, removed, cleared)
