"""RadixAttention: a radix tree over token ids whose nodes own full KV pages, with lock refs,
LRU eviction and KV events (contract 3). It never evicts a locked node, never caches a partial
page, and never frees a page it does not own.

Invariants (checked by ``check_invariants`` and the tests):
  1. allocator free pages + tree pages + pages owned by running requests = pool size.
  2. evictable_pages + protected_pages = total_pages = pages of all nodes; a node's pages are
     protected iff its lock_ref > 0.
  3. a node with lock_ref > 0 has every ancestor with lock_ref > 0; locked nodes are never evicted.
  4. a node's key holds len(pages) * page_size tokens (int32), at least one page; children are
     keyed by the bytes of their first page, so siblings differ in their first page.
  5. with events on, node.hashes[i] is the chained block hash of page i (router.block_hash),
     continuing from the parent's last hash (the namespace root hash under the root).

Event rule (``drain_events``): a drain returns (stored, removed, cleared) meant to be applied as
cleared, then stored, then removed. A hash is in ``removed`` only if its last event before the
drain was a removal: storing a hash drops it from the pending removals, so a store that follows
a removal is never lost; a hash stored then removed may appear in both lists, which the
application order resolves to "removed", its true final state.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

import numpy as np

from router.block_hash import block_hashes, root_hash
from router.kv_events import StoredBlocks
from worker.kv_pool import PageAllocator

_INT32_MAX = np.iinfo(np.int32).max
_EMPTY_PAGES = np.zeros(0, dtype=np.int64)


def _page_hashes(key: np.ndarray, page_size: int, parent_hash: int) -> list[int]:
    """Chained block hashes of ``key``'s pages (router.block_hash), fed as a native uint32 array:
    several times cheaper than a list of Python ints for long keys."""
    return block_hashes(array("I", key.tobytes()), page_size, parent=parent_hash)


class TreeNode:
    """One edge of the radix tree: a run of whole pages and the tokens they hold."""

    __slots__ = ("children", "hashes", "key", "last_access", "lock_ref", "pages", "parent", "removed")

    def __init__(
        self,
        key: np.ndarray,
        pages: np.ndarray,
        parent: TreeNode | None,
        hashes: list[int] | None,
        last_access: int,
    ) -> None:
        self.key = key  # int32 tokens, len(pages) * page_size of them
        self.pages = pages  # int64 page ids
        self.hashes = hashes  # one block hash per page; None when events are off
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}  # keyed by first page's token bytes
        self.lock_ref = 0
        self.last_access = last_access  # logical clock tick, not seconds
        self.removed = False  # evicted: a stale MatchResult must not lock it

    def __repr__(self) -> str:
        return f"TreeNode(pages={len(self.pages)}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    pages: np.ndarray  # int64 page ids of the cached prefix, in order
    num_tokens: int  # len(pages) * page_size; <= len(token_ids) - 1 so >= 1 token is left to compute
    last_node: TreeNode  # deepest node of the match: pass to lock()/unlock()


class RadixCache:
    """Prefix cache of full pages. Callers lock what they read (between match and insert too) and
    own their pages until they insert them. Not thread-safe: one engine thread owns it."""

    # NOTE: if nobody drains for this many pending block events, the pending events are dropped
    # and the next drain returns (snapshot(), [], cleared=True): always correct, bounded memory.
    MAX_PENDING_BLOCKS = 1 << 18

    def __init__(
        self, allocator: PageAllocator, page_size: int, namespace: str = "", enable_events: bool = True
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.namespace = namespace
        self.enable_events = enable_events
        self._root_hash = root_hash(namespace)
        self.root = TreeNode(np.zeros(0, dtype=np.int32), _EMPTY_PAGES, None, [], 0)
        self._clock = 0
        self._evictable = 0  # pages in nodes with lock_ref == 0
        self._protected = 0  # pages in nodes with lock_ref > 0
        self._num_nodes = 0  # excluding the root
        # Lazy LRU heap of (last_access, seq, node); an entry is live iff the node is still in the
        # tree, an unlocked leaf, and its last_access equals the entry's. Stale entries are skipped.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._seq = 0
        self._pending_stored: list[StoredBlocks] = []
        self._pending_removed: dict[int, None] = {}  # ordered set of hashes
        self._pending_cleared = False
        self._pending_blocks = 0
        self._overflowed = False

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        return self._evictable + self._protected

    # ------------------------------------------------------------------ lookup
    def _tokens(self, token_ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(token_ids, dtype=np.int32).reshape(-1)

    def match_prefix(self, token_ids: np.ndarray) -> MatchResult:
        """Longest cached run of whole pages that prefixes ``token_ids``, leaving at least one
        token uncached. Refreshes the LRU time of the matched path. Pass int32 for speed."""
        tokens = self._tokens(token_ids)
        ps = self.page_size
        limit = max(0, (tokens.size - 1) // ps * ps)  # tokens that may match
        self._clock += 1
        now = self._clock
        node = self.root
        pos = 0
        found: list[np.ndarray] = []
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                break
            n = min(child.key.size, limit - pos)
            matched = self._common_pages(child.key[:n], tokens[pos : pos + n])
            if matched < child.pages.size:
                child = self._split(child, matched)
            child.last_access = now
            found.append(child.pages)
            pos += matched * ps
            node = child
            if matched * ps < n:
                break
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)
        pages = np.concatenate(found) if found else _EMPTY_PAGES
        return MatchResult(pages=pages, num_tokens=pos, last_node=node)

    def cached_prefix_len(self, token_ids: np.ndarray) -> int:
        """What ``match_prefix`` would match, in tokens, without touching the tree: no node split,
        no LRU refresh (an estimate for a queued request is no use of its pages)."""
        tokens = self._tokens(token_ids)
        ps = self.page_size
        limit = max(0, (tokens.size - 1) // ps * ps)
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                break
            n = min(child.key.size, limit - pos)
            matched = self._common_pages(child.key[:n], tokens[pos : pos + n]) * ps
            pos += matched
            if matched < child.key.size:
                break
            node = child
        return pos

    def _common_pages(self, a: np.ndarray, b: np.ndarray) -> int:
        """Whole pages on which equal-length int32 runs ``a`` and ``b`` agree, from the start."""
        diff = a != b
        if not diff.any():
            return a.size // self.page_size
        return int(diff.argmax()) // self.page_size

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``node`` after ``num_pages`` pages; returns the new upper node. ``node`` keeps the
        lower part and its children, so heap entries and MatchResults pointing at it stay right."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < num_pages < node.pages.size
        hashes = node.hashes
        # NOTE: halves are copies, not views, so evicting one never pins the other's old buffer.
        upper = TreeNode(
            node.key[:cut].copy(),
            node.pages[:num_pages].copy(),
            parent,
            None if hashes is None else hashes[:num_pages],
            node.last_access,
        )
        upper.lock_ref = node.lock_ref  # same requests hold both halves
        parent.children[upper.key[: self.page_size].tobytes()] = upper
        node.key = node.key[cut:].copy()
        node.pages = node.pages[num_pages:].copy()
        node.hashes = None if hashes is None else hashes[num_pages:]
        node.parent = upper
        upper.children[node.key[: self.page_size].tobytes()] = node
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: np.ndarray, pages: np.ndarray) -> int:
        """Cache ``token_ids`` (a whole number of pages) held in ``pages``.

        Returns how many leading tokens were already cached: the tree keeps its own pages for
        those and the caller frees its duplicates among them; the remaining pages now belong to
        the tree. The new run is unlocked: a caller still reading it must lock it (match again).
        """
        ps = self.page_size
        raw = np.asarray(token_ids).reshape(-1)
        if raw.size % ps:
            raise ValueError(f"insert needs whole pages: {raw.size} tokens, page_size {ps}")
        if raw.size and (raw.min() < 0 or raw.max() > _INT32_MAX):
            raise ValueError("token ids must be in [0, 2**31)")
        tokens = self._tokens(raw)
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        if pages.size != tokens.size // ps:
            raise ValueError(f"{tokens.size} tokens need {tokens.size // ps} pages, got {pages.size}")
        self._clock += 1
        now = self._clock
        node = self.root
        pos = 0
        while pos < tokens.size:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                self._add_leaf(node, tokens[pos:].copy(), pages[pos // ps :].copy(), now)
                return pos
            n = min(child.key.size, tokens.size - pos)
            matched = self._common_pages(child.key[:n], tokens[pos : pos + n])
            if matched < child.pages.size:
                child = self._split(child, matched)
            child.last_access = now
            pos += matched * ps
            node = child
        if node is not self.root and not node.children and node.lock_ref == 0:
            self._push(node)
        return pos

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, pages: np.ndarray, now: int) -> None:
        hashes = None
        if self.enable_events:
            parent_hash = parent.hashes[-1] if parent is not self.root else self._root_hash
            hashes = _page_hashes(key, self.page_size, parent_hash)
            self._emit_stored(StoredBlocks(list(hashes), parent_hash, key.tolist()))
        leaf = TreeNode(key, pages, parent, hashes, now)
        parent.children[key[: self.page_size].tobytes()] = leaf
        self._num_nodes += 1
        self._evictable += pages.size
        self._push(leaf)

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (lock ref +1 on each)."""
        if node.removed:
            raise ValueError("cannot lock a node that was evicted")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= node.pages.size
                self._protected += node.pages.size
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock(node)``; raises ValueError if ``node`` is not locked."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError("unlock of a node that is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += node.pages.size
                self._protected -= node.pages.size
                if not node.children:
                    self._push(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def _push(self, node: TreeNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.lock_ref == 0:
                self._seq += 1
                self._heap.append((node.last_access, self._seq, node))
        heapq.heapify(self._heap)

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from the least recently used unlocked leaves (a leaf is
        trimmed from its tail when only part of it is needed; a parent whose children are all gone
        becomes a leaf). Returns pages freed: less than asked only when nothing else is evictable."""
        freed = 0
        while freed < num_pages and self._heap:
            access, _, node = self._heap[0]
            if node.removed or node.children or node.lock_ref or node.last_access != access:
                heapq.heappop(self._heap)
                continue
            take = min(num_pages - freed, node.pages.size)
            keep = node.pages.size - take
            first_page = node.key[: self.page_size].tobytes()
            self.allocator.free(node.pages[keep:])
            if node.hashes is not None:
                self._emit_removed(node.hashes[keep:])
                node.hashes = node.hashes[:keep]
            node.pages = node.pages[:keep].copy()
            node.key = node.key[: keep * self.page_size].copy()
            self._evictable -= take
            freed += take
            if keep:
                continue  # NOTE: all asked-for pages are freed; the trimmed leaf keeps its heap entry
            heapq.heappop(self._heap)
            parent = node.parent
            del parent.children[first_page]
            node.removed = True
            node.parent = None
            self._num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return freed

    def flush(self) -> int:
        """Evict everything evictable; returns pages freed. If the tree ends up empty, the next
        drain reports ``cleared`` instead of one removal per block."""
        freed = self.evict(self.total_pages)
        if self.total_pages == 0 and self.enable_events:
            self._pending_stored.clear()
            self._pending_removed.clear()
            self._pending_blocks = 0
            self._pending_cleared = True
            self._overflowed = False
        return freed

    # ------------------------------------------------------------------ events
    def _emit_stored(self, run: StoredBlocks) -> None:
        if self._overflowed:
            return
        pending_removed = self._pending_removed
        if pending_removed:
            for h in run.block_hashes:
                pending_removed.pop(h, None)
        self._pending_stored.append(run)
        self._count_pending(len(run.block_hashes))

    def _emit_removed(self, hashes: list[int]) -> None:
        if self._overflowed:
            return
        for h in reversed(hashes):  # deepest block first
            self._pending_removed[h] = None
        self._count_pending(len(hashes))

    def _count_pending(self, n: int) -> None:
        self._pending_blocks += n
        if self._pending_blocks > self.MAX_PENDING_BLOCKS:
            self._overflowed = True
            self._pending_stored.clear()
            self._pending_removed.clear()

    def drain_events(self) -> tuple[list[StoredBlocks], list[int], bool]:
        """(stored runs, removed hashes, cleared) since the last drain; apply as cleared, then
        stored, then removed (see the event rule in the module docstring)."""
        if self._overflowed:
            out = (self.snapshot(), [], True)
        else:
            out = (self._pending_stored, list(self._pending_removed), self._pending_cleared)
        self._pending_stored = []
        self._pending_removed = {}
        self._pending_cleared = False
        self._pending_blocks = 0
        self._overflowed = False
        return out

    def snapshot(self) -> list[StoredBlocks]:
        """The tree's contents as stored runs, parents before children."""
        out: list[StoredBlocks] = []
        stack: list[tuple[TreeNode, int]] = [(c, self._root_hash) for c in self.root.children.values()]
        while stack:
            node, parent_hash = stack.pop()
            hashes = node.hashes
            if hashes is None:  # events off: hash on demand
                hashes = _page_hashes(node.key, self.page_size, parent_hash)
            out.append(StoredBlocks(list(hashes), parent_hash, node.key.tolist()))
            stack.extend((c, hashes[-1]) for c in node.children.values())
        return out

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests and debugging only)."""
        ps = self.page_size
        evictable = protected = nodes = 0
        all_pages: list[np.ndarray] = []
        live_entries = {(id(n), t) for t, _, n in self._heap}
        stack: list[tuple[TreeNode, int]] = [(c, self._root_hash) for c in self.root.children.values()]
        for k, c in self.root.children.items():
            assert k == c.key[:ps].tobytes(), "root child keyed by a page that is not its first"
        while stack:
            node, parent_hash = stack.pop()
            nodes += 1
            parent = node.parent
            assert parent is not None and not node.removed, "node in tree marked removed"
            assert node.pages.size >= 1, "node without pages"
            assert node.key.dtype == np.int32 and node.key.size == node.pages.size * ps, "key/pages mismatch"
            assert node.lock_ref >= 0, "negative lock_ref"
            if node.lock_ref > 0:
                assert parent is self.root or parent.lock_ref > 0, "locked node under unlocked parent"
                protected += node.pages.size
            else:
                evictable += node.pages.size
            if node.lock_ref == 0 and not node.children:
                assert (id(node), node.last_access) in live_entries, "evictable leaf missing from LRU heap"
            all_pages.append(node.pages)
            if self.enable_events:
                expect = block_hashes(node.key.tolist(), ps, parent=parent_hash)
                assert node.hashes == expect, "stored block hashes differ from router.block_hash"
            # every lock on a descendant also counts on this node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), (
                "lock_ref below children's"
            )
            for k, c in node.children.items():
                assert c.parent is node, "child's parent pointer is wrong"
                assert k == c.key[:ps].tobytes(), "child keyed by a page that is not its first"
            last = node.hashes[-1] if node.hashes else 0
            stack.extend((c, last) for c in node.children.values())
        assert evictable == self._evictable, f"evictable count {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected count {self._protected} != {protected}"
        assert nodes == self._num_nodes, f"node count {self._num_nodes} != {nodes}"
        if all_pages:
            pages = np.concatenate(all_pages)
            assert np.unique(pages).size == pages.size, "a page is owned by two nodes"
            assert not self.allocator.is_free(pages).any(), "a tree page is also free in the allocator"
