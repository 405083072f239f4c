"""vLLM's ``cache_salt`` on a real worker (tiny model, CPU): a salt's cached prefixes serve only
requests with the same salt, its KV events hash from the salted chain a router computes, and the
salt namespaces are recycled least recently used first, never from under a running request (a new
salt waits for one instead)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from router.block_hash import root_hash, salted
from router.kv_events import decode
from tests.support import wait_until
from tests.worker.test_server import LiveServer, idle, metric, serve
from worker.cache_salt import SaltSpaces

PREFIX = "A system prompt that every tenant of this test sends first, word for word. " * 5


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with serve() as server:
        yield server


@pytest.fixture
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post("/v1/cache/flush").status_code == 200
        yield c


def ask(client: httpx.Client, salt: str | None, question: str) -> tuple[int, str]:
    """(cached prompt tokens, greedy text) of PREFIX + question under ``salt``."""
    body = {"prompt": PREFIX + question, "max_tokens": 4, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.json()["choices"][0]["text"]


def test_a_salt_shares_cached_prefixes_only_with_its_own_requests(client) -> None:
    prefix = len(PREFIX.encode()) // 16 * 16  # whole pages of the shared prompt
    cached, text = ask(client, "tenant-a", "Q1")
    assert cached == 0
    assert ask(client, "tenant-a", "Q2")[0] >= prefix
    assert ask(client, "tenant-b", "Q3")[0] == 0  # another salt: nothing of tenant-a's
    assert ask(client, None, "Q4")[0] == 0  # no salt: nothing of either
    assert ask(client, None, "Q5")[0] >= prefix
    assert ask(client, "tenant-b", "Q6")[0] >= prefix
    # the same prompt gives the same answer whatever the salt (the same tokens, the same KV)
    assert {ask(client, s, "Q1")[1] for s in ("tenant-a", "tenant-b", "tenant-c", None)} == {text}
    # KV events: each salt's prefixes hang from its own root, as a router hashes them
    snapshot = decode(client.get("/v1/cache/snapshot").content)
    roots = {run.parent_hash for run in snapshot.stored}
    want = {root_hash("tiny"), *(root_hash(salted("tiny", s)) for s in ("tenant-a", "tenant-b", "tenant-c"))}
    assert want <= roots


@pytest.mark.parametrize("salt", ["", 7, ["a"], "s" * 1025])  # the last: a salt is held while in use
def test_a_bad_salt_is_a_400(client, salt) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]


def test_salt_namespaces_are_recycled_least_recently_used_first(client, live) -> None:
    engine = live.engine
    few = SaltSpaces(engine.cache, spaces=2)
    before = engine.salts
    engine.post(lambda: setattr(engine, "salts", few)).result(10)  # NOTE: the engine thread owns it
    try:
        prefix = len(PREFIX.encode()) // 16 * 16
        ask(client, "a", "1")
        ask(client, "b", "2")
        ask(client, "c", "3")  # takes a's namespace: a's pages go
        assert ask(client, "b", "4")[0] >= prefix  # b kept
        assert ask(client, "a", "5")[0] == 0  # a starts again, in c's namespace (the least recent)
        assert ask(client, "c", "6")[0] == 0 and ask(client, "b", "7")[0] == 0
        assert len(few) == 2
    finally:
        engine.post(lambda: setattr(engine, "salts", before)).result(10)


def test_a_namespace_in_use_is_not_taken_a_new_salt_waits_for_it(client, live) -> None:
    """With every salt namespace held by a running request, a request of a new salt waits (it counts
    as waiting) and runs once that request ends; requests of the held salt and unsalted ones do not
    wait."""
    engine = live.engine
    one = SaltSpaces(engine.cache, spaces=1)
    before = engine.salts
    engine.post(lambda: setattr(engine, "salts", one)).result(10)
    try:
        body = {"prompt": PREFIX, "max_tokens": 3000, "ignore_eos": True, "stream": True, "cache_salt": "x"}
        with ThreadPoolExecutor(1) as pool, client.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
            next(lines)  # it runs
            waiting = pool.submit(ask, httpx.Client(base_url=live.url, timeout=60), "y", "later")
            # NOTE: waiting counts it from its submit, the salt's own gauge once the engine parked it
            wait_until(lambda: metric(client, "radixgate_worker_cache_salt_waiting_requests") == 1, 10,
                       what="the new salt waits")  # fmt: skip
            assert client.get("/health").json()["waiting"] == 1 and not waiting.done()
            assert metric(client, "radixgate_worker_cache_salt_namespaces") == 1
            assert ask(client, "x", "same salt")[0] > 0 and ask(client, None, "no salt")[1]
            assert not waiting.done()
            # a waiting request whose client leaves (gives up after 2 s) is dropped from the wait
            gone = {"prompt": PREFIX, "max_tokens": 1, "cache_salt": "z"}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(live.url + "/v1/completions", json=gone, timeout=2.0)
            wait_until(lambda: client.get("/health").json()["waiting"] == 1, 10, what="the one left dropped")
            assert not waiting.done()
        assert waiting.result(60)[0] == 0  # the running one left: the new salt took its namespace
        idle(client)
        assert metric(client, "radixgate_worker_cache_salt_waiting_requests") == 0
    finally:
        engine.post(lambda: setattr(engine, "salts", before)).result(10)
