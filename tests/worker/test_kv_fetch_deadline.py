"""A hinted request's KV fetches (worker/kv_transfer.py ``KVTransfer.pull``) on real servers: all of
its prompts are fetched within one --kv-fetch-timeout-s, a source that failed one is not asked for
the rest (they compute), and a client that leaves stops the fetching."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import pytest

from router.kv_events import KV_SOURCE_HEADER as SOURCE_HEADER
from tests.worker.test_kv_transfer import (
    FETCHED,
    assert_nothing_held,
    cached,
    complete,
    counter,
    exports,
    outcome,
    prompt,
)
from tests.worker.test_server import LiveServer, poll

OUTCOMES = ("ok", "cached", "miss", "busy", "wasted", "error", "cut")
ADMITTED = "radixgate_worker_prompt_tokens_total"


def sim(**kv: float) -> LiveServer:
    """A simulated worker (placeholder KV) with ``kv_*`` transfer settings."""
    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(engine="sim", kv_cache_tokens=16384, sim_decode_base_ms=1.0)
    return LiveServer(build_sim_engine(cfg), kv_hints="any", **kv)


@contextlib.contextmanager
def silent_source() -> Iterator[str]:
    """The URL of a server that takes connections and never answers (a stopped process)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def complete_all(url: str, prompts: list[list[int]], source: str, timeout: float = 60) -> httpx.Response:
    """One completions request for a list of prompts, hinted with ``source``."""
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 2, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, headers={SOURCE_HEADER: source}, timeout=timeout)


def test_a_source_that_never_answers_costs_a_request_one_timeout_not_one_per_prompt():
    prompts = [prompt(400 + i, 200) for i in range(6)]
    with silent_source() as source, sim(kv_fetch_timeout_s=1.0) as receiver:
        r = complete_all(receiver.url, prompts, source)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert len(answer["choices"]) == 6 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the first prompt's fetch timed out; the source was not asked for the other five
        counted = {name: outcome(receiver.url, name) for name in OUTCOMES}
        assert counted == {**dict.fromkeys(OUTCOMES, 0), "error": 1}


def test_a_requests_prompts_are_all_fetched_within_one_timeout():
    # NOTE: a link of 1 ms a token, so n tokens take at least n ms to come; a 1.5 s timeout
    with sim(kv_link_ms_per_token=1.0) as source, sim(kv_fetch_timeout_s=1.5) as receiver:
        warm = prompt(500, 300)
        complete(source.url, [*warm, 1])
        assert cached(complete(receiver.url, [*warm, 2], source.url)) == 288  # the link measured
        prompts = [prompt(510 + i, 500) for i in range(6)]  # 496 tokens each to fetch: ~0.5 s
        for ids in prompts:
            complete(source.url, [*ids, 1])
        fetched = counter(receiver.url, FETCHED)
        r = complete_all(receiver.url, [[*ids, 2] for ids in prompts], source.url)
        assert r.status_code == 200, r.text
        got = counter(receiver.url, FETCHED) - fetched
        assert got == r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        # what came within the one 1.5 s (at most 1,500 tokens on this link), not 6 x 496 in 3 s
        assert 0 < got <= 1500
        assert outcome(receiver.url, "ok") >= 2  # the time left is shared, not spent on the first


def test_a_client_that_leaves_stops_its_requests_fetches(caplog):
    with sim(kv_link_ms_per_token=1.0) as source, sim(kv_fetch_timeout_s=30.0) as receiver:
        prompts = [prompt(600 + i, 500) for i in range(8)]  # ~0.5 s each to fetch, 4 s in all
        for ids in prompts:
            complete(source.url, [*ids, 1])
        with caplog.at_level("INFO", logger="worker.kv_transfer"):
            with pytest.raises(httpx.TimeoutException):
                complete_all(receiver.url, [[*ids, 2] for ids in prompts], source.url, timeout=0.3)
            poll(lambda: "stopped: the client left" in caplog.text, "the receiver to stop fetching")
        assert exports(source.url, "ok") <= 3  # the fetch under way when it left, and one more at most
        # NOTE: each export counted once the source knows its end: sent whole, or its receiver gone
        poll(
            lambda: (
                exports(source.url, "ok") + exports(source.url, "cut")
                == sum(outcome(receiver.url, name) for name in OUTCOMES)
            ),
            "every export counted",
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_during_its_fetch_stops_it_and_nothing_is_submitted(stream):
    # NOTE: a link of 1 ms a token: the prompt's 3,984 tokens take 4 s to come
    with sim(kv_link_ms_per_token=1.0) as source, sim(kv_fetch_timeout_s=30.0) as receiver:
        ids = prompt(700, 4000)
        complete(source.url, [*ids, 1])
        admitted = counter(receiver.url, ADMITTED)
        body = {"model": "tiny", "prompt": [*ids, 2], "max_tokens": 64, "stream": stream}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(receiver.url + "/v1/completions", json=body, headers={SOURCE_HEADER: source.url},
                       timeout=0.5)  # fmt: skip
        poll(lambda: exports(source.url, "cut") == 1, "the fetch to stop (its source sees it leave)")
        assert outcome(receiver.url, "cut") == 1
        assert outcome(receiver.url, "ok") == 0 and exports(source.url, "ok") == 0
        assert counter(receiver.url, ADMITTED) == admitted  # the request was not submitted
        assert_nothing_held(receiver)
