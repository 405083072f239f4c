"""Approximate prefix index: which workers the router believes hold which block-hash prefixes.

One walk over a prompt's block hashes matches every worker at once; memory is bounded by one
global budget of (block, worker) entries. It never raises on odd events and never does I/O.

Layout: a radix tree with compressed edges over chained block hashes (a hash names its prefix).
A node is an int id; its fields live in dicts keyed by the ids of live nodes: ``_run`` (an
``array('Q')`` of consecutive hashes held by the same workers), ``_mask`` (bit i = slot i),
``_kids`` (children keyed by first hash, for nodes that have any), ``_parent`` (or ``_up``, the hash before a parentless
run), ``_touched`` (the tick of the last update touching it or a descendant), ``_ticks`` (once a
second worker holds it: each holder's last update through it) and ``_confirmed`` (the holders
whose stored event named the run; an insert's blocks are only predicted, and never extend a
confirmed run in place).
``_where[h]`` is the id of the node holding block ``h``, written for new blocks, on splits and
when a stored child joins its parent's run. ``_held[slot]`` holds the ids of the live nodes whose
mask has that slot's bit, so a worker's nodes are found without walking the others'.
``_roots[parent_hash]`` holds parentless nodes: None (or a namespace root hash) starts a prompt;
other keys are parents this index does not hold (orphan runs). ``_leaves``: heap of leaves, lazy.

NOTE: invariants after every public call — each held hash lies in exactly one live node, mapped
by ``_where``; live masks are non-zero; ``_held[slot]`` holds exactly the live nodes with that
bit; no ``_roots`` key is in ``_where`` (orphans are adopted when their parent block is inserted,
unless inconsistent chains would make a cycle); every live leaf is in ``_leaves``; a node's tick
>= its children's; ``num_entries`` <= ``max_entries``.

Match: a worker matches the leading blocks it holds *contiguously* from block 0; a hole ends its
match. Runs stored under a parent the index does not hold are recorded (they cost budget) and
match once the prefix above is known again; until then they age out like any leaf.
Eviction: the least recently touched *leaf* loses tail blocks, for every worker on it, until the
index is under budget (it may free up to workers-on-the-block - 1 entries more than needed).
Leaves go before ancestors, so it never opens a hole. Eviction reads the node's tick; a take-back
reads its worker's (another worker's request for the same prompt does not keep it).

Garbage collection: nodes are ids, not objects; ``_where`` maps hashes to ids (ints only) and
``_leaves`` queues ids, so a full collection walks no block and one object per node, its run's
array (which holds no references), plus a few dicts (docs/benchmarks/route-decision.md). Runs are
arrays, not tuples of ints (untracked once a collection has seen them): every new or grown tuple
would be scanned item by item by the next young collection, ms-long pauses inside route decisions.

Cost: ``match`` is O(nodes on the path + log(run)): equal last hashes mean a whole run agrees,
else bisect. ``insert`` touches the same nodes plus one dict write per *new* block (memory-bound,
~0.3 us each on large indexes). Memory: ~60 bytes per distinct block plus ~310 per node; another
worker on a node costs one bit and one id in its ``_held``, and a node two or more workers hold keeps a
small dict of their ticks. ``remove_worker``/``clear_worker`` visit that worker's nodes only.
Re-sync: ``resync_steps`` (in slices) ends as ``clear_worker`` then
``apply_stored`` of every run would (same entries, same matches), but drops only the blocks the
snapshot no longer names and applies only the runs that add or confirm blocks.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from itertools import count, repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.kv_events import StoredBlocks


def _slots(mask: int) -> Iterator[int]:
    """The bit indexes set in ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _copy(ticks: dict[int, int] | None) -> dict[int, int] | None:
    return None if ticks is None else dict(ticks)


def _agree(query: Sequence[int], start: int, run: Sequence[int], off: int) -> int:
    """Blocks of ``query[start:]`` equal to ``run[off:]``, given that the first pair is equal.

    Hashes chain, so agreement is monotone: gallop (1, 3, 7, ...) to bracket the first
    disagreement, then bisect. O(log k) comparisons for an agreement of k, and a lazily hashed
    query (block_hash.PromptHashes) is never read much beyond where it stops agreeing."""
    n = min(len(run) - off, len(query) - start)
    lo, step = 1, 2  # agree at lo - 1
    while True:
        probe = min(n, lo - 1 + step)  # the count agreeing if query[start + probe - 1] matches
        if query[start + probe - 1] != run[off + probe - 1]:
            hi = probe - 1  # disagree at hi
            break
        if probe == n:
            return n
        lo, step = probe, step * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if query[start + mid] == run[off + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


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
        self._held: list[dict[int, None]] = []  # bit index -> ids of the live nodes with that bit
        self._where: dict[int, int] = {}  # block hash -> id of its node
        # A node is its id; its fields live in these maps, keyed by the ids of live nodes.
        self._run: dict[int, array] = {}  # consecutive block hashes, oldest first; never empty
        self._mask: dict[int, int] = {}  # workers holding every block of the run (non-zero)
        self._confirmed: dict[int, int] = {}  # the workers in the mask whose stored event named the run
        self._touched: dict[int, int] = {}  # the node's tick
        # from the moment a second worker holds a node: slot -> the tick of that worker's last
        # insert / stored event through it (absent: the tick is its sole holder's, or later)
        self._ticks: dict[int, dict[int, int]] = {}
        self._parent: dict[int, int] = {}  # child -> parent, for nodes that have one
        self._up: dict[int, int | None] = {}  # parentless node -> the hash before its run
        # node -> first hash of a child's run -> child; only nodes with children (most are leaves)
        self._kids: dict[int, dict[int, int]] = {}
        self._ids = count(1)  # node ids, never reused (a dead node's heap entries stay stale)
        self._roots: dict[int | None, dict[int, int]] = {}  # parent hash -> first hash -> node
        self._leaves: list[tuple[int, int, int]] = []  # heap of (tick, seq, leaf's id), lazy
        self._seq = count()
        self._tick = 0  # bumped once per insert / stored event
        self._entries = 0

    # ---- workers ---------------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """Give ``worker`` a bit; idempotent."""
        self._slot_of(worker)

    def remove_worker(self, worker: str) -> None:
        """Drop all of ``worker``'s entries and free its bit for reuse."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        self.clear_worker(worker)
        del self._slot[worker]
        self._names[slot] = None
        heapq.heappush(self._free, slot)

    def clear_worker(self, worker: str) -> None:
        """``worker``'s cache was dropped (or is about to be re-synced): forget its entries."""
        slot = self._slot.get(worker)
        if slot is not None and self._counts[slot]:  # NOTE: holding nothing (a first sync): no walk
            for nid in list(self._held[slot]):  # NOTE: losing one node never splits or merges another
                self._lose(nid, slot)

    def resync_steps(
        self, worker: str, stored: Sequence[StoredBlocks], slice_runs: int = 128
    ) -> Iterator[None]:
        """Replace what the index holds for ``worker`` by its snapshot's runs ``stored``, by
        difference, yielding after every ``slice_runs`` runs read or applied (the caller runs other
        work there; it stops iterating if the worker is removed meanwhile). The blocks no run names
        go in one step (O(the worker's blocks); other workers' nodes are not visited), the others
        stay, and only the runs that add or confirm a block are applied. Run to the end without
        other updates between steps, it leaves what ``clear_worker`` followed by ``apply_stored``
        of every run would (eviction aside): the same blocks per worker, confirmed alike, the same
        ``match`` answers. The node layout may differ, and what stayed is not touched: it keeps its
        last use, where clear and apply would make all of it the newest (a re-sync is not a use).
        Updates between the apply steps land as they would between clear and apply: what the
        worker gains meanwhile stays. Blocks an insert gives it while the snapshot is still being
        read (before the drop) go with the drop unless a run names them (the worker's stored event,
        replayed after the re-sync, brings them back)."""
        slot = self._slot.get(worker)
        missing: set[int] | None = None  # None: apply every run (the worker held nothing)
        if slot is not None and self._counts[slot]:
            cap = self.max_entries  # NOTE: apply_stored keeps only a run's first max_entries blocks
            named: set[int] = set()
            for start in range(0, len(stored), slice_runs):
                if start:
                    yield
                for run in stored[start : start + slice_runs]:
                    named.update(run.block_hashes if len(run.block_hashes) <= cap else run.block_hashes[:cap])
            yield
            missing = self._drop_unnamed(worker, named)
        for start in range(0, len(stored), slice_runs):
            if start:
                yield
            # NOTE: a run naming no missing block would change nothing
            for run in stored[start : start + slice_runs]:
                if missing is None or not missing.isdisjoint(run.block_hashes):
                    self.apply_stored(worker, run.parent_hash, run.block_hashes)

    @property
    def workers(self) -> list[str]:
        return list(self._slot)

    # ---- queries ---------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """worker -> number of leading blocks of ``block_hashes`` it holds (only workers with > 0).

        One walk for all workers along the nodes of the query's path: ``live`` is the AND of the
        masks so far, so it only loses bits; a worker's match ends where its bit drops out.
        """
        out: dict[str, int] = {}
        where, runs, masks, n = self._where, self._run, self._mask, len(block_hashes)
        i = live = 0
        while i < n:
            nid = where.get(block_hashes[i])
            if nid is None or (run := runs[nid])[0] != block_hashes[i]:
                break
            mask = masks[nid] & live if i else masks[nid]
            if mask != live and i:
                self._name_bits(out, live & ~mask, i)
            if not (live := mask):
                break
            k = _agree(block_hashes, i, run, 0)
            i += k
            if k < len(run):
                break  # the query leaves this run partway: nothing below it can match
        if i and live:
            self._name_bits(out, live, i)
        return out

    @property
    def num_entries(self) -> int:
        """(block, worker) entries held, across all workers; never above ``max_entries``."""
        return self._entries

    @property
    def num_nodes(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._where)

    def worker_entries(self, worker: str) -> int:
        slot = self._slot.get(worker)
        return 0 if slot is None else self._counts[slot]

    # ---- updates ---------------------------------------------------------------------------

    def insert(self, worker: str, block_hashes: Sequence[int]) -> int:
        """Record that ``worker`` now holds the chain ``block_hashes`` starting at the root
        (optimistic insert on route). Only the first ``max_entries`` blocks are kept. Returns the
        insert's tick, for ``take_back``."""
        if not block_hashes:
            return self._tick
        slot = self._slot_of(worker)
        self._tick += 1
        self._touch_up(self._hold(slot, None, 0, None, list(block_hashes[: self.max_entries]), False), slot)
        self._evict_over_budget()
        return self._tick

    def take_back(self, worker: str, block_hashes: Sequence[int], tick: int) -> None:
        """Undo an insert made at ``tick`` (the worker refused the request): ``worker`` loses those
        of ``block_hashes`` whose node nothing has touched since, neither another request's insert
        nor a stored event; blocks someone else relies on stay (ticks are per node, so in doubt a
        block stays; a touch that ends partway into a node splits it there, so another prompt that
        shares the first blocks, or a stored event for the first prefill chunk, keeps just those).
        Ticks only grow, and a node's is at least its children's, so what goes is a tail: no hole
        is opened. Blocks a stored event of the worker named stay whatever touched them (the worker
        said it holds them), so ``block_hashes`` may include the prefix the insert found predicted
        there; what goes is what follows the last block that stays. A node another worker holds
        too is judged by ``worker``'s own last touch (another worker's request for the same
        prompt relies on its own bit, not this one's)."""
        slot = self._slot.get(worker, -1)
        bit = 1 << slot if slot >= 0 else 0
        untouched = []
        for h in block_hashes:
            nid = self._where.get(h)
            if nid is None or not self._mask[nid] & bit:
                continue
            ticks = self._ticks.get(nid)
            own = self._touched[nid] if ticks is None else ticks.get(slot, self._touched[nid])
            if own != tick or self._confirmed[nid] & bit:
                untouched.clear()  # NOTE: it stays, so nothing before it may go
            else:
                untouched.append(h)
        if untouched:
            self.apply_removed(worker, untouched)

    def apply_stored(self, worker: str, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        """A worker event: ``worker`` stored the run ``block_hashes`` whose first block follows
        ``parent_hash`` (None or the root hash when the run starts the prompt). Recorded even if
        the index does not hold the parent (see the module docstring). Only the first
        ``max_entries`` blocks of a run are kept."""
        if not block_hashes:
            return
        slot = self._slot_of(worker)
        self._tick += 1
        at = None if parent_hash is None else self._where.get(parent_hash)
        end = 0
        if at is not None:
            run = self._run[at]
            end = len(run) if run[-1] == parent_hash else run.index(parent_hash) + 1
        hashes = list(block_hashes[: self.max_entries])
        # NOTE: touching the run's ancestors keeps them more recent than its leaves.
        # NOTE: the chain above the run is the worker's too: its touch there keeps it from a take-back
        last = self._hold(slot, at, end, parent_hash, hashes, True)
        self._touch_up(last, slot)
        self._merge_up(last)
        self._evict_over_budget()

    def apply_events(
        self, worker: str, stored: Sequence[StoredBlocks], removed: Sequence[int], cleared: bool = False
    ) -> None:
        """One KV event batch of ``worker`` (contract 3): ``cleared``, then ``stored``, then ``removed``."""
        if cleared:
            self.clear_worker(worker)
        for run in stored:
            self.apply_stored(worker, run.parent_hash, run.block_hashes)
        if removed:
            self.apply_removed(worker, removed)

    def apply_removed(self, worker: str, block_hashes: Sequence[int]) -> None:
        """A worker event: ``worker`` no longer holds these blocks. Unknown hashes are ignored."""
        slot = self._slot.get(worker)
        if slot is None:
            return
        bit = 1 << slot
        gone: dict[int, set[int]] = {}
        for h in block_hashes:
            nid = self._where.get(h)
            if nid is not None and self._mask[nid] & bit:
                gone.setdefault(nid, set()).add(h)
        for nid, hashes in gone.items():
            spans: list[list[int]] = []  # [start, end) offsets of removed stretches
            run, k = self._run[nid], len(hashes)
            # NOTE: a run's hashes are distinct, so when its last k are all removed they are the k removed
            # (a worker evicts leaves: the common case); else the whole run is scanned
            if hashes.issuperset(run[len(run) - k :]):
                offsets = range(len(run) - k, len(run))
            elif hashes.issuperset(run[:k]):
                offsets = range(k)
            else:
                offsets = [i for i, h in enumerate(run) if h in hashes]
            for i in offsets:
                if spans and spans[-1][1] == i:
                    spans[-1][1] = i + 1
                else:
                    spans.append([i, i + 1])
            cur = nid
            for start, end in reversed(spans):  # right to left: earlier offsets stay valid
                if end < len(self._run[cur]):
                    cur = self._split(cur, end)[0]
                if start:
                    cur, piece = self._split(cur, start)
                else:
                    piece = cur
                self._lose(piece, slot)

    # ---- internals -------------------------------------------------------------------------

    @property
    def _nodes(self) -> int:
        """Live nodes."""
        return len(self._run)

    def _new_node(
        self, run: array, mask: int, tick: int, parent: int | None, up: int | None, confirmed: int = 0,
        ticks: dict[int, int] | None = None,
    ) -> int:  # fmt: skip
        """A live node with a fresh id (no children yet; the caller links it to its siblings)."""
        nid = next(self._ids)
        self._run[nid], self._mask[nid], self._confirmed[nid], self._touched[nid] = run, mask, confirmed, tick
        if ticks is not None:
            self._ticks[nid] = ticks
        if parent is not None:
            self._parent[nid] = parent
        else:
            self._up[nid] = up
        held = self._held
        for slot in _slots(mask):
            held[slot][nid] = None
        return nid

    def _retire(self, nid: int) -> None:
        """``nid`` is dead (its blocks are dropped or belong to another node): its fields go."""
        held = self._held
        for slot in _slots(self._mask.pop(nid)):
            del held[slot][nid]
        del self._run[nid], self._confirmed[nid], self._touched[nid]
        self._kids.pop(nid, None)
        self._ticks.pop(nid, None)
        self._parent.pop(nid, None)
        self._up.pop(nid, None)

    def _drop_unnamed(self, worker: str, named: set[int]) -> set[int] | None:
        """``worker`` loses its blocks not in ``named``; returns the blocks of ``named`` it does not
        hold as stored (a stored event named them), or None if it holds nothing."""
        slot = self._slot.get(worker)
        if slot is None or not self._counts[slot]:
            return None
        bit, runs, confirmed = 1 << slot, self._run, self._confirmed
        missing = set(named)
        unnamed: list[int] = []
        for nid in self._held[slot]:
            run = runs[nid]
            if confirmed[nid] & bit:
                before = len(missing)
                missing.difference_update(run)
                if before - len(missing) == len(run):  # NOTE: a block lies in one node: all of it is named
                    continue
            unnamed.extend(h for h in run if h not in named)
        if len(unnamed) == self._counts[slot]:
            self.clear_worker(worker)  # NOTE: nothing stays (a new epoch): no per-block removal
        elif unnamed:
            self.apply_removed(worker, unnamed)
        return missing

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
                self._held.append({})
            self._slot[worker] = slot
        return slot

    def _name_bits(self, out: dict[str, int], bits: int, blocks: int) -> None:
        names = self._names
        while bits:
            low = bits & -bits
            out[names[low.bit_length() - 1]] = blocks  # type: ignore[index]
            bits ^= low

    def _count(self, mask: int, delta: int) -> None:
        """Add ``delta`` entries to every worker in ``mask``."""
        counts = self._counts
        while mask:
            low = mask & -mask
            counts[low.bit_length() - 1] += delta
            mask ^= low

    def _hold(
        self, slot: int, at: int | None, end: int, up: int | None, hashes: list[int], stored: bool
    ) -> int:
        """Set ``slot``'s bit on the chain ``hashes``, which follows block ``end - 1`` of node
        ``at`` (None: a parentless run after hash ``up``), and its confirmed bit if ``stored`` (a
        worker event). Touches and returns the last node."""
        bit, where, runs, masks = 1 << slot, self._where, self._run, self._mask
        i, n = 0, len(hashes)
        while i < n:
            nid = where.get(hashes[i])
            if nid is None:  # new blocks from here: one new run (or the extension of ``at``)
                if at is not None and end < len(runs[at]):
                    at = self._split(at, end)[0]
                i += self._new_run(bit, at, up, hashes[i:], stored)
                at = where[hashes[i - 1]]
                end = len(runs[at])
                continue
            run = runs[nid]
            off = 0 if run[0] == hashes[i] else run.index(hashes[i])
            k = _agree(hashes, i, run, off)
            if not masks[nid] & bit:  # the worker gains these k blocks: they get their own node
                if off:
                    nid = self._split(nid, off)[1]
                    off = 0
                if k < len(runs[nid]):
                    nid = self._split(nid, k)[0]
                if nid not in self._ticks:  # NOTE: its holders' last touch is at most its tick
                    self._ticks[nid] = dict.fromkeys(_slots(masks[nid]), self._touched[nid])
                masks[nid] |= bit
                self._held[slot][nid] = None
                self._entries += k
                self._counts[slot] += k
            elif off + k < len(run):  # the chain ends (or leaves) partway: the rest stays untouched
                nid = self._split(nid, off + k)[0]
            if stored:  # NOTE: a run that starts inside the node confirms its prefix there too
                self._confirmed[nid] |= bit
            self._touch_up(nid, slot)  # NOTE: bogus chains may jump between branches
            at, end = nid, off + k
            i += k
        return at  # type: ignore[return-value]

    def _new_run(self, bit: int, at: int | None, up: int | None, run: list[int], stored: bool) -> int:
        """Store blocks new to the index as one run after ``at``; returns how many were new (a
        chain that meets known blocks or repeats a hash is cut there)."""
        where, tick = self._where, self._tick
        # NOTE: a sole holder's leaf grows in place, so a long conversation stays one node.
        extend = (
            at is not None
            and at not in self._kids
            and self._mask[at] == bit
            and bool(self._confirmed[at]) == stored
        )
        owner = (
            at
            if at is not None and extend
            else self._new_node(
                array("Q"), bit, tick, at, None if at is not None else up, bit if stored else 0
            )
        )
        before = len(where)
        deque(map(where.setdefault, run, repeat(owner)), maxlen=0)
        if len(where) - before != len(run):
            run = self._keep_new(run, owner)
        self._run[owner].extend(run)
        if not extend:
            siblings = self._kids.setdefault(at, {}) if at is not None else self._roots.setdefault(up, {})
            siblings[run[0]] = owner
            self._push_leaf(owner)
        self._entries += len(run)
        self._counts[bit.bit_length() - 1] += len(run)
        self._touch_up(owner, bit.bit_length() - 1)
        self._adopt_orphans(run)
        return len(run)

    def _keep_new(self, run: list[int], owner: int) -> list[int]:
        """Slow path of ``_new_run``: keep the leading blocks that were really new."""
        where, held, seen = self._where, set(self._run[owner]), set()
        keep = 0
        for h in run:
            if h in seen or h in held or where[h] != owner:
                break
            seen.add(h)
            keep += 1
        for h in run[keep:]:
            if h not in seen and h not in held and where.get(h) == owner:
                del where[h]
        return run[:keep]

    def _merge_up(self, nid: int) -> None:
        """Join ``nid`` to its parent's run while nothing tells them apart any more: the parent's
        only child, the same holders, each confirmed alike. A worker's next turn is inserted as a
        child of its stored conversation (unconfirmed blocks must not extend a confirmed run);
        once stored, it joins it again, so a long conversation stays one node."""
        masks, confirmed, kids = self._mask, self._confirmed, self._kids
        up = self._parent.get(nid)
        while (
            up is not None
            and len(kids[up]) == 1
            and (masks[up], confirmed[up]) == (masks[nid], confirmed[nid])
        ):
            run = self._run[nid]
            self._run[up].extend(run)
            above, below = self._ticks.get(up), self._ticks.get(nid)
            if above is not None or below is not None:  # NOTE: the later touch of either, in doubt
                self._ticks[up] = {
                    s: max((above or {}).get(s, self._touched[up]), (below or {}).get(s, self._touched[nid]))
                    for s in _slots(masks[up])
                }
            self._where.update(zip(run, repeat(up)))
            below_kids = kids.pop(nid, None)
            if below_kids:
                kids[up] = below_kids
                for child in below_kids.values():
                    self._parent[child] = up
            else:
                del kids[up]
                self._push_leaf(up)
            self._retire(nid)  # NOTE: dead: the heap skips its id
            nid, up = up, self._parent.get(up)

    def _adopt_orphans(self, run: list[int]) -> None:
        """Parentless runs waiting under a hash of ``run`` become children of its node."""
        roots, where = self._roots, self._where
        if len(roots) <= len(run):
            ups = [u for u in roots if u is not None and u in where]
        else:
            ups = [h for h in run if h in roots]
        for up in ups:
            nid = where[up]
            pos = self._run[nid].index(up) + 1
            if pos < len(self._run[nid]):
                nid = self._split(nid, pos)[0]
            top = nid
            while top in self._parent:
                top = self._parent[top]
            waiting = roots.pop(up)
            for first, orphan in list(waiting.items()):
                if orphan == top:  # inconsistent chains: adopting would make a cycle
                    continue
                del waiting[first], self._up[orphan]
                self._parent[orphan] = nid
                self._kids.setdefault(nid, {})[first] = orphan
            if waiting:
                roots[up] = waiting

    def _split(self, nid: int, k: int) -> tuple[int, int]:
        """Cut ``nid``'s run before offset ``k`` (0 < k < len); returns (head, tail). The new node
        takes the shorter half, so only that half's hashes are re-pointed in ``_where``."""
        run, mask, tick, confirmed = self._run[nid], self._mask[nid], self._touched[nid], self._confirmed[nid]
        ticks = self._ticks.get(nid)
        if 2 * k <= len(run):
            head = self._new_node(
                run[:k], mask, tick, self._parent.get(nid), self._up.get(nid), confirmed, _copy(ticks)
            )
            del run[:k]
            self._siblings(head)[self._run[head][0]] = head
            self._kids[head] = {run[0]: nid}
            self._parent[nid] = head
            self._up.pop(nid, None)
            self._where.update(zip(self._run[head], repeat(head)))
            return head, nid
        tail = self._new_node(run[k:], mask, tick, nid, None, confirmed, _copy(ticks))
        del run[k:]
        below_kids = self._kids.get(nid)
        if below_kids:
            self._kids[tail] = below_kids
            for child in below_kids.values():
                self._parent[child] = tail
        self._kids[nid] = {self._run[tail][0]: tail}
        self._where.update(zip(self._run[tail], repeat(tail)))
        if tail not in self._kids:
            self._push_leaf(tail)
        return nid, tail

    def _drop(self, nid: int) -> None:
        """Remove a live node for every worker; its children become orphans under its last hash."""
        run, mask, kids, where = self._run[nid], self._mask[nid], self._kids.get(nid), self._where
        deque(map(where.pop, run), maxlen=0)
        self._entries -= len(run) * mask.bit_count()
        self._count(mask, -len(run))
        siblings, parent, up = self._siblings(nid), self._parent.get(nid), self._up.get(nid)
        self._retire(nid)
        del siblings[run[0]]
        if parent is None and not siblings:
            del self._roots[up]
        elif parent is not None and not siblings:
            del self._kids[parent]
            self._push_leaf(parent)
        if kids:
            orphans = self._roots.setdefault(run[-1], {})
            for first, child in kids.items():
                del self._parent[child]
                self._up[child] = run[-1]
                orphans[first] = child

    def _siblings(self, nid: int) -> dict[int, int]:
        """The dict that holds ``nid``: its parent's children, or its ``_roots`` entry."""
        parent = self._parent.get(nid)
        return self._kids[parent] if parent is not None else self._roots[self._up[nid]]

    def _touch_up(self, nid: int | None, slot: int) -> None:
        """Mark ``nid`` and its ancestors as used now, by the worker in ``slot`` (its own tick too,
        where a node keeps its holders' ``ticks``); stops at an ancestor already marked in this
        operation, so touching many nodes of one path costs O(path)."""
        tick, bit, first = self._tick, 1 << slot, True
        touched, parents, all_ticks = self._touched, self._parent, self._ticks
        while nid is not None and (first or touched[nid] != tick):
            touched[nid] = tick
            ticks = all_ticks.get(nid)
            if ticks is not None and self._mask[nid] & bit:
                ticks[slot] = tick
            nid, first = parents.get(nid), False

    def _lose(self, nid: int, slot: int) -> None:
        """The worker in ``slot`` no longer holds ``nid``'s blocks."""
        bit = 1 << slot
        if self._mask[nid] == bit:
            self._drop(nid)
            return
        self._mask[nid] ^= bit
        del self._held[slot][nid]
        self._confirmed[nid] &= ~bit
        ticks = self._ticks.get(nid)
        if ticks is not None:
            ticks.pop(slot, None)
        self._entries -= len(self._run[nid])
        self._counts[slot] -= len(self._run[nid])

    def _push_leaf(self, nid: int) -> None:
        leaves = self._leaves
        heapq.heappush(leaves, (self._touched[nid], next(self._seq), nid))
        if len(leaves) > 2 * self._nodes + 1024:  # mostly stale entries: rebuild, amortised O(1)
            touched = self._touched
            self._leaves = [(touched[n], next(self._seq), n) for n in touched if n not in self._kids]
            heapq.heapify(self._leaves)

    def _evict_over_budget(self) -> None:
        while self._entries > self.max_entries and self._leaves:
            tick, _, nid = heapq.heappop(self._leaves)
            if nid not in self._run or nid in self._kids:
                continue  # dropped, or no longer a leaf
            if tick != self._touched[nid]:
                self._push_leaf(nid)  # touched since it was queued
                continue
            run, mask = self._run[nid], self._mask[nid]
            holders = mask.bit_count()
            blocks = -(-(self._entries - self.max_entries) // holders)
            if blocks >= len(run):
                self._drop(nid)
                continue
            tail = run[-blocks:]
            del run[-blocks:]
            deque(map(self._where.pop, tail), maxlen=0)
            self._entries -= blocks * holders
            self._count(mask, -blocks)
            self._push_leaf(nid)
