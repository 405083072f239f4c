"""Checks of the radix cache's invariants (listed in worker.radix_cache), for tests and debugging:
each failure names the invariant it broke. Reads the cache's private state; never changes it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from router.block_hash import block_hashes
from worker.radix_node import EMPTY_PAGES, TreeNode

if TYPE_CHECKING:  # pragma: no cover - typing only
    from worker.radix_cache import RadixCache


def check_invariants(cache: RadixCache) -> None:
    """Raise AssertionError naming the first broken invariant."""
    ps = cache.page_size
    evictable = protected = nodes = 0
    device_pages: list[np.ndarray] = []
    host_pages: list[np.ndarray] = []
    live = {(id(n), t) for t, _, n in cache._heap} | {(id(n), t) for t, _, n in cache._host_heap}
    stack: list[tuple[TreeNode, int | None]] = [(c, None) for c in cache.root.children.values()]
    for k, c in cache.root.children.items():
        assert k == c.key[:ps].tobytes(), "root child keyed by a page that is not its first"
    root_device = sum(c.on_device for c in cache.root.children.values())
    assert cache.root.device_children == root_device, "root's device_children off"
    while stack:
        node, parent_hash = stack.pop()
        nodes += 1
        parent = node.parent
        assert parent is not None and not node.removed, "node in tree marked removed"
        num_pages = node.key.size // ps
        assert node.key.dtype == np.int32 and node.key.size == num_pages * ps >= ps, "key not whole pages"
        tiers = (node.pages.size, node.host_pages.size)
        assert tiers in ((num_pages, 0), (0, num_pages)), "pages not all on one tier"
        assert not node.host_pages.size or cache.host is not None, "host pages without a host tier"
        if node.on_device:
            assert parent is cache.root or parent.on_device, "device node under a host node"
        assert node.lock_ref >= 0, "negative lock_ref"
        if node.lock_ref > 0:
            assert parent is cache.root or parent.lock_ref > 0, "locked node under unlocked parent"
            protected += node.pages.size
        else:
            evictable += node.pages.size
        if node.lock_ref == 0 and cache._is_leaf(node):
            assert (id(node), node.last_access) in live, "evictable leaf missing from its LRU heap"
        device_pages.append(node.pages)
        host_pages.append(node.host_pages)
        if cache.enable_events:
            tokens, parent_hash = cache.event_view(node.key, parent_hash)
            expect = block_hashes(tokens.tolist(), ps, parent=parent_hash)
            assert node.hashes == expect, "stored block hashes differ from router.block_hash"
        # every lock on a descendant also counts on this node
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock_ref below children's"
        assert node.device_children == sum(c.on_device for c in node.children.values()), "device_children off"
        for k, c in node.children.items():
            assert c.parent is node, "child's parent pointer is wrong"
            assert k == c.key[:ps].tobytes(), "child keyed by a page that is not its first"
        last = node.hashes[-1] if node.hashes else 0
        stack.extend((c, last) for c in node.children.values())
    assert evictable == cache._evictable, f"evictable count {cache._evictable} != {evictable}"
    assert protected == cache._protected, f"protected count {cache._protected} != {protected}"
    assert nodes == cache._num_nodes, f"node count {cache._num_nodes} != {nodes}"
    for pages, allocator in (
        (device_pages, cache.allocator),
        (host_pages, cache.host and cache.host.allocator),
    ):
        owned = np.concatenate(pages) if pages else EMPTY_PAGES
        assert np.unique(owned).size == owned.size, "a page is owned by two nodes"
        if owned.size:
            assert not allocator.is_free(owned).any(), "a tree page is also free in the allocator"
    host_total = sum(p.size for p in host_pages)
    assert host_total == cache._host_pages, f"host page count {cache._host_pages} != {host_total}"
    if cache.host is not None:
        assert cache.host.allocator.num_free + host_total == cache.host.num_pages, "host pages leaked"
