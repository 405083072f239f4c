"""Radix cache: prefix reuse, locks, LRU eviction, no page leaks, and KV events a router can replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from router.block_hash import block_hashes, root_hash
from worker.kv_pool import PageAllocator
from worker.radix_cache import RadixCache, TreeNode

NS = "test-model"


def arr(tokens: list[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def cached_prefixes(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached page-aligned prefix -> the page holding its last page of tokens."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[TreeNode, tuple[int, ...]]] = [(c, ()) for c in cache.root.children.values()]
    ps = cache.page_size
    while stack:
        node, prefix = stack.pop()
        key = node.key.tolist()
        for i, page in enumerate(node.pages.tolist()):
            prefix = prefix + tuple(key[i * ps : (i + 1) * ps])
            out[prefix] = page
        stack.extend((c, prefix) for c in node.children.values())
    return out


def expected_hashes(prefixes: dict[tuple[int, ...], int], ps: int) -> set[int]:
    return {block_hashes(list(p), ps, NS)[-1] for p in prefixes}


class Replayer:
    """What a router holds after applying drained batches: cleared, then stored, then removed."""

    def __init__(self, ps: int) -> None:
        self.ps = ps
        self.hashes: set[int] = set()

    def apply(self, cache: RadixCache) -> None:
        stored, removed, cleared = cache.drain_events()
        if cleared:
            self.hashes.clear()
        for run in stored:
            assert run.parent_hash == root_hash(NS) or run.parent_hash in self.hashes, "orphan run"
            assert run.block_hashes == block_hashes(run.token_ids, self.ps, parent=run.parent_hash)
            self.hashes.update(run.block_hashes)
        for h in removed:
            assert h in self.hashes, "removal of a hash never stored"
            self.hashes.discard(h)


# ---------------------------------------------------------------------------- property test
@dataclass
class Request:
    tokens: np.ndarray
    matched: np.ndarray  # tree pages of the locked prefix
    node: TreeNode
    own: np.ndarray  # pages this request allocated, for positions len(matched)*PS onwards


PS = 2
POOL = 20
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=13)


class CacheMachine(RuleBasedStateMachine):
    """Random request lifecycles against a brute-force model: a dict of cached prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(POOL)
        self.cache = RadixCache(self.alloc, PS, NS)
        self.model: dict[tuple[int, ...], int] = {}
        self.requests: dict[int, Request] = {}
        self.next_id = 0
        self.router = Replayer(PS)

    # -- helpers
    def model_match(self, tokens: list[int], limit: int) -> list[int]:
        pages = []
        for j in range(1, limit // PS + 1):
            page = self.model.get(tuple(tokens[: j * PS]))
            if page is None:
                break
            pages.append(page)
        return pages

    def evict(self, n: int, flush: bool = False) -> int:
        before = dict(self.model)
        freed = self.cache.flush()[0] if flush else self.cache.evict(n)  # no host tier: device pages
        after = cached_prefixes(self.cache)
        assert all(before.get(p) == page for p, page in after.items()), "eviction changed a page"
        gone = [page for p, page in before.items() if p not in after]
        assert len(gone) == freed
        assert self.alloc.is_free(np.asarray(gone, dtype=np.int64)).all()
        for req in self.requests.values():  # locked prefixes survive
            for j in range(1, len(req.matched) + 1):
                assert tuple(req.tokens[: j * PS].tolist()) in after, "a locked page was evicted"
        if flush or freed < n:
            assert self.cache.evictable_pages == 0
        self.model = after
        return freed

    def insert(self, req: Request, n_pages: int) -> int:
        """Insert the request's first n_pages pages; free its duplicates; return pages now cached."""
        k = len(req.matched)
        tokens = req.tokens[: n_pages * PS]
        all_pages = np.concatenate([req.matched, req.own])[:n_pages]
        expect = len(self.model_match(tokens.tolist(), len(tokens)))
        already = self.cache.insert(tokens, all_pages)
        assert already == expect * PS
        if n_pages > k:
            self.alloc.free(req.own[: expect - k])  # duplicates of pages another request cached
            for j in range(expect + 1, n_pages + 1):
                self.model[tuple(tokens[: j * PS].tolist())] = int(all_pages[j - 1])
        return expect

    # -- rules
    @rule(tokens=TOKENS)
    def start_request(self, tokens: list[int]) -> None:
        peeked = self.cache.cached_prefix_len(arr(tokens))
        m = self.cache.match_prefix(arr(tokens))
        assert peeked == m.num_tokens
        expect = self.model_match(tokens, max(0, len(tokens) - 1))
        assert m.pages.tolist() == expect and m.num_tokens == len(expect) * PS
        assert m.num_tokens <= max(0, len(tokens) - 1)
        self.cache.lock(m.last_node)
        need = -(-len(tokens) // PS) - len(expect)
        own = self.alloc.alloc(need)
        if own is None:
            self.evict(need - self.alloc.num_free)
            own = self.alloc.alloc(need)
        if own is None:  # rejected: out of memory even after eviction
            self.cache.unlock(m.last_node)
            return
        self.requests[self.next_id] = Request(arr(tokens), m.pages, m.last_node, own)
        self.next_id += 1

    @rule(tokens=TOKENS)
    def lookup_only(self, tokens: list[int]) -> None:
        m = self.cache.match_prefix(arr(tokens))
        assert m.pages.tolist() == self.model_match(tokens, max(0, len(tokens) - 1))

    @rule(tokens=TOKENS)
    def peek_only(self, tokens: list[int]) -> None:
        nodes = self.cache._num_nodes
        n = self.cache.cached_prefix_len(arr(tokens))
        assert n == len(self.model_match(tokens, max(0, len(tokens) - 1))) * PS
        assert self.cache._num_nodes == nodes  # no split

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        """Finish, or fail / get cancelled after computing only some pages (n_pages < full)."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests.pop(rid)
        k = len(req.matched)
        n_pages = data.draw(st.integers(0, len(req.tokens) // PS), label="pages computed")
        self.insert(req, n_pages)
        self.alloc.free(req.own[max(n_pages, k) - k :])  # the rest of its own pages
        self.cache.unlock(req.node)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def chunk_done(self, data: st.DataObject) -> None:
        """Chunked prefill: cache the pages computed so far and move the lock down to them."""
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests[rid]
        k = len(req.matched)
        full = (len(req.tokens) - 1) // PS
        if full <= k:
            return
        n_pages = data.draw(st.integers(k + 1, full))
        self.insert(req, n_pages)
        m = self.cache.match_prefix(req.tokens[: n_pages * PS + 1])
        assert m.num_tokens == n_pages * PS
        assert m.pages.tolist() == self.model_match(req.tokens.tolist(), n_pages * PS)
        self.cache.lock(m.last_node)
        self.cache.unlock(req.node)
        self.requests[rid] = Request(req.tokens, m.pages, m.last_node, req.own[n_pages - k :])

    @rule(n=st.integers(0, 8))
    def evict_pages(self, n: int) -> None:
        self.evict(n)

    @rule()
    def flush(self) -> None:
        self.evict(0, flush=True)

    @rule()
    def drain(self) -> None:
        self.router.apply(self.cache)
        assert self.router.hashes == expected_hashes(self.model, PS)
        assert self.router.hashes == {h for run in self.cache.snapshot() for h in run.block_hashes}

    # -- invariants
    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        assert cached_prefixes(self.cache) == self.model
        running = sum(len(r.own) for r in self.requests.values())
        assert self.alloc.num_free + self.cache.total_pages + running == POOL, "page leak"
        locked = {tuple(r.tokens[: j * PS].tolist()) for r in self.requests.values()
                  for j in range(1, len(r.matched) + 1)}  # fmt: skip
        assert self.cache.protected_pages == len(locked)

    def teardown(self) -> None:
        for req in self.requests.values():  # cancel everything still running
            self.alloc.free(req.own)
            self.cache.unlock(req.node)
        self.requests.clear()
        self.cache.flush()
        assert self.cache.total_pages == 0 and self.alloc.num_free == POOL, "pages leaked"
        self.router.apply(self.cache)
        assert self.router.hashes == set()


CacheMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase


# ---------------------------------------------------------------------------- unit tests
def make(pool: int = 64, ps: int = 4, events: bool = True) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(pool)
    return alloc, RadixCache(alloc, ps, NS, enable_events=events)


def put(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> np.ndarray:
    pages = alloc.alloc(len(tokens) // cache.page_size)
    done = cache.insert(arr(tokens), pages)
    alloc.free(pages[: done // cache.page_size])
    return pages


def test_match_reuses_cached_pages_and_leaves_one_token() -> None:
    alloc, cache = make()
    pages = put(alloc, cache, list(range(12)))
    m = cache.match_prefix(arr(list(range(12))))
    assert m.num_tokens == 8 and m.pages.tolist() == pages[:2].tolist()  # last token must be computed
    m = cache.match_prefix(arr([*range(12), 99]))
    assert m.num_tokens == 12 and m.pages.tolist() == pages.tolist()
    m = cache.match_prefix(arr([0, 1, 2, 3, 4, 5, 99, 7, 8]))
    assert m.num_tokens == 4  # diverges inside page 1: only whole pages count
    assert cache.match_prefix(arr([])).num_tokens == 0


def test_peeking_at_a_prefix_neither_splits_nodes_nor_refreshes_lru() -> None:
    alloc, cache = make()
    put(alloc, cache, [1] * 8)
    put(alloc, cache, [2] * 8)
    nodes = cache._num_nodes
    assert cache.cached_prefix_len(arr([1] * 4 + [7] * 5)) == 4  # match would split [1]*8 here
    assert cache.cached_prefix_len(arr([1] * 9)) == 8
    assert cache._num_nodes == nodes
    assert cache.evict(2) == 2  # [1]*8 is still the least recently used: peeking is no use
    assert cache.cached_prefix_len(arr([1] * 9)) == 0 and cache.cached_prefix_len(arr([2] * 9)) == 8
    cache.check_invariants()


def test_insert_returns_shared_prefix_and_splits_on_page_boundary() -> None:
    alloc, cache = make()
    put(alloc, cache, list(range(16)))
    pages = alloc.alloc(4)
    assert cache.insert(arr([*range(8), 50, 51, 52, 53, 54, 55, 56, 57]), pages) == 8
    alloc.free(pages[:2])
    assert cache.total_pages == 6 and cache.evictable_pages == 6
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.insert(arr([1, 2, 3]), alloc.alloc(1))  # not a whole page


def test_evict_takes_least_recently_used_first_and_trims_leaves() -> None:
    alloc, cache = make()
    put(alloc, cache, [1] * 8)
    put(alloc, cache, [2] * 8)
    put(alloc, cache, [3] * 8)
    cache.match_prefix(arr([1] * 9))  # [1]* is now the most recent
    assert cache.evict(3) == 3  # all of [2]*, then one page of [3]*
    assert cache.match_prefix(arr([2] * 9)).num_tokens == 0
    assert cache.match_prefix(arr([3] * 9)).num_tokens == 4
    assert cache.match_prefix(arr([1] * 9)).num_tokens == 8
    assert alloc.num_free == 64 - 3
    cache.check_invariants()


def test_locked_path_is_never_evicted_and_unlock_releases_it() -> None:
    alloc, cache = make(pool=8)
    put(alloc, cache, list(range(16)))
    put(alloc, cache, [*range(8), 9, 9, 9, 9])
    m = cache.match_prefix(arr([*range(16), 0]))
    cache.lock(m.last_node)
    assert cache.protected_pages == 4 and cache.evictable_pages == 1
    assert cache.evict(100) == 1  # only the unlocked branch goes
    assert cache.match_prefix(arr([*range(16), 0])).num_tokens == 16
    cache.unlock(m.last_node)
    with pytest.raises(ValueError):
        cache.unlock(m.last_node)
    assert cache.flush() == (4, 0) and alloc.num_free == 8
    with pytest.raises(ValueError):
        cache.lock(m.last_node)  # evicted: a stale match cannot be locked


def test_restore_after_removal_in_one_drain_is_not_lost() -> None:
    alloc, cache = make()
    router = Replayer(cache.page_size)
    put(alloc, cache, list(range(8)))
    router.apply(cache)
    cache.flush()
    put(alloc, cache, list(range(8)))  # evicted, then cached again before the drain
    stored, removed, cleared = cache.drain_events()
    assert cleared and len(stored) == 1 and removed == []
    m = cache.match_prefix(arr(list(range(9))))
    cache.lock(m.last_node)
    put(alloc, cache, [*range(8), 7, 7, 7, 7])
    cache.evict(1)
    put(alloc, cache, [*range(8), 7, 7, 7, 7])
    stored, removed, cleared = cache.drain_events()
    assert not cleared and len(stored) == 2 and removed == []
    assert {h for s in stored for h in s.block_hashes} == set(
        block_hashes([*range(8), 7, 7, 7, 7], 4, NS)[2:]
    )


def test_store_then_remove_in_one_drain_ends_removed() -> None:
    alloc, cache = make()
    router = Replayer(cache.page_size)
    put(alloc, cache, [5] * 8)
    m = cache.match_prefix(arr([5] * 9))
    cache.lock(m.last_node)
    put(alloc, cache, [5] * 8 + [6] * 8)
    assert cache.evict(2) == 2
    stored, removed, _ = cache.drain_events()
    assert set(removed) == set(block_hashes([5] * 8 + [6] * 8, 4, NS)[2:])
    assert set(removed) <= {h for run in stored for h in run.block_hashes}  # in both lists
    cache.unlock(m.last_node)
    cache.flush()
    put(alloc, cache, [5] * 8 + [6] * 8)
    cache.evict(2)
    router.apply(cache)  # cleared, stored [5]*8 + [6]*8, removed the [6] pages
    assert router.hashes == set(block_hashes([5] * 8, 4, NS))


def test_flush_with_a_locked_node_reports_removals_not_cleared() -> None:
    alloc, cache = make()
    put(alloc, cache, [1] * 8)
    put(alloc, cache, [2] * 8)
    cache.drain_events()
    m = cache.match_prefix(arr([1] * 9))
    cache.lock(m.last_node)
    assert cache.flush() == (2, 0)
    stored, removed, cleared = cache.drain_events()
    assert not cleared and stored == [] and set(removed) == set(block_hashes([2] * 8, 4, NS))


def test_undrained_overflow_resyncs_from_snapshot() -> None:
    alloc, cache = make(pool=256)
    cache.events.max_pending_blocks = 10
    for i in range(8):
        put(alloc, cache, [i] * 8)
    cache.evict(5)
    stored, removed, cleared = cache.drain_events()  # too much pending: a full re-sync instead
    assert cleared and removed == [] and stored == cache.snapshot()
    assert {h for run in stored for h in run.block_hashes} == expected_hashes(cached_prefixes(cache), 4)
    put(alloc, cache, [9] * 8)
    stored, removed, cleared = cache.drain_events()  # back to incremental events
    assert not cleared and removed == [] and stored[0].block_hashes == block_hashes([9] * 8, 4, NS)


def test_event_hashes_match_router_prediction_for_a_prompt() -> None:
    alloc, cache = make(pool=64, ps=16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128_000, size=16 * 10, dtype=np.int32)
    put(alloc, cache, prompt[:96].tolist())
    put(alloc, cache, prompt.tolist())
    stored, _, _ = cache.drain_events()
    got = [h for run in stored for h in run.block_hashes]
    assert got == block_hashes(prompt.tolist(), 16, NS)
    assert stored[1].parent_hash == got[5]


def test_events_off_skips_hashing_but_snapshot_still_right() -> None:
    alloc, cache = make(events=False)
    put(alloc, cache, list(range(8)))
    put(alloc, cache, [*range(4), 9, 9, 9, 9])
    assert cache.drain_events() == ([], [], False)
    assert {h for run in cache.snapshot() for h in run.block_hashes} == set(
        block_hashes(list(range(8)), 4, NS) + block_hashes([*range(4), 9, 9, 9, 9], 4, NS)
    )
    cache.check_invariants()
