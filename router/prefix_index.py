"""Approximate prefix index: which workers the router believes hold which block-hash prefixes.

One walk over a prompt's block hashes matches every worker at once; memory is bounded by one
global budget of (block, worker) entries. It never raises on odd events and never does I/O.

Layout (a flat radix index: chained hashes make each block hash name its whole prefix):

- ``_mask[h]``: bitmask of the workers holding block ``h`` (bit i = the worker in slot i);
- ``_parent[h]``: the hash before ``h`` in its chain (None at the root, or an unknown hash);
- ``_lru``: one OrderedDict over every (block, worker) entry, keyed ``h | slot << 64``, oldest first.

NOTE: invariant — for every entry, ``h in _mask`` with the worker's bit set iff its key is in
``_lru``; ``num_entries == len(_lru)`` never exceeds ``max_entries`` after a public call returns.
NOTE: invariant — whenever an entry is touched, its held ancestors are touched after it, so a
worker's ancestors are always more recent than its descendants and LRU eviction (oldest first)
removes a worker's leaves before their ancestors: it never opens a hole in a cached prefix.

Match semantics: a worker matches the leading blocks it holds *contiguously* from block 0; a hole
(block missing from the index) ends its match even if later blocks are held. Runs stored under a
parent the index does not hold (evicted here, or an event not seen yet) are recorded anyway: the
worker really holds them (a worker's radix cache cannot hold a child without its parent), they
cost budget like any entry, and they start matching once the prefix above them is known again
(an optimistic insert on route or a later event); until then they age out through the LRU.

Memory: about 210 bytes per (block, worker) entry for the first worker on a block (node + LRU
entry) and about 145 bytes for each extra worker on the same block (CPython 3.11, tracemalloc,
``python -m loadtest.bench_route_decision``); the default 2,000,000 entries ~ 0.3-0.45 GB.
Cost: ``match`` and ``insert`` are O(prompt blocks), run mostly in C iterators and do not depend
on the number of workers (bits of one int); on large indexes they are bound by memory latency
(one random dict access per block and table). While the index grows, an insert that resizes a
million-entry table pauses for a while (amortised O(1)). ``remove_worker`` and ``clear_worker``
scan every node. Updates naming a worker not added yet add it.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import accumulate, chain, repeat, takewhile
from operator import add, and_, neg, or_

_MASK64 = (1 << 64) - 1


class PrefixIndex:
    """Per-worker approximate radix index over block hashes with one global LRU budget."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries  # (block, worker) entries across all workers
        self._slot: dict[str, int] = {}  # worker -> bit index
        self._names: list[str | None] = []  # bit index -> worker (None = free slot)
        self._free: list[int] = []  # min-heap of free bit indexes, reused lowest first
        self._counts: list[int] = []  # bit index -> entries held by that worker
        self._mask: dict[int, int] = {}  # block hash -> worker bitmask (never 0)
        self._parent: dict[int, int | None] = {}  # block hash -> previous hash in its chain
        self._lru: OrderedDict[int, None] = OrderedDict()  # entry key -> None, oldest first

    # ---- workers ---------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """Give ``worker`` a bit; idempotent."""
        self._slot_of(worker)

    def remove_worker(self, worker: str) -> None:
        """Drop all of ``worker``'s entries and free its bit for reuse."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        self._drop_slot_entries(slot)
        del self._slot[worker]
        self._names[slot] = None
        heapq.heappush(self._free, slot)

    def clear_worker(self, worker: str) -> None:
        """``worker``'s cache was dropped (or is about to be re-synced): forget its entries."""
        slot = self._slot.get(worker)
        if slot is not None:
            self._drop_slot_entries(slot)

    @property
    def workers(self) -> list[str]:
        return list(self._slot)

    # ---- queries ---------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """worker -> number of leading blocks of ``block_hashes`` it holds (only workers with > 0).

        One walk for all workers: ``live[i]`` is the AND of the masks of blocks 0..i, so it only
        loses bits; the walk stops at the first block no worker holds. Drop-out points are then
        found by bisection (``live`` is numerically non-increasing: losing bits lowers the int).
        """
        live = list(takewhile(bool, accumulate(map(self._mask.get, block_hashes, repeat(0)), and_)))
        out: dict[str, int] = {}
        n = len(live)
        pos = 0
        while pos < n:
            value = live[pos]
            end = bisect_right(live, -value, lo=pos, key=neg)  # first index with fewer workers
            dropped = value & ~live[end] if end < n else value
            names = self._names
            while dropped:
                low = dropped & -dropped
                out[names[low.bit_length() - 1]] = end  # type: ignore[index]
                dropped ^= low
            pos = end
        return out

    @property
    def num_entries(self) -> int:
        """(block, worker) entries held, across all workers; never above ``max_entries``."""
        return len(self._lru)

    @property
    def num_nodes(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._mask)

    def worker_entries(self, worker: str) -> int:
        slot = self._slot.get(worker)
        return 0 if slot is None else self._counts[slot]

    # ---- updates ---------------------------------------------------------------------------

    def insert(self, worker: str, block_hashes: Sequence[int]) -> None:
        """Record that ``worker`` now holds the chain ``block_hashes`` starting at the root
        (optimistic insert on route). Only the first ``max_entries`` blocks are kept."""
        if not block_hashes:
            return
        hashes = block_hashes[: self.max_entries]
        slot = self._slot_of(worker)
        keys = list(map(add, hashes, repeat(slot << 64))) if slot else list(hashes)
        # Fast path: the leading blocks the worker already holds only need a touch.
        held = len(list(takewhile(self._lru.__contains__, keys)))
        if held < len(keys):
            self._add_run(slot, None if held == 0 else hashes[held - 1], hashes[held:], keys[held:])
        # NOTE: touch deepest first so that ancestors end up more recent than descendants.
        deque(map(self._lru.move_to_end, reversed(keys)), maxlen=0)
        self._evict_over_budget()

    def apply_stored(self, worker: str, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        """A worker event: ``worker`` stored the run ``block_hashes`` whose first block follows
        ``parent_hash`` (None or the root hash when the run starts the prompt). Recorded even if
        the index does not hold the parent (see the module docstring). Only the first
        ``max_entries`` blocks of a run are kept."""
        if not block_hashes:
            return
        hashes = block_hashes[: self.max_entries]
        slot = self._slot_of(worker)
        keys = list(map(add, hashes, repeat(slot << 64))) if slot else list(hashes)
        self._add_run(slot, parent_hash, hashes, keys)
        lru = self._lru
        deque(map(lru.move_to_end, reversed(keys)), maxlen=0)
        # NOTE: touch the worker's held ancestors, nearest first, to keep leaves older than them.
        bit = 1 << slot
        seen = set(hashes)  # guards against cycles in bogus parent links
        h = parent_hash
        while h is not None and h not in seen and self._mask.get(h, 0) & bit:
            seen.add(h)
            lru.move_to_end(h | slot << 64)
            h = self._parent.get(h)
        self._evict_over_budget()

    def apply_removed(self, worker: str, block_hashes: Sequence[int]) -> None:
        """A worker event: ``worker`` no longer holds these blocks. Unknown hashes are ignored."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        for h in block_hashes:
            self._drop_entry(h, slot)

    # ---- internals -------------------------------------------------------------------------

    def _slot_of(self, worker: str) -> int:
        slot = self._slot.get(worker)
        if slot is None:
            if self._free:
                slot = heapq.heappop(self._free)
                self._names[slot] = worker
            else:
                slot = len(self._names)
                self._names.append(worker)
                self._counts.append(0)
            self._slot[worker] = slot
        return slot

    def _add_run(self, slot: int, parent: int | None, hashes: Sequence[int], keys: list[int]) -> None:
        """Set ``slot``'s bit on a chain of blocks (parent links from ``parent``); entries it
        already held are left alone (the caller touches them)."""
        bit = 1 << slot
        masks, parents, lru = self._mask, self._parent, self._lru
        if not any(map(lru.__contains__, keys)):
            # Fast path (a new prompt or tail): the worker holds none of them, so every block
            # gains its bit; C-level bulk updates instead of a Python loop per block.
            # NOTE: a hash's parent is fixed by the chain, so rewriting a known one is a no-op.
            masks.update(zip(hashes, map(or_, map(masks.get, hashes, repeat(0)), repeat(bit)), strict=True))
            parents.update(zip(hashes, chain((parent,), hashes), strict=False))
            lru.update(dict.fromkeys(keys))
            self._counts[slot] += len(keys)
            return
        added = 0
        prev = parent
        for h, key in zip(hashes, keys, strict=True):
            m = masks.get(h)
            if m is None:
                masks[h] = bit
                parents[h] = prev
                lru[key] = None
                added += 1
            elif not m & bit:
                masks[h] = m | bit
                lru[key] = None
                added += 1
            prev = h
        self._counts[slot] += added

    def _drop_entry(self, h: int, slot: int) -> None:
        m = self._mask.get(h)
        bit = 1 << slot
        if m is None or not m & bit:
            return
        del self._lru[h | slot << 64]
        self._counts[slot] -= 1
        if m == bit:
            del self._mask[h]
            del self._parent[h]
        else:
            self._mask[h] = m & ~bit

    def _drop_slot_entries(self, slot: int) -> None:
        bit = 1 << slot
        for h in [h for h, m in self._mask.items() if m & bit]:
            self._drop_entry(h, slot)

    def _evict_over_budget(self) -> None:
        lru = self._lru
        while len(lru) > self.max_entries:
            key, _ = lru.popitem(last=False)
            h, slot = key & _MASK64, key >> 64
            m = self._mask[h] & ~(1 << slot)
            self._counts[slot] -= 1
            if m:
                self._mask[h] = m
            else:
                del self._mask[h]
                del self._parent[h]
