"""KV moved between workers (worker/kv_transfer.py) on real uvicorn servers (tiny model, CPU): a worker
hinted with x-radixgate-kv-source fetches what the source caches of the prompt beyond its own prefix
and answers exactly as a worker that computed the prefill; the fetched blocks are published as its
own; every failure (miss, unreachable source, another layout, a full pool) leaves the answer right;
the export endpoint refuses bad input."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import orjson
import pytest
import torch

from router.block_hash import block_hashes
from router.kv_events import KV_SOURCE_HEADER as SOURCE_HEADER
from router.kv_events import decode
from tests.support import free_port
from tests.worker.test_server import LiveServer, poll
from tests.worker.test_server import serve as serve_worker
from worker.kv_pages import EXPORT_PATH, body_view, export_headers, read_headers

PAGE = 16


def serve(**overrides) -> LiveServer:
    """A worker that takes KV hints from any client (these tests name sources themselves)."""
    return serve_worker(**{"kv_hints": "any", **overrides})


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[LiveServer, LiveServer, LiveServer]]:
    """source, receiver, and a plain worker that is never hinted (the reference answers)."""
    with serve() as source, serve() as receiver, serve() as plain:
        yield source, receiver, plain


def complete(url: str, ids: list[int], source: str | None = None, **extra) -> dict:
    headers = {SOURCE_HEADER: source} if source else {}
    body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 2, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_same_answer(a: dict, b: dict) -> None:
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    assert la["tokens"] == lb["tokens"]
    for x, y in zip(la["token_logprobs"], lb["token_logprobs"], strict=True):
        assert abs(x - y) < 1e-4, (x, y)


def counter(url: str, name: str, label: str = "") -> float:
    """A counter's value on /metrics (0 before its first increment)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{label} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


FETCH, FETCHED = "radixgate_worker_kv_fetch_total", "radixgate_worker_kv_fetched_tokens_total"
EXPORTED = "radixgate_worker_kv_exported_tokens_total"


def outcome(url: str, name: str) -> float:
    return counter(url, FETCH, f'{{outcome="{name}"}}')


def exports(url: str, name: str) -> float:
    return counter(url, "radixgate_worker_kv_export_total", f'{{outcome="{name}"}}')


def cached_hashes(url: str) -> set[int]:
    snap = decode(httpx.get(url + "/v1/cache/snapshot", timeout=10).content)
    return {h for blocks in snap.stored for h in blocks.block_hashes}


def assert_nothing_held(server: LiveServer) -> None:
    """Once transfers end: no host memory counted, no pages pinned or taken and lost, a sound tree."""
    cache = server.engine.cache

    kv = server.app.state.kv_transfer

    def state() -> tuple[int, ...]:
        cache.check_invariants()
        return kv.held, kv.link.left, kv.link_out.left, cache.protected_pages

    deadline = time.monotonic() + 10
    while (now := asyncio.run(server.engine.call(state))) != (0, 0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)  # NOTE: an export gives its share back just after its last byte is sent
    assert now == (0, 0, 0, 0)
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["kv_pages_free"] + health["kv_pages_cached"] == health["kv_pages_total"]


def test_a_hinted_worker_fetches_the_prefix_and_answers_as_if_it_computed_it(fleet):
    source, receiver, plain = fleet
    shared = prompt(1, 700)
    complete(source.url, shared + prompt(2, 30))
    ok, fetched, exported = (
        outcome(receiver.url, "ok"),
        counter(receiver.url, FETCHED),
        counter(source.url, EXPORTED),
    )
    ids = shared + prompt(3, 40)
    hinted = complete(receiver.url, ids, source.url)
    reference = complete(plain.url, ids)
    assert cached(reference) == 0
    assert cached(hinted) == 700 // PAGE * PAGE  # every whole page of the shared prefix the source held
    assert_same_answer(hinted, reference)
    assert outcome(receiver.url, "ok") == ok + 1
    assert counter(receiver.url, FETCHED) == fetched + cached(hinted)
    assert counter(source.url, EXPORTED) == exported + cached(hinted)
    # the fetched blocks are the receiver's own now: in its snapshot (and KV events) for routers to learn
    assert set(block_hashes(ids[: cached(hinted)], PAGE, "tiny")) <= cached_hashes(receiver.url)
    # a second request finds them (and its own prompt) locally: nothing fetched
    again = complete(receiver.url, ids, source.url)
    assert cached(again) == (len(ids) - 1) // PAGE * PAGE and outcome(receiver.url, "cached") >= 1
    assert_same_answer(again, reference)


def test_a_hint_is_taken_only_from_whom_kv_hints_trusts(fleet):
    """--kv-hints keyed (the default): a worker without --api-key ignores a source named by a client
    (it could be any server's KV); one with a key takes it (every request carries the fleet's key);
    off: none does."""
    from worker.assembly import build_engine
    from worker.config import WorkerConfig

    source, _, _ = fleet
    shared = prompt(11, 300)
    complete(source.url, shared + prompt(12, 20))
    ids = shared + prompt(13, 20)
    cfg = WorkerConfig(model="tiny", device="cpu", kv_cache_tokens=4096)
    with serve_worker() as open_, serve_worker(kv_hints="off") as off:
        for worker in (open_, off):
            assert cached(complete(worker.url, ids, source.url)) == 0
            assert counter(worker.url, FETCH, '{outcome="ok"}') == 0
    with LiveServer(build_engine(cfg), api_key="fleet-key") as keyed:
        answer = httpx.post(keyed.url + "/v1/completions", timeout=60, headers={
            SOURCE_HEADER: source.url, "authorization": "Bearer fleet-key"},
            json={"model": "tiny", "prompt": ids, "max_tokens": 1}).json()  # fmt: skip
        assert cached(answer) == 300 // PAGE * PAGE


def test_only_what_the_receiver_lacks_is_fetched(fleet):
    source, receiver, plain = fleet
    head, tail = prompt(10, 320), prompt(11, 480)
    complete(receiver.url, head + prompt(12, 20))  # the receiver holds the first 320 tokens itself
    complete(source.url, head + tail + prompt(13, 20))
    exported, fetched = counter(source.url, EXPORTED), counter(receiver.url, FETCHED)
    ids = head + tail + prompt(14, 20)
    hinted = complete(receiver.url, ids, source.url)
    assert cached(hinted) == 800
    assert counter(source.url, EXPORTED) - exported == 480  # from the receiver's own 320 on
    assert counter(receiver.url, FETCHED) - fetched == 480
    assert_same_answer(hinted, complete(plain.url, ids))


def test_chat_streams_and_several_prompts_fetch_too(fleet):
    source, receiver, _ = fleet
    system = {"role": "system", "content": "Answer as a ship's log would. " * 30}
    chat = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    httpx.post(source.url + "/v1/chat/completions", json={**chat, "messages": [system]}, timeout=60)
    body = {**chat, "messages": [system, {"role": "user", "content": "Where are we?"}]}
    with httpx.stream("POST", receiver.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={SOURCE_HEADER: source.url}) as r:  # fmt: skip
        chunks = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(system["content"]) // PAGE * PAGE - PAGE
    # a list of prompts: each is fetched for
    a, b = prompt(20, 200), prompt(21, 200)
    complete(source.url, [*a, 5])
    complete(source.url, [*b, 5])
    r = httpx.post(receiver.url + "/v1/completions", json={"model": "tiny", "prompt": [[*a, 7], [*b, 7]],
                   "max_tokens": 2}, headers={SOURCE_HEADER: source.url}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * 192


def test_failures_leave_the_answer_right(fleet):
    source, receiver, plain = fleet
    ids = prompt(30, 400)
    # the source holds nothing of it: a miss
    misses = outcome(receiver.url, "miss")
    assert_same_answer(complete(receiver.url, ids, source.url), complete(plain.url, ids))
    assert outcome(receiver.url, "miss") == misses + 1
    # nothing listens there: an error, and the request computes its prefill
    errors = outcome(receiver.url, "error")
    ids = prompt(31, 400)
    answer = complete(receiver.url, ids, f"http://127.0.0.1:{free_port()}")
    assert cached(answer) == 0 and outcome(receiver.url, "error") == errors + 1
    assert_same_answer(answer, complete(plain.url, ids))
    # a source with another page size: its KV is refused
    with serve(block_size=32) as other:
        ids = prompt(32, 400)
        complete(other.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], other.url)
        assert cached(answer) == 0 and outcome(receiver.url, "error") == errors + 2
        assert_same_answer(answer, complete(plain.url, [*ids, 2]))


def test_a_full_pool_makes_room_and_half_the_pool_bounds_a_fetch(fleet):
    source, _, plain = fleet
    # tiny: 4 layers x 2 KV heads x 32 dims x 4 bytes = 256 bytes a token in each of 8 slabs; with a
    # 1 MiB bound a group is 64 KiB or one slab: these transfers stream in 8 groups of one slab
    with serve(kv_cache_tokens=2048, kv_transfer_max_mib=1) as small:
        for seed in range(60, 68):  # fill the pool with other prefixes
            complete(small.url, prompt(seed, 240))
        ids = prompt(45, 700)
        complete(source.url, [*ids, 3])
        assert counter(small.url, "radixgate_worker_evicted_pages_total") == 0
        answer = complete(small.url, [*ids, 4], source.url)
        assert counter(small.url, "radixgate_worker_evicted_pages_total") > 0
        assert cached(answer) == 688
        assert_same_answer(answer, complete(plain.url, [*ids, 4]))
        ids = prompt(46, 1500)
        complete(source.url, [*ids, 3])
        answer = complete(small.url, [*ids, 4], source.url)
        assert cached(answer) == 1024  # NOTE: half of this pool, room for the rest
        assert_same_answer(answer, complete(plain.url, [*ids, 4]))
        assert_nothing_held(small)
    assert_nothing_held(source)


@pytest.mark.parametrize("failing", [1, 3, 8])  # NOTE: the first (takes the pages), one between, the last
def test_a_failing_pool_write_leaves_the_answer_right_and_gives_the_pages_back(fleet, failing):
    source, _, plain = fleet
    with serve(kv_transfer_max_mib=1) as receiver:  # NOTE: 8 groups of one slab
        real, calls = receiver.engine.executor.write_kv, []

        def flaky(slots, slabs, lo=0):
            calls.append(lo)
            if len(calls) == failing:
                raise RuntimeError("simulated device error")
            return real(slots, slabs, lo)

        receiver.engine.executor.write_kv = flaky
        ids = prompt(48 + 10 * failing, 700)
        complete(source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], source.url)
        assert cached(answer) == 0 and outcome(receiver.url, "error") == 1 and len(calls) == failing
        assert_same_answer(answer, complete(plain.url, [*ids, 2]))
        assert_nothing_held(receiver)
        receiver.engine.executor.write_kv = real
        ids = prompt(49 + 10 * failing, 700)
        complete(source.url, [*ids, 1])
        assert cached(complete(receiver.url, [*ids, 2], source.url)) == 688


def test_the_export_endpoint_refuses_bad_input_and_keeps_serving(fleet):
    source, _, _ = fleet
    ids = prompt(50, 100)
    complete(source.url, [*ids, 1])
    url = source.url + EXPORT_PATH
    not_cached = exports(source.url, "not_cached")
    for body, status in [
        ({"token_ids": "abc"}, 400),
        ({"token_ids": [1, -2]}, 400),
        ({"token_ids": ids, "start": 5}, 400),
        ({"token_ids": ids, "max_tokens": -16}, 400),
        ({"token_ids": ids, "model": "other"}, 400),
        ({"token_ids": prompt(51, 100)}, 404),
        ({"token_ids": [*ids, 1], "start": 96}, 404),  # nothing cached beyond 96
    ]:
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == status, (body, r.text)
        assert "message" in r.json()["error"]
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    assert exports(source.url, "not_cached") == not_cached + 2
    r = httpx.post(url, json={"token_ids": [*ids, 1], "start": 32, "max_tokens": 32}, timeout=10)
    assert r.status_code == 200
    shape = (2, 4, 32, 2, 32)  # K and V, 4 layers, 32 tokens, 2 KV heads, 32 dims
    assert read_headers(r.headers) == (32, PAGE, shape, torch.float32)
    assert int(r.headers["content-length"]) == len(r.content)
    assert len(r.content) == 2 * 4 * 32 * 2 * 32 * 4
    for bad in (
        {},
        {**r.headers, "x-radixgate-kv-shape": "2,4"},
        {**r.headers, "x-radixgate-kv-dtype": "int8"},
    ):
        with pytest.raises(ValueError, match="not a KV export"):
            read_headers(bad)
    with serve(kv_transfer_max_mib=0) as off:
        r = httpx.post(off.url + EXPORT_PATH, json={"token_ids": ids}, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == "kv_transfer_unsupported"
        # a worker with transfers off ignores the hint
        answer = complete(off.url, [*ids, 1], source.url)
        assert cached(answer) == 0
    assert complete(source.url, [*ids, 1])["usage"]["prompt_tokens"] == 101


def test_a_salted_prompt_cannot_be_exported_by_its_namespaces_keys(fleet):
    """A salted prompt is cached under its salt's namespace (the ids shifted into it): ids outside
    the vocabulary are refused, so no caller reads another tenant's KV, or learns it is cached."""
    from worker.cache_salt import FIRST_SALT_SPACE, SALT_SPACES
    from worker.radix_node import ADAPTER_SHIFT

    source, _, _ = fleet
    ids = prompt(52, 100)
    body = {"prompt": [*ids, 1], "max_tokens": 1, "cache_salt": "tenant-a"}
    assert httpx.post(source.url + "/v1/completions", json=body, timeout=60).status_code == 200
    url = source.url + EXPORT_PATH
    assert httpx.post(url, json={"token_ids": ids}, timeout=10).status_code == 404  # not under the base's
    for space in reversed(range(FIRST_SALT_SPACE, FIRST_SALT_SPACE + SALT_SPACES)):  # the first taken first
        keys = [t + (space << ADAPTER_SHIFT) for t in ids]
        r = httpx.post(url, json={"token_ids": keys}, timeout=10)
        assert r.status_code == 400 and "token ids in [0, " in r.json()["error"]["message"], (space, r.text)


def test_an_export_body_past_its_bound_is_refused_whether_or_not_it_says_its_length(fleet):
    source, _, _ = fleet
    ids = prompt(55, 100)
    complete(source.url, [*ids, 1])
    bound = source.app.state.kv_transfer.max_export_body  # the token ids of the worker's context, and more
    padded = orjson.dumps({"token_ids": [*ids, 1], "padding": "x" * bound})  # valid, but too large

    def chunks() -> Iterator[bytes]:  # NOTE: an iterator is sent chunked: no content-length
        for i in range(0, len(padded), 64 << 10):
            yield padded[i : i + (64 << 10)]

    for content in (padded, chunks()):
        r = httpx.post(source.url + EXPORT_PATH, content=content, timeout=30)
        assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = httpx.post(source.url + EXPORT_PATH, json={"token_ids": [*ids, 1]}, timeout=10)
    assert r.status_code == 200 and read_headers(r.headers)[2][2] == 96  # and it keeps serving


class _BadPeer(BaseHTTPRequestHandler):
    """A peer whose exports are wrong: too slow (/slow), more tokens than asked for (/big), more
    bytes than announced (/long), fewer (/short), NaN values (/nan) or an inf in the last layer's V
    (/inf); or busy (/busy, 503). It announces the tokens asked for (a page more for /big)."""

    sending = threading.Event()  # set once a slow answer's body has begun

    def do_POST(self) -> None:
        asked = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
        mode = self.path.split("/")[1]  # NOTE: the receiver asks for <base URL>/v1/kv/export
        if mode == "busy":
            body = orjson.dumps({"error": {"message": "at the bound", "code": "kv_transfer_busy"}})
            self.send_response(503)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        shape = (2, 4, asked["max_tokens"] + (PAGE if mode == "big" else 0), 2, 32)
        kv = torch.full(shape, float("nan")) if mode == "nan" else torch.zeros(shape)
        if mode == "inf":
            kv[1, -1, -1, -1, -1] = float("inf")
        body = body_view(kv).tobytes()
        body = body + b"x" if mode == "long" else body[:-1] if mode == "short" else body
        self.send_response(200)
        headers = export_headers(shape, torch.float32, asked["start"], PAGE)
        del headers["content-length"]  # NOTE: the body ends when the connection does: any length
        for name, value in {**headers, "content-type": "application/octet-stream"}.items():
            self.send_header(name, value)
        self.end_headers()
        with contextlib.suppress(OSError):  # NOTE: the receiver hangs up once it has had enough
            if mode == "slow":
                for i in range(0, 600):  # 30 s unless the receiver gives up
                    self.wfile.write(body[i * 64 : (i + 1) * 64])
                    self.wfile.flush()
                    _BadPeer.sending.set()
                    time.sleep(0.05)
            else:
                self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def bad_peer() -> Iterator[str]:
    """The base URL of a _BadPeer server."""
    peer = ThreadingHTTPServer(("127.0.0.1", 0), _BadPeer)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{peer.server_address[1]}"
    finally:
        peer.shutdown()
        peer.server_close()


def test_a_slow_or_oversized_answer_is_cut_off(fleet, bad_peer, caplog):
    _, _, plain = fleet
    with serve(kv_transfer_max_mib=1, kv_fetch_timeout_s=0.5) as receiver:
        for path, why in [("/slow", "timed out|read timeout"), ("/big", "asked for <= 1088"),
                          ("/long", "body longer"), ("/short", "bytes short")]:  # fmt: skip
            ids = prompt(70 + len(path) + ord(path[1]), 1100)
            started = time.monotonic()
            with caplog.at_level("WARNING", logger="worker.kv_transfer"):
                answer = complete(receiver.url, ids, bad_peer + path)
            assert time.monotonic() - started < 10  # NOTE: a bound on the wait, not a timing claim
            assert cached(answer) == 0 and re.search(why, caplog.text), path
            assert_same_answer(answer, complete(plain.url, ids))
        assert outcome(receiver.url, "error") == 4
        assert_nothing_held(receiver)  # NOTE: the pages taken for each were given back


def test_kv_holding_nan_or_inf_is_refused_and_nothing_of_it_is_cached(fleet, bad_peer, caplog):
    """Such KV was cached as fetched (outcome ok, 400 tokens cached) and answered the prompt, and every later
    one of its prefix, with token 0 of no logprob: a faulty peer holding the fleet's key broke the prefix
    for everyone. Refused now, whether in the first group of slabs or the last (after others were written)."""
    _, _, plain = fleet
    with serve(kv_transfer_max_mib=1) as receiver:
        for path in ("/nan", "/inf"):
            ids = prompt(90 + ord(path[1]), 400)
            with caplog.at_level("WARNING", logger="worker.kv_transfer"):
                answer = complete(receiver.url, ids, bad_peer + path)
            assert cached(answer) == 0 and "holds inf or NaN" in caplog.text, path
            assert_same_answer(answer, complete(plain.url, ids))
            assert_same_answer(complete(receiver.url, [*ids[:-1], 7]), complete(plain.url, [*ids[:-1], 7]))
        assert outcome(receiver.url, "error") == 2 and outcome(receiver.url, "ok") == 0
        assert_nothing_held(receiver)


def test_transfers_under_way_bound_the_kv_a_worker_holds_and_give_it_back(fleet, bad_peer):
    source, _, plain = fleet
    # a transfer of n tiny tokens holds two slabs of n x 256 bytes: the slow peer's 2,048 tokens
    # (the most a transfer may carry with a 1 MiB bound) hold all of it until the timeout
    with serve(kv_transfer_max_mib=1, kv_fetch_timeout_s=4) as receiver:
        held = prompt(90, 300)
        complete(receiver.url, [*held, 1])  # something the receiver could export
        _BadPeer.sending.clear()
        slow = threading.Thread(target=complete, args=(receiver.url, prompt(91, 2100), bad_peer + "/slow"))
        slow.start()
        assert _BadPeer.sending.wait(10)
        time.sleep(0.3)  # NOTE: the receiver counts the KV once it has read the answer's headers
        assert receiver.app.state.kv_transfer.held == 1 << 20
        assert counter(receiver.url, "radixgate_worker_kv_transfer_held_bytes") == 1 << 20
        r = httpx.post(receiver.url + EXPORT_PATH, json={"token_ids": [*held, 1]}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_transfer_busy"
        assert exports(receiver.url, "busy") == 1
        ids = prompt(92, 600)
        complete(source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], source.url)  # fits the source, not the receiver
        assert cached(answer) == 0 and outcome(receiver.url, "busy") == 1
        assert_same_answer(answer, complete(plain.url, [*ids, 2]))
        slow.join(30)
        assert outcome(receiver.url, "error") == 1  # the slow fetch timed out and gave its bytes back
        assert_nothing_held(receiver)
        ids = prompt(94, 600)  # NOTE: the busy request left [*ids, 2] cached here
        complete(source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], source.url)
        assert cached(answer) == 592 and outcome(receiver.url, "ok") == 1
        assert_same_answer(answer, complete(plain.url, [*ids, 2]))
        for _ in range(2):  # NOTE: the second fits only if the first gave its bytes back once sent
            r = httpx.post(receiver.url + EXPORT_PATH, json={"token_ids": [*held, 1]}, timeout=10)
            assert r.status_code == 200 and len(r.content) == 288 * 2048
        assert_nothing_held(receiver)
    # a source whose transfers are at their bound answers 503, and its receiver computes
    with serve(kv_transfer_max_mib=1) as receiver:
        ids = prompt(93, 400)
        answer = complete(receiver.url, ids, bad_peer + "/busy")
        assert cached(answer) == 0 and outcome(receiver.url, "busy") == 1
        assert_same_answer(answer, complete(plain.url, ids))


def test_simulated_workers_move_placeholder_kv_and_model_the_link_and_copies():
    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    def sim() -> LiveServer:
        cfg = WorkerConfig(engine="sim", kv_cache_tokens=8192, sim_decode_base_ms=1.0)
        return LiveServer(build_sim_engine(cfg), kv_hints="any", kv_link_ms_per_token=0.12)

    with sim() as source, sim() as receiver:
        ids = prompt(95, 1000)
        complete(source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], source.url)
        assert answer["simulated"] is True and cached(answer) == 992  # 62 whole pages of the 1,000
        assert outcome(receiver.url, "ok") == 1
        assert source.engine.executor.transferred == receiver.engine.executor.transferred == 992
        assert cached_hashes(receiver.url) >= set(block_hashes([*ids, 2][:992], PAGE, "tiny"))
        fetch = receiver.engine.metrics.kv_fetch_seconds.collect()[0]
        total = next(s.value for s in fetch.samples if s.name.endswith("_sum"))
        assert total >= 0.9 * 992 * 0.12e-3  # NOTE: the modelled link's wait is part of the fetch


def test_an_export_whose_receiver_leaves_is_counted_cut_not_sent():
    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    cfg = WorkerConfig(engine="sim", kv_cache_tokens=8192, sim_decode_base_ms=1.0)
    # NOTE: a link of 1 ms a token: 2,000 tokens take 2 s to send
    with LiveServer(build_sim_engine(cfg), kv_hints="any", kv_link_ms_per_token=1.0) as source:
        ids = prompt(97, 2000)
        complete(source.url, [*ids, 1])
        exported = counter(source.url, EXPORTED)
        body = {"token_ids": [*ids, 1], "start": 0, "max_tokens": 1984}
        with httpx.stream("POST", source.url + EXPORT_PATH, json=body, timeout=10) as r:
            assert r.status_code == 200  # NOTE: the receiver leaves right after the head
        poll(lambda: exports(source.url, "cut") == 1, "the export to be counted cut")
        assert exports(source.url, "ok") == 0 and counter(source.url, EXPORTED) == exported
        assert_nothing_held(source)
        # one read whole is counted sent, with its tokens
        r = httpx.post(source.url + EXPORT_PATH, json={**body, "max_tokens": 64}, timeout=10)
        assert r.status_code == 200 and exports(source.url, "ok") == 1
        assert counter(source.url, EXPORTED) == exported + 64


def test_a_fetch_asks_for_what_the_link_brings_in_half_its_timeout():
    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    def sim() -> LiveServer:  # NOTE: a link of 1 ms a token and a 2 s timeout
        cfg = WorkerConfig(engine="sim", kv_cache_tokens=16384, sim_decode_base_ms=1.0)
        return LiveServer(
            build_sim_engine(cfg), kv_hints="any", kv_link_ms_per_token=1.0, kv_fetch_timeout_s=2.0
        )

    with sim() as source, sim() as receiver:
        kv = receiver.app.state.kv_transfer
        assert kv.timely_tokens() > 16384  # nothing measured yet
        ids = prompt(96, 500)
        complete(source.url, [*ids, 1])
        assert cached(complete(receiver.url, [*ids, 2], source.url)) == 496  # ~0.5 s: measured
        timely = kv.timely_tokens()
        assert 400 <= timely <= 1008  # ~1,000 tokens a second, for 1 s
        ids = prompt(97, 3000)  # 3 s on this link: past the timeout
        complete(source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], source.url)
        # NOTE: it asks for half the time left, a moment under the timeout: up to a page less
        assert timely - 16 <= cached(answer) <= timely and outcome(receiver.url, "ok") == 2
        assert outcome(receiver.url, "error") == 0
        assert_nothing_held(receiver)


def test_a_transfer_queued_behind_too_much_is_refused(caplog):
    from worker.config import WorkerConfig
    from worker.sim_engine import build_sim_engine

    def sim() -> LiveServer:  # NOTE: a link of 1 ms a token; transfers may wait 200 ms (the default)
        cfg = WorkerConfig(engine="sim", kv_cache_tokens=16384, sim_decode_base_ms=1.0)
        return LiveServer(
            build_sim_engine(cfg), kv_hints="any", kv_link_ms_per_token=1.0, kv_fetch_timeout_s=10.0
        )

    with sim() as source, sim() as receiver:
        for seed, n in ((100, 300), (101, 1600), (102, 600)):
            complete(source.url, [*prompt(seed, n), 1])
        assert cached(complete(receiver.url, [*prompt(100, 300), 2], source.url)) == 288  # measured
        long = threading.Thread(target=complete, args=(receiver.url, [*prompt(101, 1600), 2], source.url))
        long.start()  # ~1.6 s on this link
        time.sleep(0.4)
        assert receiver.app.state.kv_transfer.link.backlog_s() > 0.2
        assert source.app.state.kv_transfer.link_out.backlog_s() > 0.2
        with caplog.at_level("INFO", logger="worker.kv_transfer"):
            answer = complete(receiver.url, [*prompt(102, 600), 2], source.url)
        assert cached(answer) == 0 and outcome(receiver.url, "busy") == 1
        assert "fetches under way would hold it up" in caplog.text  # NOTE: not asked for
        r = httpx.post(source.url + EXPORT_PATH, json={"token_ids": [*prompt(102, 600), 1]}, timeout=10)
        assert r.status_code == 503 and "would hold this one up" in r.json()["error"]["message"]
        # NOTE: an export is counted once sent whole: the long one is still under way
        assert exports(source.url, "busy") == 1 and exports(source.url, "ok") == 1
        long.join(30)
        assert outcome(receiver.url, "ok") == 2 and exports(source.url, "ok") == 2
        assert cached(complete(receiver.url, [*prompt(102, 600), 3], source.url)) == 592
        assert_nothing_held(receiver)
        assert_nothing_held(source)


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_slabs_read_and_written_a_group_at_a_time_move_every_layers_k_and_v(device: str, dtype) -> None:
    from tests.worker.test_host_cache import same as equal  # NOTE: bit for bit (torch has no fp8 equal)
    from worker.kv_pages import read_kv, write_kv
    from worker.kv_pool import KVPool, slots_for

    layers, ps = 3, 4
    src = KVPool(8, ps, num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, device=device)
    dst = KVPool(8, ps, num_layers=layers, num_kv_heads=2, head_dim=8, dtype=dtype, device=device)
    for cache in (*src.k_cache, *src.v_cache):
        cache.copy_(torch.randn(cache.shape).to(dtype))
    for cache in (*dst.k_cache, *dst.v_cache):
        cache.fill_(float("nan"))
    from_slots = torch.from_numpy(slots_for(np.array([5, 2, 7]), 0, 12, ps))
    to_slots = torch.from_numpy(slots_for(np.array([1, 6]), 0, 8, ps))
    whole = read_kv(src, from_slots)  # [2 x layers, n, heads, dim]: K of each layer, then V
    assert whole.shape == (2 * layers, 12, 2, 8) and whole.device.type == "cpu"
    for layer in range(layers):  # NOTE: the wire's order (docs/contracts.md)
        assert equal(whole[layer], src.k_cache[layer][from_slots.to(device)].cpu())
        assert equal(whole[layers + layer], src.v_cache[layer][from_slots.to(device)].cpu())
    for lo in range(0, 2 * layers, 4):  # groups of 4 slabs, the last of 2
        group = read_kv(src, from_slots, lo, min(lo + 4, 2 * layers))
        assert equal(group, whole[lo : lo + 4])
        write_kv(dst, to_slots, group[:, 4:], lo)  # NOTE: the first page is cached there already
    for layer in range(layers):
        for got, want in ((dst.k_cache[layer], src.k_cache[layer]), (dst.v_cache[layer], src.v_cache[layer])):
            assert equal(got[to_slots.to(device)], want[from_slots[4:].to(device)])
            untouched = torch.ones(got.shape[0], dtype=torch.bool, device=device)
            untouched[to_slots.to(device)] = False
            assert torch.isnan(got[untouched].float()).all()


def test_fp8_pools_move_their_bytes_and_a_pool_of_another_dtype_is_refused(fleet):
    """Workers with --kv-cache-dtype fp8_e4m3: the receiver takes the source's fp8 bytes and answers as a
    worker that cached the same prefix itself (read back rounded, as the fetched one is); an fp8 worker
    hinted to a float32 worker refuses its KV (another layout) and computes the prefill."""
    float32_source = fleet[0]
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    with serve(**fp8) as source, serve(**fp8) as receiver, serve(**fp8) as own:
        info = httpx.get(source.url + "/v1/cache/info", timeout=10).json()
        assert info["kv_dtype"] == "float8_e4m3fn"
        assert (
            info["kv_bytes_per_token"] * 4
            == httpx.get(float32_source.url + "/v1/cache/info").json()["kv_bytes_per_token"]
        )
        shared = prompt(40, 300)
        for worker in (source, own):
            complete(worker.url, shared + prompt(41, 20))
        ids = shared + prompt(42, 30)
        hinted = complete(receiver.url, ids, source.url)
        reference = complete(own.url, ids)
        assert cached(hinted) == cached(reference) == 300 // PAGE * PAGE
        assert outcome(receiver.url, "ok") == 1
        assert_same_answer(hinted, reference)
        # a float32 source's KV is not this pool's: refused, the prefill computed here
        ids = prompt(43, 200)
        complete(float32_source.url, [*ids, 1])
        answer = complete(receiver.url, [*ids, 2], float32_source.url)
        assert cached(answer) == 0 and outcome(receiver.url, "error") == 1
        assert_same_answer(answer, complete(own.url, [*ids, 2]))
        assert_nothing_held(receiver)
