"""RadixAttention: a radix tree over token ids whose nodes own full KV pages, with lock refs,
LRU eviction, an optional host-memory tier and KV events (contract 3). It never evicts a locked
node, never caches a partial page, and never frees a page it does not own.

A node's pages live on the device (``pages``) or, with a host tier, in host memory
(``host_pages``): evicting a device leaf copies it to the host instead of dropping it, and a match
that reaches host nodes lists them so the caller can ``load_back`` them (a copy, not a prefill).
Host leaves are dropped LRU-first when the host tier is full. KV events follow the tree, not the
tier: a block is stored when it enters the tree and removed when it leaves both tiers.

Invariants (checked by ``check_invariants`` and the tests):
  1. allocator free pages + device tree pages + pages owned by running requests = pool size;
     host allocator free pages + host tree pages = host pool size.
  2. evictable_pages + protected_pages = total_pages = device pages of all nodes; a node's pages
     are protected iff its lock_ref > 0.
  3. a node with lock_ref > 0 has every ancestor with lock_ref > 0; locked nodes are never evicted.
  4. a node's key holds a whole number (>= 1) of pages of tokens (int32), all on the device or all
     on the host; a device node's parent is the root or a device node (host nodes hang below);
     children are keyed by the bytes of their first page, so siblings differ in their first page.
  5. with events on, node.hashes[i] is the chained block hash of page i (router.block_hash),
     continuing from the parent's last hash (the namespace root hash under the root).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from router.block_hash import root_hash
from router.kv_events import StoredBlocks
from worker.cache_events import CacheEventLog
from worker.host_cache import HostKVPool
from worker.kv_pool import PageAllocator
from worker.radix_node import ADAPTER_SHIFT, EMPTY_PAGES, TOKEN_MASK, MatchResult, TreeNode, page_hashes

__all__ = ["MatchResult", "RadixCache", "TreeNode"]

_INT32_MAX = np.iinfo(np.int32).max


class RadixCache:
    """Prefix cache of full pages. Callers lock what they read (between match and insert too) and
    own their pages until they insert them. Not thread-safe: one engine thread owns it."""

    def __init__(
        self, allocator: PageAllocator, page_size: int, namespace: str = "", enable_events: bool = True,
        host: HostKVPool | None = None, adapters: Sequence[str] = (),
    ) -> None:  # fmt: skip
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.namespace = namespace
        self.enable_events = enable_events
        self.host = host
        self.events = CacheEventLog()
        self._root_hash = root_hash(namespace)
        # NOTE: namespace i's subtrees (keys from radix_node.adapter_keys) hash from its own root: LoRA
        # adapter i's (1, 2, ...), or a cache salt's (worker.cache_salt, from the top of the id range)
        self._roots = {0: self._root_hash, **{i: root_hash(a) for i, a in enumerate(adapters, 1)}}
        self._adapters = len(adapters)
        self.root = TreeNode(np.zeros(0, dtype=np.int32), EMPTY_PAGES, None, [], 0)
        self._clock = 0
        self._evictable = 0  # device pages in nodes with lock_ref == 0
        self._protected = 0  # device pages in nodes with lock_ref > 0
        self._host_pages = 0  # host pages in nodes
        self._num_nodes = 0  # excluding the root
        self.evicted_pages = 0  # device pages evicted for room (make_room), in all
        # Lazy LRU heaps of (last_access, seq, node), one per tier; an entry is live iff the node is
        # still in the tree, an unlocked leaf of its tier, and its last_access equals the entry's.
        # A device leaf has no device child (host children are fine). Stale entries are skipped.
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._host_heap: list[tuple[int, int, TreeNode]] = []
        self._seq = 0
        self.offloaded_pages = 0  # device pages copied to the host tier on eviction (cumulative)
        self.loaded_pages = 0  # host pages copied back to the device for a match (cumulative)
        self.host_dropped_pages = 0  # host pages dropped to make room (cumulative)

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def protected_pages(self) -> int:
        return self._protected

    @property
    def total_pages(self) -> int:
        """Device pages held by the tree."""
        return self._evictable + self._protected

    @property
    def host_pages(self) -> int:
        """Host pages held by the tree."""
        return self._host_pages

    # ------------------------------------------------------------------ lookup
    def _tokens(self, token_ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(token_ids, dtype=np.int32).reshape(-1)

    def match_prefix(self, token_ids: np.ndarray) -> MatchResult:
        """Longest cached run of whole pages that prefixes ``token_ids``, leaving at least one
        token uncached; its device part first, then its host part (``host_nodes``). Refreshes the
        LRU time of the matched path. Pass int32 for speed."""
        tokens = self._tokens(token_ids)
        ps = self.page_size
        limit = max(0, (tokens.size - 1) // ps * ps)  # tokens that may match
        self._clock += 1
        now = self._clock
        node = device_node = self.root
        pos = 0
        found: list[np.ndarray] = []
        host_nodes: list[TreeNode] = []
        while pos < limit:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                break
            n = min(child.key.size, limit - pos)
            matched = self._common_pages(child.key[:n], tokens[pos : pos + n])
            if matched * ps < child.key.size:
                child = self._split(child, matched)
            child.last_access = now
            if child.on_device:
                found.append(child.pages)
                device_node = child
            else:
                host_nodes.append(child)
            pos += matched * ps
            node = child
            if matched * ps < n:
                break
        self._push_if_leaf(device_node)
        if host_nodes:
            self._push_if_leaf(node)
        pages = np.concatenate(found) if found else EMPTY_PAGES
        return MatchResult(pages=pages, num_tokens=pos, last_node=node, host_nodes=host_nodes)

    def cached_prefix_len(self, token_ids: np.ndarray) -> int:
        """What ``match_prefix`` would match (both tiers), in tokens, without touching the tree:
        no node split, no LRU refresh (an estimate for a queued request is no use of its pages)."""
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
        """Cut ``node`` after ``num_pages`` pages; returns the new upper node (same tier). ``node``
        keeps the lower part and its children, so heap entries and MatchResults stay right."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None and 0 < cut < node.key.size
        hashes = node.hashes
        # NOTE: halves are copies, not views, so evicting one never pins the other's old buffer.
        upper = TreeNode(
            node.key[:cut].copy(),
            node.pages[:num_pages].copy(),
            parent,
            None if hashes is None else hashes[:num_pages],
            node.last_access,
            node.host_pages[:num_pages].copy(),
        )
        upper.lock_ref = node.lock_ref  # same requests hold both halves
        upper.device_children = int(node.on_device)  # NOTE: it replaces node among parent's children
        parent.children[upper.key[: self.page_size].tobytes()] = upper
        node.key = node.key[cut:].copy()
        node.pages = node.pages[num_pages:].copy()
        node.host_pages = node.host_pages[num_pages:].copy()
        node.hashes = None if hashes is None else hashes[num_pages:]
        node.parent = upper
        upper.children[node.key[: self.page_size].tobytes()] = node
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: np.ndarray, pages: np.ndarray) -> int:
        """Cache ``token_ids`` (a whole number of pages) held in ``pages``.

        Returns how many leading tokens the tree already had on the device: it keeps its own pages
        for those and the caller frees its duplicates among them; the remaining pages now belong
        to the tree (a host node on the path takes the caller's pages and drops its host copy).
        The new run is unlocked: a caller still reading it must lock it (match again).
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
        on_device = None  # tokens the tree had on the device, once the walk leaves the device part
        while pos < tokens.size:
            child = node.children.get(tokens[pos : pos + ps].tobytes())
            if child is None:
                self._add_leaf(node, tokens[pos:].copy(), pages[pos // ps :].copy(), now)
                return pos if on_device is None else on_device
            n = min(child.key.size, tokens.size - pos)
            matched = self._common_pages(child.key[:n], tokens[pos : pos + n])
            if matched * ps < child.key.size:
                child = self._split(child, matched)
            child.last_access = now
            if not child.on_device:
                on_device = pos if on_device is None else on_device
                self._promote(child, pages[pos // ps : pos // ps + matched].copy())
            pos += matched * ps
            node = child
        self._push_if_leaf(node)
        return pos if on_device is None else on_device

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, pages: np.ndarray, now: int) -> None:
        hashes = None
        if self.enable_events:
            tokens, parent_hash = self.event_view(key, parent.hashes[-1] if parent is not self.root else None)
            hashes = page_hashes(tokens, self.page_size, parent_hash)
            self.events.stored(StoredBlocks(list(hashes), parent_hash, tokens.tolist()))
        leaf = TreeNode(key, pages, parent, hashes, now)
        parent.children[key[: self.page_size].tobytes()] = leaf
        parent.device_children += 1
        self._num_nodes += 1
        self._evictable += pages.size
        self._push(leaf)

    # ------------------------------------------------------------------ host tier
    def _promote(self, node: TreeNode, pages: np.ndarray) -> None:
        """Host node ``node`` now lives in device ``pages`` (already holding its KV)."""
        self.host.allocator.free(node.host_pages)  # type: ignore[union-attr]
        self._host_pages -= node.host_pages.size
        node.host_pages = EMPTY_PAGES
        node.pages = pages
        node.parent.device_children += 1  # type: ignore[union-attr]
        if node.lock_ref:
            self._protected += pages.size
        else:
            self._evictable += pages.size
        self._push_if_leaf(node)

    def load_back(self, match: MatchResult) -> np.ndarray:
        """Copy the match's host part to the device; returns the device pages of the whole match.
        The caller locked ``match.last_node`` and made sure enough device pages are free."""
        out = [match.pages]
        for node in match.host_nodes:
            assert not node.removed and not node.on_device and node.lock_ref > 0, (
                "load_back needs the match locked"
            )
            pages = self.allocator.alloc(node.host_pages.size)
            assert pages is not None, "caller must ensure free pages first"
            self.host.load(node.host_pages, pages)  # type: ignore[union-attr]
            self.loaded_pages += pages.size
            self._promote(node, pages)
            out.append(pages)
        return np.concatenate(out)

    def _offload(self, node: TreeNode) -> bool:
        """Move unlocked device leaf ``node`` to the host tier, dropping host leaves LRU-first for
        room; False when no room can be made (too large, or the rest is locked): the caller drops it."""
        host = self.host
        if host is None or node.pages.size > host.num_pages:
            return False
        short = node.pages.size - host.allocator.num_free
        if short > 0:
            self._drop_host(short)
        host_pages = host.allocator.alloc(node.pages.size)
        if host_pages is None:
            return False
        host.save(node.pages, host_pages)
        self.allocator.free(node.pages)
        self.offloaded_pages += node.pages.size
        self._evictable -= node.pages.size
        self._host_pages += host_pages.size
        node.pages, node.host_pages = EMPTY_PAGES, host_pages
        node.parent.device_children -= 1  # type: ignore[union-attr]
        self._push_if_leaf(node)
        return True

    def _drop_host(self, num_pages: int) -> int:
        """Drop least recently used unlocked host leaves until ``num_pages`` host pages are freed
        (or none is left); returns host pages freed."""
        freed = 0
        while freed < num_pages and self._host_heap:
            access, _, node = heapq.heappop(self._host_heap)
            if node.removed or node.on_device or node.children or node.lock_ref or node.last_access != access:
                continue
            freed += node.host_pages.size
            self._drop(node)
        return freed

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
                self._push_if_leaf(node)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def _is_leaf(self, node: TreeNode) -> bool:
        """A leaf of its tier: a device node without device children, a host node without children."""
        return not (node.device_children if node.on_device else node.children)

    def _push_if_leaf(self, node: TreeNode) -> None:
        if node is not self.root and node.lock_ref == 0 and self._is_leaf(node):
            self._push(node)

    def _push(self, node: TreeNode) -> None:
        self._seq += 1
        heapq.heappush(self._heap if node.on_device else self._host_heap, (node.last_access, self._seq, node))
        if len(self._heap) + len(self._host_heap) > 2 * self._num_nodes + 1024:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        self._heap, self._host_heap = [], []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.lock_ref == 0 and self._is_leaf(node):
                self._seq += 1
                (self._heap if node.on_device else self._host_heap).append(
                    (node.last_access, self._seq, node)
                )
        heapq.heapify(self._heap)
        heapq.heapify(self._host_heap)

    def make_room(self, num_pages: int) -> int:
        """Evict (``evict``) what it takes for ``num_pages`` free device pages, as far as anything
        is evictable; returns the pages evicted. The caller checks ``allocator.num_free``."""
        short = num_pages - self.allocator.num_free
        freed = self.evict(short) if short > 0 else 0
        self.evicted_pages += freed
        return freed

    def evict(self, num_pages: int, offload: bool = True) -> int:
        """Free up to ``num_pages`` device pages from the least recently used unlocked device
        leaves: with a host tier (and ``offload``) they move to host memory, else they leave the
        tree. A leaf is cut when only part of it is needed; a parent whose device children are
        all gone becomes a leaf. Returns pages freed: less only when nothing else is evictable."""
        freed = 0
        while freed < num_pages and self._heap:
            access, _, node = self._heap[0]
            if (
                node.removed or not node.on_device or node.lock_ref or node.last_access != access
                or not self._is_leaf(node)
            ):  # fmt: skip
                heapq.heappop(self._heap)
                continue
            take = min(num_pages - freed, node.pages.size)
            if take < node.pages.size:
                self._split(node, node.pages.size - take)  # NOTE: node keeps the tail, its entry stays live
            heapq.heappop(self._heap)
            parent = node.parent
            if not (offload and self._offload(node)):
                self._drop(node)
            freed += take
            self._push_if_leaf(parent)  # type: ignore[arg-type]
        return freed

    def _drop(self, node: TreeNode) -> int:
        """Remove unlocked ``node`` and its whole subtree from the tree, freeing their pages;
        returns the device pages freed."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[: self.page_size].tobytes()]
        parent.device_children -= int(node.on_device)  # NOTE: the rest of the subtree is on the host
        stack, subtree = [node], []
        while stack:
            n = stack.pop()
            subtree.append(n)
            stack.extend(n.children.values())
        freed = 0
        for n in reversed(subtree):  # deepest first, as removal events should go
            assert n.lock_ref == 0, "dropping a locked node"
            if n.hashes is not None:
                self.events.removed(n.hashes)
            if n.pages.size:
                self.allocator.free(n.pages)
                self._evictable -= n.pages.size
                freed += n.pages.size
            if n.host_pages.size:
                self.host.allocator.free(n.host_pages)  # type: ignore[union-attr]
                self._host_pages -= n.host_pages.size
                self.host_dropped_pages += n.host_pages.size
            n.removed = True
            n.parent = None
            n.children = {}
            self._num_nodes -= 1
        self._push_if_leaf(parent)
        return freed

    def flush(self) -> tuple[int, int]:
        """Drop everything no request holds, in both tiers; returns the (device, host) pages freed.
        If the tree ends up empty, the next drain reports ``cleared`` instead of one removal per
        block."""
        host_before, for_room = self._host_pages, self.host_dropped_pages
        # NOTE: dropping a device leaf drops its host-only descendants too, so host pages freed are
        # counted as the tier's change, not from _drop_host's return
        freed = self.evict(self.total_pages, offload=False)
        self._drop_host(self._host_pages)
        self.host_dropped_pages = for_room  # NOTE: a flush's drops are not for room
        if self.total_pages == 0 and self._host_pages == 0 and self.enable_events:
            self.events.cleared()
        return freed, host_before - self._host_pages

    # ------------------------------------------------------------------ events
    def drain_events(self) -> tuple[list[StoredBlocks], list[int], bool]:
        """(stored runs, removed hashes, cleared) since the last drain; apply as cleared, then
        stored, then removed (worker.cache_events)."""
        return self.events.drain(self.snapshot)

    def snapshot(self) -> list[StoredBlocks]:
        """The tree's contents as stored runs, parents before children."""
        out: list[StoredBlocks] = []
        stack: list[tuple[TreeNode, int | None]] = [(c, None) for c in self.root.children.values()]
        while stack:
            node, parent = stack.pop()
            tokens, parent_hash = self.event_view(node.key, parent)
            hashes = node.hashes
            if hashes is None:  # events off: hash on demand
                hashes = page_hashes(tokens, self.page_size, parent_hash)
            out.append(StoredBlocks(list(hashes), parent_hash, tokens.tolist()))
            stack.extend((c, hashes[-1]) for c in node.children.values())
        return out

    def drop_namespace(self, space: int) -> int:
        """Remove namespace ``space``'s subtrees (a LoRA adapter unloaded, a cache salt's space given to
        another: none of it is locked), both tiers, with their removal events; returns device pages freed."""
        doomed = [c for c in self.root.children.values() if int(c.key[0]) >> ADAPTER_SHIFT == space]
        for_room = self.host_dropped_pages
        freed = sum(self._drop(node) for node in doomed)
        self.host_dropped_pages = for_room  # NOTE: nor are a namespace's
        return freed

    def add_namespace(self, name: str) -> None:
        """A LoRA adapter added at runtime: its subtrees (keys of the next adapter id) hash as ``name``."""
        self._adapters += 1
        self._roots[self._adapters] = root_hash(name)

    def set_namespace(self, space: int, name: str) -> None:
        """Namespace ``space``'s subtrees hash as ``name`` from now on (a cache salt's: its old
        subtrees dropped first)."""
        self._roots[space] = root_hash(name)

    def event_view(self, key: np.ndarray, parent_hash: int | None) -> tuple[np.ndarray, int]:
        """A node key's tokens and parent hash as KV events carry them: the model's token ids, and
        under the root its namespace's root hash (the base model's or its LoRA adapter's)."""
        if len(self._roots) == 1:
            return key, self._root_hash if parent_hash is None else parent_hash
        if parent_hash is None:
            parent_hash = self._roots[int(key[0]) >> ADAPTER_SHIFT]
        return key & np.int32(TOKEN_MASK), parent_hash

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (tests and debugging only)."""
        from worker.radix_invariants import check_invariants

        check_invariants(self)
