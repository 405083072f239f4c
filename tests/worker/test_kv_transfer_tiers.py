"""KV moved between workers with a host tier (worker/kv_transfer.py, --host-cache-tokens): routers
see one cache, so a source whose prefix moved to its host tier sends it, a receiver holding part of
the prefix in its host tier uses the fetched rest, and both answer as a worker that computed it;
what an import cannot use is counted as wasted, not as cached."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from tests.worker.test_host_cache import PS, Fleet, seq
from tests.worker.test_kv_transfer import (
    EXPORTED,
    FETCHED,
    assert_nothing_held,
    assert_same_answer,
    cached,
    complete,
    counter,
    outcome,
    prompt,
)
from tests.worker.test_radix_cache import arr
from tests.worker.test_server import LiveServer
from tests.worker.test_server import serve as serve_worker
from worker.kv_pages import Pinned, import_begin, import_end

PAGE = 16
EVICTED = "radixgate_worker_evicted_pages_total"


def serve(**overrides) -> LiveServer:
    """A worker that takes KV hints from any client (these tests name sources themselves)."""
    return serve_worker(**{"kv_hints": "any", **overrides})


def tiers(server: LiveServer, ids: list[int]) -> tuple[int, int]:
    """(device, host) tokens of ``ids``' cached prefix on ``server``, read without touching its LRU."""
    cache = server.engine.cache
    tokens = np.asarray(ids, dtype=np.int32)

    def walk() -> tuple[int, int]:
        node, pos, device, host = cache.root, 0, 0, 0
        while pos + PAGE <= tokens.size - 1:
            child = node.children.get(tokens[pos : pos + PAGE].tobytes())
            if child is None or pos + child.key.size > tokens.size - 1:
                break
            if not np.array_equal(child.key, tokens[pos : pos + child.key.size]):
                break
            pos += child.key.size
            if child.on_device:
                device += child.key.size
            else:
                host += child.key.size
            node = child
        return device, host

    return asyncio.run(server.engine.call(walk))


def push_to_host(server: LiveServer, ids: list[int], seed: int) -> None:
    """Fill ``server``'s device pool with other prompts until ``ids``' prefix has all left it for the
    host tier (a bounded number of fillers)."""
    cached_before = sum(tiers(server, ids))
    for i in range(40):
        if tiers(server, ids)[0] == 0:
            break
        complete(server.url, prompt(seed + i, 300), max_tokens=1, logprobs=None)
    assert tiers(server, ids) == (0, cached_before), "the prefix did not move to the host tier"


@pytest.fixture(scope="module")
def tiered() -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    """Two workers with a small device pool and a host tier, and a plain worker (the reference)."""
    small = {"kv_cache_tokens": 2048, "host_cache_tokens": 8192}
    with serve(**small) as a, serve(**small) as b, serve() as plain:
        yield a, b, plain


def test_a_source_sends_a_prefix_that_moved_to_its_host_tier(tiered):
    source, receiver, plain = tiered
    ids = prompt(200, 500)
    complete(source.url, [*ids, 1])
    push_to_host(source, [*ids, 1], 1000)
    exported, fetched = counter(source.url, EXPORTED), counter(receiver.url, FETCHED)
    evicted, free = counter(source.url, EVICTED), source.engine.allocator.num_free
    hinted = complete(receiver.url, [*ids, 2], source.url)
    # its 31 pages loaded back to a full pool: the LRU pages it evicted for them count as evicted
    assert free < 31 and counter(source.url, EVICTED) - evicted >= 31 - free
    assert cached(hinted) == 496  # every whole page of the 500 the source held, in its host tier
    assert outcome(receiver.url, "ok") == 1 and outcome(receiver.url, "miss") == 0
    assert counter(receiver.url, FETCHED) - fetched == 496
    assert counter(source.url, EXPORTED) - exported == 496
    assert_same_answer(hinted, complete(plain.url, [*ids, 2]))
    assert tiers(source, [*ids, 1]) == (496, 0)  # loaded back to send it, as a local hit would be
    assert_nothing_held(source)
    assert_nothing_held(receiver)


def test_a_receiver_holding_part_of_the_prefix_in_its_host_tier_uses_the_fetched_rest(tiered):
    source, receiver, plain = tiered
    head, tail = prompt(300, 320), prompt(301, 480)
    complete(receiver.url, [*head, 7])  # the receiver holds the first 320 tokens itself ...
    push_to_host(receiver, [*head, 7], 2000)  # ... in its host tier
    complete(source.url, [*head, *tail, 1])
    ok, exported = outcome(receiver.url, "ok"), counter(source.url, EXPORTED)
    fetched = counter(receiver.url, FETCHED)
    ids = [*head, *tail, *prompt(302, 20)]
    hinted = complete(receiver.url, ids, source.url)
    assert cached(hinted) == 800
    assert outcome(receiver.url, "ok") == ok + 1
    assert counter(source.url, EXPORTED) - exported == 480  # from the receiver's own 320 (both tiers) on
    assert counter(receiver.url, FETCHED) - fetched == 480
    assert outcome(receiver.url, "wasted") == 0
    assert_same_answer(hinted, complete(plain.url, ids))
    assert_nothing_held(receiver)


def test_an_import_loads_its_host_part_back_and_tells_what_it_cannot_use():
    # NOTE: the toy pool holds token ids as KV: a page loaded back or written wrong shows as wrong ids
    f = Fleet(pool=8, host=8)
    head, tail = seq(0, 2), seq(100, 3)
    tokens = arr([*head, *tail, 0])

    def write(pin: Pinned) -> None:
        f.kv[pin.slots.numpy()] = tokens[pin.have : pin.have + pin.slots.numel()]

    f.compute(head)
    assert f.cache.evict(2) == 2 and f.cache.host_pages == 2  # the head is in the host tier
    # a transfer from 12 on: this worker's prefix (8 tokens) no longer reaches it
    assert import_begin(f.cache, f.alloc, PS, tokens, 12, 20) == "wasted"
    pin = import_begin(f.cache, f.alloc, PS, tokens, 8, 20)
    assert isinstance(pin, Pinned) and pin.have == 8 and pin.pages.size == 3
    write(pin)
    assert import_end(f.cache, f.alloc, PS, tokens, 20, pin, True) == 12
    m = f.cache.match_prefix(tokens)
    assert m.num_tokens == 20 and not m.host_nodes and f.read(m.pages) == [*head, *tail]
    f.sync()
    assert import_begin(f.cache, f.alloc, PS, tokens, 8, 20) == "cached"  # it holds the whole span
    # no room: every other page is held by a running request, so none can be freed for the import
    other = arr([*seq(500, 3), 0])
    held = f.alloc.alloc(f.alloc.num_free)
    m = f.cache.match_prefix(tokens)
    f.cache.lock(m.last_node)
    assert import_begin(f.cache, f.alloc, PS, other, 0, 12) == "wasted"
    f.cache.unlock(m.last_node)
    f.alloc.free(held)
    f.sync()
