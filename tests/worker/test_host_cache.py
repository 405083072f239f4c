"""Host-memory KV tier: evicted pages move to host memory with their KV and come back on a hit;
a full tier drops its least recently used leaves (and only then do routers hear of a removal);
the trees, page counts and events stay right under random use; real tensors round-trip exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from router.block_hash import block_hashes
from tests.worker.test_radix_cache import NS, Replayer, arr
from worker.host_cache import HostKVPool
from worker.kv_pool import KVPool, PageAllocator, raw
from worker.radix_cache import MatchResult, RadixCache

PS = 4
PAGE_TOKENS = 16  # the worker's default page size (serve())


class ToyKV(HostKVPool):
    """A host tier whose pages hold, per slot, the token id a toy device pool holds there: a copy
    that goes wrong (wrong page, wrong order, stale page) shows up as a wrong token."""

    def __init__(self, num_pages: int, device_kv: np.ndarray) -> None:
        super().__init__(num_pages)
        self.device_kv = device_kv
        self.kv = np.full(num_pages * PS, -1, dtype=np.int64)

    @staticmethod
    def slots(pages: np.ndarray) -> np.ndarray:
        return (np.asarray(pages)[:, None] * PS + np.arange(PS)).reshape(-1)

    def save(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        self.kv[self.slots(host_pages)] = self.device_kv[self.slots(device_pages)]
        self.device_kv[self.slots(device_pages)] = -1  # NOTE: poison: the device page is free now

    def load(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        self.device_kv[self.slots(device_pages)] = self.kv[self.slots(host_pages)]
        self.kv[self.slots(host_pages)] = -1


class Fleet:
    """A device pool of ``pool`` pages (token ids as KV), a host tier of ``host`` pages, a cache."""

    def __init__(self, pool: int = 8, host: int = 8) -> None:
        self.alloc = PageAllocator(pool)
        self.kv = np.full(pool * PS, -1, dtype=np.int64)
        self.host = ToyKV(host, self.kv) if host else None
        self.cache = RadixCache(self.alloc, PS, NS, host=self.host)
        self.router = Replayer(PS)

    def compute(self, tokens: list[int]) -> None:
        """A request that computes ``tokens`` (whole pages) after its cached prefix, then caches it."""
        ids = arr([*tokens, 0])  # NOTE: a probe token: match leaves one token to compute
        m = self.cache.match_prefix(ids)
        self.cache.lock(m.last_node)
        pages = self.bring(m)
        need = len(tokens) // PS - pages.size
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        own = self.alloc.alloc(need)
        assert own is not None
        self.kv[ToyKV.slots(own)] = tokens[pages.size * PS :]
        pages = np.concatenate([pages, own])
        already = self.cache.insert(arr(tokens), pages)
        self.alloc.free(pages[m.num_tokens // PS : already // PS])
        self.cache.unlock(m.last_node)

    def bring(self, m: MatchResult) -> np.ndarray:
        """Device pages of a locked match, its host part loaded back (room made first)."""
        need = sum(n.host_pages.size for n in m.host_nodes)
        if need > self.alloc.num_free:
            self.cache.evict(need - self.alloc.num_free)
        return self.cache.load_back(m) if m.host_nodes else m.pages

    def read(self, pages: np.ndarray) -> list[int]:
        return self.kv[ToyKV.slots(pages)].tolist()

    def sync(self) -> None:
        self.cache.check_invariants()
        self.router.apply(self.cache)
        assert self.router.hashes == {h for run in self.cache.snapshot() for h in run.block_hashes}


def seq(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PS))


def test_evicted_pages_move_to_host_and_come_back_with_their_kv() -> None:
    f = Fleet(pool=8, host=8)
    a, b = seq(0, 4), seq(100, 4)
    f.compute(a)
    f.compute(b)
    f.sync()
    assert f.cache.evict(4) == 4  # a is least recently used
    assert f.cache.total_pages == 4 and f.cache.host_pages == 4 and f.alloc.num_free == 4
    f.sync()
    assert f.router.hashes == set(block_hashes(a, PS, NS)) | set(block_hashes(b, PS, NS))  # still cached
    m = f.cache.match_prefix(arr([*a, 0]))
    assert m.num_tokens == 16 and m.host_tokens == 16 and m.pages.size == 0
    assert f.cache.cached_prefix_len(arr([*a, 0])) == 16
    f.cache.lock(m.last_node)
    f.alloc.alloc(4)  # NOTE: the device pool is full: loading a must move b out first
    pages = f.bring(m)
    assert f.read(pages) == a
    assert f.cache.host_pages == 4 and f.cache.offloaded_pages == 8 and f.cache.loaded_pages == 4
    f.cache.unlock(m.last_node)
    mb = f.cache.match_prefix(arr([*b, 0]))
    assert mb.host_tokens == 16
    f.cache.check_invariants()


def test_full_host_tier_drops_its_least_recent_leaf_and_only_then_reports_removal() -> None:
    f = Fleet(pool=4, host=4)
    a, b, c = seq(0, 4), seq(100, 4), seq(200, 4)
    f.compute(a)
    f.compute(b)  # a -> host
    f.sync()
    assert f.cache.host_pages == 4 and f.router.hashes >= set(block_hashes(a, PS, NS))
    f.compute(c)  # b -> host, which drops a
    stored, removed, _ = f.cache.drain_events()
    assert [run.token_ids for run in stored] == [c]  # moving b to the host is no event
    assert set(removed) == set(block_hashes(a, PS, NS))
    assert removed == block_hashes(a, PS, NS)[::-1]  # deepest block first
    assert f.cache.host_dropped_pages == 4 and f.cache.cached_prefix_len(arr([*a, 0])) == 0
    assert f.cache.cached_prefix_len(arr([*b, 0])) == 16
    f.cache.check_invariants()


def test_partial_eviction_keeps_the_prefix_on_the_device_and_the_tail_on_the_host() -> None:
    f = Fleet(pool=4, host=8)
    a = seq(0, 4)
    f.compute(a)
    assert f.cache.evict(1) == 1
    m = f.cache.match_prefix(arr([*a, 0]))
    assert (m.pages.size, m.host_tokens, m.num_tokens) == (3, 4, 16)
    f.cache.lock(m.last_node)
    assert f.read(f.bring(m)) == a
    f.cache.unlock(m.last_node)
    f.sync()


def test_a_request_that_computed_a_host_prefix_again_gives_the_tree_its_pages() -> None:
    f = Fleet(pool=8, host=8)
    a = seq(0, 4)
    f.compute(a)
    f.cache.evict(4)
    own = f.alloc.alloc(4)
    f.kv[ToyKV.slots(own)] = a
    assert f.cache.insert(arr(a), own) == 0  # nothing was on the device: every page is the tree's now
    assert f.cache.host_pages == 0 and f.cache.total_pages == 4 and f.host.allocator.num_free == 8
    m = f.cache.match_prefix(arr([*a, 0]))
    assert m.host_nodes == [] and m.pages.tolist() == own.tolist()
    f.sync()


def test_flush_empties_both_tiers_and_a_locked_path_survives() -> None:
    f = Fleet(pool=8, host=8)
    a, b = seq(0, 4), seq(100, 4)
    f.compute(a)
    f.cache.evict(4)
    f.compute(b)
    f.sync()
    assert f.cache.flush() == (4, 4)  # b from the device, a from the host
    assert f.cache.host_dropped_pages == 0  # NOTE: the metric of drops for room: a flush is none
    assert f.cache.total_pages == f.cache.host_pages == 0 and f.alloc.num_free == 8
    assert f.cache.drain_events() == ([], [], True)
    f.compute(a)
    m = f.cache.match_prefix(arr([*a[:8], 0]))
    f.cache.lock(m.last_node)
    f.cache.evict(2)  # the unlocked tail of a moves to the host
    assert f.cache.flush() == (0, 2)
    f.cache.check_invariants()
    assert f.cache.total_pages == 2 and f.cache.host_pages == 0
    f.cache.unlock(m.last_node)


def test_without_room_on_the_host_an_evicted_leaf_leaves_the_tree() -> None:
    f = Fleet(pool=8, host=2)  # a 4-page leaf cannot go to a 2-page tier
    a = seq(0, 4)
    f.compute(a)
    assert f.cache.evict(4) == 4
    assert f.cache.host_pages == 0 and f.cache.cached_prefix_len(arr([*a, 0])) == 0
    f.sync()
    assert f.router.hashes == set()


@pytest.mark.parametrize("seed", range(6))
def test_random_use_keeps_pages_kv_and_events_right(seed: int) -> None:
    rng = np.random.default_rng(seed)
    f = Fleet(pool=int(rng.integers(6, 16)), host=int(rng.integers(0, 24)))
    roots = [seq(1000 * i, 6) for i in range(4)]
    for _ in range(300):
        op = rng.random()
        if op < 0.6:  # a request: a shared stem, then a branch of its own
            stem = roots[int(rng.integers(0, 4))][: PS * int(rng.integers(1, 7))]
            tail = [int(t) for t in rng.integers(0, 3, PS * int(rng.integers(0, 3)))]
            tokens = stem + tail
            if len(tokens) // PS <= f.alloc.num_pages:
                f.compute(tokens)
                m = f.cache.match_prefix(arr([*tokens, 0]))
                f.cache.lock(m.last_node)
                assert m.num_tokens == len(tokens)
                assert f.read(f.bring(m)) == tokens, "a page came back with the wrong KV"
                f.cache.unlock(m.last_node)
        elif op < 0.8:
            f.cache.evict(int(rng.integers(1, 6)))
        elif op < 0.83:
            f.cache.flush()
        else:
            f.sync()
        f.cache.check_invariants()
        assert f.alloc.num_free + f.cache.total_pages == f.alloc.num_pages
    f.sync()
    f.cache.flush()
    f.sync()
    assert f.router.hashes == set() and f.alloc.num_free == f.alloc.num_pages


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch has no fp8 equal)."""
    return torch.equal(raw(a), raw(b))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_real_kv_pages_round_trip_through_host_memory(dtype: torch.dtype, device: str) -> None:
    pool = KVPool(6, PS, num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, device=device)
    for layer in range(3):
        pool.k_cache[layer].copy_(torch.randn_like(pool.k_cache[layer], dtype=torch.float32).to(dtype))
        pool.v_cache[layer].copy_(torch.randn_like(pool.v_cache[layer], dtype=torch.float32).to(dtype))
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k_cache, pool.v_cache, strict=True)]
    host = HostKVPool(5, pool)
    assert host.k[0].is_pinned() == (device == "cuda")
    assert HostKVPool.page_bytes(pool) == KVPool.page_bytes(PS, 3, 2, 8, dtype)
    host.save(np.array([4, 1]), np.array([3, 0]))  # out of order on both sides
    for layer in range(3):
        pool.k_cache[layer].fill_(float("nan"))
        pool.v_cache[layer].fill_(float("nan"))
    host.load(np.array([3, 0]), np.array([2, 5]))
    for layer, (k, v) in enumerate(before):
        for src, dst in ((4, 2), (1, 5)):
            s, d = slice(src * PS, (src + 1) * PS), slice(dst * PS, (dst + 1) * PS)
            assert same(pool.k_cache[layer][d], k[s]) and same(pool.v_cache[layer][d], v[s])
        assert torch.isnan(pool.k_cache[layer][: 2 * PS].float()).all()  # nothing else written


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_pages_move_as_runs_of_consecutive_host_pages_in_any_order(device: str) -> None:
    """Host pages in any order, fragmented: each run of consecutive host pages is one block copy,
    and every page still lands in its own device page."""
    pool = KVPool(12, PS, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)
    for cache in pool.k_cache + pool.v_cache:
        cache.copy_(torch.randn_like(cache))
    before = [c.clone() for c in pool.k_cache + pool.v_cache]
    host = HostKVPool(9, pool)
    device_pages, host_pages = np.array([9, 1, 4, 11, 2, 6]), np.array([7, 5, 6, 2, 3, 0])
    _, runs = host._runs(host_pages, device_pages)
    assert runs == [(0, PS), (2 * PS, 4 * PS), (5 * PS, 8 * PS)]  # pages 0 | 2-3 | 5-7
    host.save(device_pages, host_pages)
    for cache in pool.k_cache + pool.v_cache:
        cache.fill_(float("nan"))
    back = np.array([0, 3, 5, 7, 8, 10])  # other device pages than they came from
    host.load(host_pages, back)
    for cache, old in zip(pool.k_cache + pool.v_cache, before, strict=True):
        for src, dst in zip(device_pages, back, strict=True):
            assert torch.equal(cache[dst * PS : (dst + 1) * PS], old[src * PS : (src + 1) * PS])
        written = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
        for dst in back:
            written[dst * PS : (dst + 1) * PS] = True
        assert torch.isnan(cache[~written]).all()  # nothing else written


def test_a_worker_serves_a_prefix_from_host_memory_with_the_same_output() -> None:
    """Tiny model on CPU, a 1,024-token device pool and a 4,096-token host tier: a prompt pushed out
        of the device by others comes back as a cache hit and generates what it did uncached, with the
    same log-probabilities."""
    import httpx

    from tests.worker.test_server import idle, metric, serve

    def prompt(i: int) -> str:
        return f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(120))

    with (
        serve(kv_cache_tokens=1024, host_cache_tokens=4096) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        body = {"prompt": prompt(0) + " Summary:", "max_tokens": 12, "temperature": 0, "logprobs": 1}
        first = c.post("/v1/completions", json=body).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for i in (1, 2):
            c.post("/v1/completions", json={**body, "prompt": prompt(i) + " Summary:"}).raise_for_status()
        health = idle(c)
        assert health["host_pages_total"] == 256 and health["host_pages_cached"] > 0
        assert metric(c, "radixgate_worker_host_offloaded_tokens_total") > 0
        assert c.get("/v1/cache/info").json()["host_capacity_tokens"] == 4096
        again = c.post("/v1/completions", json=body).json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["prompt_tokens"] - 16
        assert metric(c, "radixgate_worker_host_loaded_tokens_total") > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        got, want = (r["choices"][0]["logprobs"]["token_logprobs"] for r in (again, first))
        assert got == pytest.approx(want, abs=1e-4)  # NOTE: the KV itself came back, not just the argmax


def test_flush_reports_what_it_drops_from_each_tier() -> None:
    """POST /v1/cache/flush on a worker with a host tier: device and host pages dropped, each
    counted once, and both tiers empty afterwards."""
    import httpx

    from tests.worker.test_server import idle, serve

    with (
        serve(kv_cache_tokens=1024, host_cache_tokens=4096) as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        for i in range(3):  # NOTE: ~700 tokens each: the first two are pushed to the host tier
            prompt = f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(120))
            c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).raise_for_status()
        before = idle(c)
        assert before["host_pages_cached"] > 0 and before["kv_pages_cached"] > 0
        flushed = c.post("/v1/cache/flush").json()
        assert flushed == {
            "flushed_pages": before["kv_pages_cached"],
            "flushed_tokens": before["kv_pages_cached"] * PAGE_TOKENS,
            "flushed_host_pages": before["host_pages_cached"],
            "flushed_host_tokens": before["host_pages_cached"] * PAGE_TOKENS,
        }
        after = c.get("/health").json()
        assert after["kv_pages_cached"] == after["host_pages_cached"] == 0
        assert c.post("/v1/cache/flush").json()["flushed_host_pages"] == 0


def test_the_sim_engine_charges_host_copies_to_the_step_they_delay() -> None:
    from types import SimpleNamespace

    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(
        engine="sim", kv_cache_tokens=1024, host_cache_tokens=4096, sim_host_copy_ms_per_token=0.01
    )
    engine = build_sim_engine(cfg)
    ex, cache = engine.executor, engine.cache
    assert cache.host is not None and cache.host.num_pages == 256
    decode = SimpleNamespace(mode="decode", requests=[0, 1])
    assert ex.step_ms(decode) == pytest.approx(7.0 + 2 * 0.06)  # nothing copied yet
    cache.offloaded_pages += 3  # NOTE: what an eviction of 3 pages to the host tier leaves behind
    cache.loaded_pages += 1
    extend = SimpleNamespace(mode="extend", num_new_tokens=100, requests=[0])
    assert ex.step_ms(extend) == pytest.approx(100 * 0.07 + 4 * 16 * 0.01)
    assert ex.step_ms(extend) == pytest.approx(100 * 0.07)  # each copy is charged once


def test_an_fp8_pool_serves_a_prefix_back_from_host_memory_as_it_did_from_the_device() -> None:
    """--kv-cache-dtype fp8_e5m2 with a host tier: a prompt answered again from its device pages, then
    pushed out to host memory and answered from there, gives the same text and log-probabilities: the
    fp8 bytes went to the host and came back unchanged."""
    import httpx

    from tests.worker.test_server import idle, metric, serve

    def prompt(i: int) -> str:
        return f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(120))

    with (
        serve(kv_cache_tokens=1024, host_cache_tokens=4096, kv_cache_dtype="fp8_e5m2") as live,
        httpx.Client(base_url=live.url, timeout=60) as c,
    ):
        body = {"prompt": prompt(0) + " Summary:", "max_tokens": 12, "temperature": 0, "logprobs": 1}
        c.post("/v1/completions", json=body).raise_for_status()
        from_device = c.post("/v1/completions", json=body).json()
        assert from_device["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert metric(c, "radixgate_worker_host_loaded_tokens_total") == 0
        for i in (1, 2):
            c.post("/v1/completions", json={**body, "prompt": prompt(i) + " Summary:"}).raise_for_status()
        idle(c)
        from_host = c.post("/v1/completions", json=body).json()
        assert metric(c, "radixgate_worker_host_loaded_tokens_total") > 0
        assert (
            from_host["usage"]["prompt_tokens_details"]["cached_tokens"]
            == (from_device["usage"]["prompt_tokens_details"]["cached_tokens"])
        )
        assert from_host["choices"][0]["text"] == from_device["choices"][0]["text"]
        got, want = (r["choices"][0]["logprobs"]["token_logprobs"] for r in (from_host, from_device))
        assert got == pytest.approx(want, abs=1e-6)
