"""The router as a real process in front of real upstream servers (echo backends) on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from router.tokenization import HFTokenizer
from tests.support import wait_until
from tests.test_tokenization import byte_level_dir

SYSTEM = "You are a meticulous assistant for the radixgate test-suite. " * 8


def chat(user: str, system: str = SYSTEM, **extra) -> dict:
    body = {
        "model": "echo",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    body.update(extra)
    return body


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label-string: value} for one metric family in Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out


@pytest.fixture(scope="module")
def fleet(launch_module):
    """Three echo backends (20 ms per output token) behind one cache_aware router."""
    backends = [
        launch_module.echo_backend("--decode-ms-per-token", "20", "--name", f"b{i}") for i in range(3)
    ]
    router = launch_module.router([b.url for b in backends], "--admin-token", "s3cret")
    return router, backends


def test_backends_without_kv_events_hold_up_no_start_up(fleet):
    """Backends with no event stream (vLLM, SGLang, the echo backend) end their first sync attempt
    at once: the router's start-up waits for no snapshot of theirs."""
    router, backends = fleet
    log = router.log()
    assert log.count("has no KV event stream") == len(backends)
    assert "serving before the cache snapshots" not in log


def test_same_long_prefix_goes_to_same_worker_and_hits(fleet):
    router, _ = fleet
    with httpx.Client(base_url=router.url, timeout=30) as client:
        workers, cached = [], []
        for i in range(6):
            r = client.post("/v1/chat/completions", json=chat(f"question {i}", system="Tenant A. " * 40))
            assert r.status_code == 200, r.text
            workers.append(r.headers["x-radixgate-worker"])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(workers)) == 1
    assert cached[0] == 0
    assert all(c >= 384 for c in cached[1:])  # the 40-sentence system prompt came from the cache


def test_hot_prefix_spreads_under_load_and_keeps_hit_rate(fleet):
    router, _ = fleet

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post(
            "/v1/chat/completions", json=chat(f"q{i}", system="Hot prefix! " * 60, max_tokens=10)
        )

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            await one(client, -1)  # warm: the prefix is now cached on one worker
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    spread = Counter(r.headers["x-radixgate-worker"] for r in responses)
    assert len(spread) >= 2, spread  # 48 concurrent requests did not pile onto one worker
    usage = [r.json()["usage"] for r in responses]
    hit = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage) / sum(
        u["prompt_tokens"] for u in usage
    )
    # Every worker that receives the prefix computes it once; the rest are hits.
    misses_at_most = len(spread)
    assert hit >= (len(responses) - misses_at_most) / len(responses) * 0.9


def test_streaming_passes_chunks_through_as_they_arrive(launch):
    slow = launch.echo_backend("--decode-ms-per-token", "250")
    router = launch.router([slow.url])
    arrivals = []
    t0 = time.perf_counter()
    with httpx.stream(
        "POST",
        router.url + "/v1/completions",
        json={"model": "echo", "prompt": "stream me", "max_tokens": 4, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            arrivals.append((time.perf_counter() - t0, chunk))
    body = b"".join(c for _, c in arrivals)
    assert body.endswith(b"data: [DONE]\n\n")
    assert body.count(b'"text":"x"') == 4
    # The backend waits 250 ms between tokens: a buffering proxy would deliver everything at the end.
    first_token_at = next(t for t, c in arrivals if b'"text":"x"' in c)
    assert first_token_at < arrivals[-1][0] - 0.5


def sse_data(body: bytes) -> list[bytes]:
    """The data of each event of an SSE body, in order."""
    return [line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")]


def test_the_two_hit_rates_count_the_same_answers_a_broken_stream_in_neither(launch):
    """The predicted hit rate's tokens are counted with the worker's usage: a stream cut off
    before its usage chunk counts in neither rate, or predicted and actual would drift apart."""
    victim = launch.echo_backend("--decode-ms-per-token", "20")
    router = launch.router([victim.url])
    names = ["radixgate_upstream_prompt_tokens_total", "radixgate_upstream_predicted_cached_tokens_total",
             "radixgate_upstream_usage_prompt_tokens_total", "radixgate_upstream_cached_tokens_total"]  # fmt: skip
    label = f'{{worker="{victim.url}"}}'

    def counters() -> list[float]:
        text = httpx.get(router.url + "/metrics").text
        return [metric_values(text, name)[label] for name in names]

    prompt = "a shared head, " * 20
    for tail in ("one", "two"):  # the second is predicted to hit what the first left
        body = {"model": "echo", "prompt": prompt + tail, "max_tokens": 2, "stream": True}
        assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    whole = counters()
    assert whole[0] > 0 and whole[1] > 0 and whole[2] > 0 and whole[3] > 0
    body = {"model": "echo", "prompt": prompt + "three", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = r.iter_raw()
        received = next(chunks)
        victim.proc.kill()
        received += b"".join(chunks)
    assert b"stream_broken" in received
    assert counters() == whole


def test_a_batch_of_prompts_is_predicted_by_the_prompt_it_is_routed_by(launch):
    """A completions batch is routed by its first prompt, the one the index predicts: the rest counted as
    routed but uncached made a warm [P] * 4 read a predicted hit rate of ~0.25 against ~0.99 served from
    cache, and fired the prediction-gap alert over an index that was right."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    router = launch.router([worker.url])
    names = ["radixgate_upstream_prompt_tokens_total", "radixgate_upstream_predicted_cached_tokens_total",
             "radixgate_upstream_usage_prompt_tokens_total", "radixgate_upstream_cached_tokens_total"]  # fmt: skip

    def counters() -> list[float]:
        text = httpx.get(router.url + "/metrics").text
        return [metric_values(text, name)[f'{{worker="{worker.url}"}}'] for name in names]

    prompt = "a document every question of the batch shares. " * 40
    body = {"model": "sim-8b", "prompt": prompt, "max_tokens": 1}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 200
    before = counters()
    batch = {**body, "prompt": [prompt] * 4}
    assert httpx.post(router.url + "/v1/completions", json=batch, timeout=30).status_code == 200
    routed, predicted, served, cached = (b - a for a, b in zip(before, counters(), strict=True))
    assert routed == before[0] and served == 4 * before[2]  # the routed prompt, and the worker's four
    assert predicted / routed > 0.9 and cached / served > 0.9, (predicted, routed, cached, served)


def test_a_stream_whose_worker_dies_ends_with_an_error_event(launch):
    """Tokens already reached the client, so nothing is retried; the client is told the answer is
    cut off (an error event, then [DONE], as a worker ends a stream whose request failed) rather
    than left with a stream that just stops."""
    victim = launch.echo_backend("--decode-ms-per-token", "50")
    router = launch.router([victim.url], "--access-log")
    body = {"model": "echo", "prompt": "stream me", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = r.iter_raw()
        received = next(chunks)
        victim.proc.kill()
        received += b"".join(chunks)
    *tokens, error, done = sse_data(received)
    assert 1 <= len(tokens) < 400 and all(orjson.loads(t)["choices"][0]["text"] == "x" for t in tokens)
    assert orjson.loads(error)["error"]["code"] == "stream_broken" and done == b"[DONE]"
    errors = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_upstream_errors_total")
    assert errors[f'{{kind="stream_broken",worker="{victim.url}"}}'] == 1
    wait_until(lambda: len(router.access_lines()) == 1, 10, what="the access line")
    (line,) = router.access_lines()
    assert line["status"] == 200 and line["error"] == "stream_broken" and line["worker"] == victim.url


@pytest.mark.parametrize("usage", [True, False], ids=["usage-asked", "usage-added"])
def test_a_stream_cut_off_inside_an_event_ends_that_event_before_the_error(launch, usage):
    """The worker's connection drops half-way through an event: a half event passed on is closed
    off (the client reads it as a bad event) so the error event after it parses as its own. Where
    the router added the usage chunk to the request (``usage-added``), it passes whole lines only,
    so the half event never reaches the client."""
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        async def body():
            yield b'data: {"choices":[{"index":0,"text":"whole"}]}\n\n'
            yield b'data: {"choices":[{"index":0,"te'
            raise RuntimeError("the worker dies here")

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[
        Route("/health", lambda r: JSONResponse({"status": "ok", "running": 0, "waiting": 0})),
        Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "half"}]})),
        Route("/v1/completions", completions, methods=["POST"]),
    ])  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    try:
        wait_until(lambda: server.started, 10, what="the half-event worker")
        router = launch.router([f"http://127.0.0.1:{sock.getsockname()[1]}"])
        body = {"model": "half", "prompt": "cut me off", "max_tokens": 4, "stream": True}
        if usage:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            received = b"".join(r.iter_raw())
        events = received.split(b"\n\n")
        assert events[0] == b'data: {"choices":[{"index":0,"text":"whole"}]}'
        if usage:
            assert events.pop(1) == b'data: {"choices":[{"index":0,"te'
        error, done, end = events[1:]
        assert orjson.loads(error.removeprefix(b"data: "))["error"]["code"] == "stream_broken"
        assert (done, end) == (b"data: [DONE]", b"")
    finally:
        server.should_exit = True


def test_a_responses_stream_whose_worker_dies_ends_with_response_failed(launch):
    victim = launch.sim_worker()
    router = launch.router([victim.url])
    body = {"model": "sim-8b", "input": "Write at length.", "max_output_tokens": 4000, "stream": True}
    with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=60) as r:
        chunks = r.iter_raw()
        received = b""
        while b"response.output_text.delta" not in received:
            received += next(chunks)
        victim.proc.kill()
        received += b"".join(chunks)
    events = [orjson.loads(d) for d in sse_data(received)]
    *answered, error = events
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert answered[-1]["type"] == "response.output_text.delta"
    assert error["type"] == "response.failed" and error["response"]["status"] == "failed"
    assert error["response"]["id"] == events[0]["response"]["id"]
    assert (
        error["response"]["error"]["type"] == "stream_broken"
        and error["response"]["error"]["code"] == "server_error"
    )
    assert received.endswith(b"\n\n") and b"[DONE]" not in received  # the Responses API has none


def test_round_robin_spreads_evenly(launch):
    backends = [launch.echo_backend() for _ in range(4)]
    router = launch.router([b.url for b in backends], "--policy", "round_robin")
    with httpx.Client(base_url=router.url, timeout=30) as client:
        seen = Counter(
            client.post("/v1/completions", json={"model": "echo", "prompt": "same prompt " * 20}).headers[
                "x-radixgate-worker"
            ]
            for _ in range(40)
        )
    assert sorted(seen.values()) == [10, 10, 10, 10]


def test_killed_worker_is_skipped_and_no_request_hangs(launch):
    backends = [launch.echo_backend() for _ in range(3)]
    router = launch.router([b.url for b in backends], "--policy", "round_robin")
    victim = backends[1]

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=router.url, timeout=20) as client:
            statuses = []
            for i in range(30):
                if i == 10:
                    victim.proc.kill()
                    victim.proc.wait()
                r = await client.post("/v1/completions", json={"model": "echo", "prompt": f"p{i} " * 10})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    assert r.headers["x-radixgate-worker"] != victim.url or i < 10
            return statuses

    statuses = asyncio.run(asyncio.wait_for(run(), timeout=60))
    assert statuses == [200] * 30  # the dead worker's share was retried elsewhere
    metrics = httpx.get(router.url + "/metrics").text
    errors = metric_values(metrics, "radixgate_upstream_errors_total")
    assert any(victim.url in k and v >= 1 for k, v in errors.items())
    for w in httpx.get(router.url + "/workers").json()["workers"]:  # failed attempts gave their load back
        assert (w["in_flight"], w["pending_prefill_tokens"]) == (0, 0)


def test_frozen_worker_is_routed_around_and_gets_traffic_after_it_resumes(launch):
    backends = [launch.echo_backend() for _ in range(2)]
    router = launch.router([b.url for b in backends], "--policy", "round_robin")
    frozen = backends[0]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:

        def frozen_unhealthy() -> bool:
            workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
            return not next(w for w in workers if w["url"] == frozen.url)["healthy"]

        wait_until(frozen_unhealthy, timeout=15, what="frozen worker marked unhealthy")
        with httpx.Client(base_url=router.url, timeout=10) as client:
            served = {
                client.post("/v1/completions", json={"model": "echo", "prompt": f"x{i}"}).headers[
                    "x-radixgate-worker"
                ]
                for i in range(10)
            }
        assert served == {backends[1].url}
    finally:
        frozen.proc.send_signal(signal.SIGCONT)

    def traffic_returns() -> bool:
        r = httpx.post(router.url + "/v1/completions", json={"model": "echo", "prompt": "back?"}, timeout=10)
        return r.headers.get("x-radixgate-worker") == frozen.url

    wait_until(traffic_returns, timeout=15, interval=0.2, what="traffic back to the resumed worker")


def test_requests_waiting_on_a_hung_worker_go_elsewhere_once_its_health_checks_go_unanswered(
    launch, tmp_path
):
    """A stopped worker takes connections and answers nothing: its requests still waiting for their
    head (a stream's, and a non-stream answer's, which comes last) move to the other worker after
    three unanswered health checks, not after first_byte_timeout_s / request_timeout_s (60 s)."""
    # NOTE: the worker to hang is slow (seconds a prompt), so that its requests are surely waiting on it when it
    # stops: stopped first, it could be found unhealthy before they were routed, and none would wait on it
    hung, survivor = launch.echo_backend("--prefill-us-per-token", "1000000"), launch.echo_backend()
    router = _router_with(launch, tmp_path, [hung, survivor], policy="round_robin", health_interval_s=0.3,
                          health_timeout_s=0.3, first_byte_timeout_s=60, request_timeout_s=60)  # fmt: skip
    wait_until(lambda: all(w["healthy"] for w in httpx.get(router.url + "/workers").json()["workers"]), 10,
               what="both workers healthy")  # fmt: skip

    def ask(i: int) -> tuple[int, str, bytes]:
        body = {"model": "echo", "prompt": f"waiting {i}", "max_tokens": 2, "stream": i % 2 == 0}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        return r.status_code, r.headers.get("x-radixgate-worker", ""), r.content

    def waiting_on_hung() -> int:
        rows = httpx.get(router.url + "/workers").json()["workers"]
        return next(w["in_flight"] for w in rows if w["url"] == hung.url)

    try:
        with ThreadPoolExecutor(4) as pool:
            asked = pool.map(ask, range(4))
            wait_until(lambda: waiting_on_hung() == 2, 10, what="two requests waiting on the slow worker")
            hung.proc.send_signal(signal.SIGSTOP)
            answers = list(asked)
    finally:
        hung.proc.send_signal(signal.SIGCONT)
    assert [(status, worker) for status, worker, _ in answers] == [(200, survivor.url)] * 4
    errors = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_upstream_errors_total")
    assert errors[f'{{kind="unresponsive",worker="{hung.url}"}}'] >= 1
    for w in httpx.get(router.url + "/workers").json()["workers"]:  # the attempts gave their load back
        assert (w["in_flight"], w["pending_prefill_tokens"]) == (0, 0)


def test_client_errors_do_not_count_against_the_worker(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url])
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for _ in range(10):  # the backend rejects an empty prompt with 400
            r = client.post("/v1/completions", json={"model": "echo", "prompt": ""})
            assert r.status_code == 400
        assert client.post("/v1/completions", json={"model": "echo", "prompt": "fine"}).status_code == 200
        workers = client.get("/workers").json()["workers"]
    assert workers[0]["breaker"] == "closed"
    errors = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_upstream_errors_total")
    assert sum(errors.values()) == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request"),
        ("/v1/chat/completions", orjson.dumps({"model": "echo"}), 400, "invalid_request"),
        ("/v1/chat/completions", orjson.dumps({"model": "echo", "messages": "hi"}), 400, "invalid_request"),
        ("/v1/chat/completions", orjson.dumps({"model": 3, "messages": []}), 400, "invalid_type"),
        ("/v1/completions", orjson.dumps({"model": "echo", "prompt": {"a": 1}}), 400, "invalid_request"),
        ("/v1/completions", orjson.dumps({"model": "echo", "prompt": [1, -5]}), 400, "invalid_request"),
        (
            "/v1/completions",
            orjson.dumps({"model": "echo", "prompt": "x", "stream": "yes"}),
            400,
            "invalid_type",
        ),
        ("/v1/completions", orjson.dumps({"model": "gpt-nope", "prompt": "x"}), 404, "model_not_found"),
        (
            "/v1/responses",
            orjson.dumps({"model": "echo", "input": [{"role": ["user"]}]}),
            400,
            "invalid_request",
        ),
        ("/tokenize", orjson.dumps({"model": ["echo"], "prompt": "x"}), 400, "invalid_type"),
        (
            "/v1/completions",
            b'{"model": "echo", "prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}',
            413,
            "body_too_large",
        ),
    ],
)
def test_bad_input_gets_openai_error_and_router_keeps_serving(fleet, path, body, status, code):
    router, _ = fleet
    r = httpx.post(router.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    # NOTE: a body refused unread: the connection is not kept for its rest (read as the next request)
    assert (r.headers.get("connection") == "close") == (status == 413)
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "echo", "prompt": "still alive"}, timeout=10
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "allow"),
    [
        ("POST", "/v1/embeddings", 404, "unknown_endpoint", None),
        ("GET", "/nope", 404, "unknown_endpoint", None),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed", "POST"),
        ("PUT", "/v1/completions", 405, "method_not_allowed", "POST"),
        ("POST", "/v1/models", 405, "method_not_allowed", "GET, HEAD"),
    ],
)
def test_unknown_endpoints_and_methods_get_openai_errors(fleet, method, path, status, code, allow):
    router, _ = fleet
    r = httpx.request(method, router.url + path, timeout=10)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == code and f"{method} {path}" in err["message"]
    assert (r.headers.get("allow") and set(r.headers["allow"].split(", "))) == (
        allow and set(allow.split(", "))
    )


def test_admin_add_and_remove_workers(fleet, launch):
    router, backends = fleet
    extra = launch.echo_backend()
    auth = {"authorization": "Bearer s3cret"}
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert client.post("/workers", json={"url": extra.url}).status_code == 401
        r = client.post("/workers", json={"url": extra.url}, headers=auth)
        assert r.status_code == 201 and r.json()["healthy"] is True
        urls = {w["url"] for w in client.get("/workers", headers=auth).json()["workers"]}
        assert urls == {b.url for b in backends} | {extra.url}
        # another spelling of the same URL (a zero-padded port, a trailing slash) names the same worker
        respelled = extra.url.replace("127.0.0.1:", "127.0.0.1:0") + "/"
        r = client.post("/workers", json={"url": respelled}, headers=auth)
        assert r.status_code == 200 and r.json()["added"] is False and r.json()["worker"] == extra.url
        assert len(client.get("/workers", headers=auth).json()["workers"]) == len(backends) + 1
        for bad in (
            "ftp://x",
            "http://",
            "http://[::1",
            "http://a b",
            "http://127.0.0.1:99999",
            "http://a/?q",
            "http://a:1?",
            "http://a:1#",
            "http://a:0",
            "http://a..b:80",
            "http://user:pw@a:1",
            "http://a:1\\@b",
            "http://bücher.example:1",
            "http://a:1/é",
        ):
            r = client.post("/workers", json={"url": bad}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)
        # the router itself: each request would forward itself again (12,203 descriptors, then 504)
        port = router.url.rsplit(":", 1)[1]
        for own in (router.url, f"http://localhost:{port}"):
            r = client.post("/workers", json={"url": own}, headers=auth)
            assert r.status_code == 400 and "this router's own address" in r.text, r.text
        assert client.delete("/workers", params={"url": respelled}, headers=auth).status_code == 200
        assert client.delete("/workers", params={"url": extra.url}, headers=auth).status_code == 404
        urls = {w["url"] for w in client.get("/workers", headers=auth).json()["workers"]}
        assert urls == {b.url for b in backends}


def test_a_worker_added_to_a_fleet_holding_every_prefix_takes_requests(launch):
    # One worker holds the shared prompt; a fresh one joins; 24 concurrent requests follow. By its
    # saving alone the holder's window (2 x mean load) would keep all 24; a fresh worker among the
    # least loaded closes it to balance_abs, and once the newcomer holds the prompt load decides.
    holder = launch.echo_backend("--decode-ms-per-token", "50")
    router = launch.router([holder.url])
    body = chat("same question", max_tokens=20)
    for _ in range(3):
        r = httpx.post(router.url + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=10)
        assert r.headers["x-radixgate-worker"] == holder.url
    newcomer = launch.echo_backend("--decode-ms-per-token", "50")
    assert httpx.post(router.url + "/workers", json={"url": newcomer.url}, timeout=10).status_code == 201

    async def burst() -> Counter:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(24))
            )
        assert all(r.status_code == 200 for r in replies)
        return Counter(r.headers["x-radixgate-worker"] for r in replies)

    served = asyncio.run(asyncio.wait_for(burst(), timeout=60))
    # 6 of 24 here (the newcomer's first answer is not streamed, so its prefill counts until it
    # ends); with windows opened by the saving alone it got 2
    assert served[newcomer.url] >= 4, served


def test_debug_route_explains_without_sending(fleet):
    router, _ = fleet
    body = chat("explain me", system="Debug route prefix. " * 30)
    with httpx.Client(base_url=router.url, timeout=10) as client:
        before = client.post("/debug/route", json=body).json()
        assert all(c["matched_tokens"] == 0 for c in before["candidates"])
        served = client.post("/v1/chat/completions", json=body).headers["x-radixgate-worker"]
        after = client.post("/debug/route", json=body).json()
    assert after["worker"] == served
    assert after["policy"] == "cache_aware" and after["reason"]
    matched = {c["url"]: c["matched_tokens"] for c in after["candidates"]}
    assert matched[served] >= after["prompt_tokens"] - after["block_size"]
    assert all(v == 0 for url, v in matched.items() if url != served)


def test_debug_route_lists_the_workers_of_other_models_as_not_available(launch):
    one, other = launch.echo_backend("--model", "m1"), launch.echo_backend("--model", "m2")
    router = launch.router([one.url, other.url])
    wait_until(lambda: len(httpx.get(router.url + "/v1/models", timeout=5).json()["data"]) == 2, 10,
               what="both models learned")  # fmt: skip
    body = {**chat("whose?"), "model": "m2"}
    explained = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
    assert explained["worker"] == other.url
    available = {c["url"]: (c["healthy"], c["available"]) for c in explained["candidates"]}
    assert available == {one.url: (True, False), other.url: (True, True)}


def test_prompt_scoring_is_routed_by_load_with_the_whole_prompt_as_prefill(fleet):
    """echo + logprobs: the worker computes the whole prompt whatever it caches, so the router
    matches nothing for it (and counts all of it as pending prefill)."""
    router, _ = fleet
    prompt = "A prompt to score, long enough for several blocks. " * 8
    with httpx.Client(base_url=router.url, timeout=10) as client:
        assert (
            client.post(
                "/v1/completions", json={"model": "echo", "prompt": prompt, "max_tokens": 1}
            ).status_code
            == 200
        )
        plain = client.post("/debug/route", json={"model": "echo", "prompt": prompt, "max_tokens": 1}).json()
        scoring = client.post("/debug/route", json={"model": "echo", "prompt": prompt, "max_tokens": 0,
                                                    "echo": True, "logprobs": 0}).json()  # fmt: skip
    assert (
        max(c["matched_tokens"] for c in plain["candidates"]) >= plain["prompt_tokens"] - plain["block_size"]
    )
    assert all(c["matched_tokens"] == 0 for c in scoring["candidates"])
    assert scoring["prompt_tokens"] == plain["prompt_tokens"]
    assert scoring["whole_prompt_computed"] is True and plain["whole_prompt_computed"] is False


def test_metrics_report_predicted_and_actual_hits_per_worker(fleet):
    router, _ = fleet
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for i in range(3):
            assert (
                client.post("/v1/chat/completions", json=chat(f"m{i}", system="Metrics! " * 50)).status_code
                == 200
            )
        text = client.get("/metrics").text
    cached = metric_values(text, "radixgate_upstream_cached_tokens_total")
    predicted = metric_values(text, "radixgate_upstream_predicted_cached_tokens_total")
    assert sum(cached.values()) > 0 and sum(predicted.values()) > 0
    hit = metric_values(text, "radixgate_fleet_hit_rate")
    assert 0 < hit['{source="actual"}'] <= 1
    assert "radixgate_ttft_seconds_bucket" in text and "radixgate_route_decision_seconds_bucket" in text
    assert metric_values(text, "radixgate_prefix_index_entries")[""] > 0


def test_worker_restarted_on_same_address_gets_traffic_again(launch):
    backends = [launch.echo_backend() for _ in range(2)]
    router = launch.router([b.url for b in backends], "--policy", "round_robin")
    victim = backends[0]
    port = int(victim.url.rsplit(":", 1)[1])
    victim.proc.kill()
    victim.proc.wait()
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for i in range(6):  # served by the survivor meanwhile
            assert (
                client.post("/v1/completions", json={"model": "echo", "prompt": f"d{i}"}).status_code == 200
            )
        launch.echo_backend(port=port)

        def gets_traffic() -> bool:
            r = client.post("/v1/completions", json={"model": "echo", "prompt": "back"})
            return r.status_code == 200 and r.headers["x-radixgate-worker"] == victim.url

        wait_until(gets_traffic, timeout=15, interval=0.2, what="traffic to the restarted worker")


def test_unanswered_prefill_counts_in_load_until_the_first_chunk(launch):
    # 20 ms per uncached prompt token before the first byte, then 200 ms per output token
    slow = launch.echo_backend("--prefill-us-per-token", "20000", "--decode-ms-per-token", "200")
    router = launch.router([slow.url], "--prefill-tokens-per-load", "10")
    body = {"model": "echo", "prompt": "a prompt the worker has never seen", "max_tokens": 4, "stream": True}
    prompt_tokens = httpx.post(router.url + "/debug/route", json=body, timeout=5).json()["prompt_tokens"]

    def view() -> dict:
        return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]

    def pending_metric() -> float:
        text = httpx.get(router.url + "/metrics", timeout=5).text
        return metric_values(text, "radixgate_upstream_pending_prefill_tokens")[f'{{worker="{slow.url}"}}']

    first_chunk, finish = threading.Event(), threading.Event()
    chunks: list[bytes] = []

    def client() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            it = r.iter_raw()
            chunks.append(next(it))
            first_chunk.set()
            finish.wait(30)
            chunks.extend(it)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_until(lambda: view()["in_flight"] == 1, timeout=10, what="request sent")
        w = view()  # still in prefill: nothing cached, so the whole prompt is pending
        assert not first_chunk.is_set()
        assert w["pending_prefill_tokens"] == prompt_tokens > 0
        assert w["load"] == pytest.approx(1 + prompt_tokens / 10)
        assert pending_metric() == prompt_tokens
        assert first_chunk.wait(30)
        w = view()  # decoding: the request still counts, its prefill no longer does
        assert (w["in_flight"], w["pending_prefill_tokens"], w["load"]) == (1, 0, 1.0)
    finally:
        finish.set()
        thread.join(30)
    assert b"[DONE]" in b"".join(chunks)
    wait_until(lambda: view()["in_flight"] == 0, timeout=10, what="request finished")
    assert view()["pending_prefill_tokens"] == 0 and pending_metric() == 0


def test_client_disconnect_releases_load_and_cancels_upstream(launch):
    slow = launch.echo_backend("--decode-ms-per-token", "300")
    router = launch.router([slow.url])

    def router_in_flight() -> int:
        return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]["in_flight"]

    def backend_running() -> int:
        return httpx.get(slow.url + "/health", timeout=5).json()["running"]

    body = {"model": "echo", "prompt": "hang up on me", "max_tokens": 50, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = r.iter_raw()  # held: dropping the iterator would close the response
        next(chunks)  # the stream is flowing
        assert router_in_flight() == 1 and backend_running() == 1
        chunks.close()
    # closing the client's connection must close the upstream one: the backend stops generating
    wait_until(lambda: router_in_flight() == 0, timeout=10, what="router in-flight released")
    wait_until(lambda: backend_running() == 0, timeout=10, what="upstream stream cancelled")

    with pytest.raises(httpx.ReadTimeout):  # non-stream: the client gives up while the backend works
        httpx.post(router.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_until(lambda: router_in_flight() == 0, timeout=10, what="router in-flight released (non-stream)")
    wait_until(lambda: backend_running() == 0, timeout=10, what="upstream request cancelled (non-stream)")
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert metric_values(metrics, "radixgate_requests_total")['{endpoint="completions",status="499"}'] == 2
    ok = httpx.post(
        router.url + "/v1/completions", json={**body, "max_tokens": 1, "stream": False}, timeout=30
    )
    assert ok.status_code == 200


def test_affinity_group_pins_a_tenant_and_keeps_others_off(launch, tmp_path):
    """A tenant pinned by header to one exclusive worker: its requests all land there, other
    traffic never does; /debug/route and the metrics say so. A group whose members are all gone
    (overflow: none) gets a 503, counted as no_worker."""
    backends = [launch.echo_backend("--name", f"b{i}") for i in range(3)]
    pinned = backends[1].url
    config = tmp_path / "router.yaml"
    config.write_text(
        "router:\n"
        "  affinity_groups:\n"
        "    - name: acme\n"
        "      match: {header: {x-tenant: acme}}\n"
        f"      workers: [{pinned}]\n"
        "      exclusive: true\n"
        "    - name: ghost\n"
        "      match: {header: {x-tenant: ghost}}\n"
        "      workers: [http://127.0.0.1:1]\n"
        "      overflow: none\n"
    )
    router = launch.router([b.url for b in backends], "--config", str(config), "--policy", "round_robin")
    with httpx.Client(base_url=router.url, timeout=30) as client:
        acme = [
            client.post(
                "/v1/completions", json={"model": "echo", "prompt": f"p{i}"}, headers={"x-tenant": "acme"}
            )
            for i in range(6)
        ]
        others = [client.post("/v1/completions", json={"model": "echo", "prompt": f"o{i}"}) for i in range(6)]
        assert all(r.status_code == 200 for r in acme + others)
        assert {r.headers["x-radixgate-worker"] for r in acme} == {pinned}
        assert pinned not in {r.headers["x-radixgate-worker"] for r in others}
        explained = client.post(
            "/debug/route", json={"model": "echo", "prompt": "x"}, headers={"x-tenant": "acme"}
        ).json()
        assert explained["affinity_group"] == "acme" and explained["worker"] == pinned
        assert explained["affinity_outcome"] == "in_group"
        # a repeated header: its last value, for routing and for /debug/route alike
        for values, group in ((["other", "acme"], "acme"), (["acme", "other"], None)):
            headers = [("x-tenant", v) for v in values]
            body = {"model": "echo", "prompt": "twice"}
            sent = client.post("/v1/completions", json=body, headers=headers).headers["x-radixgate-worker"]
            explained = client.post("/debug/route", json=body, headers=headers).json()
            assert explained["affinity_group"] == group
            assert (sent == pinned, explained["worker"] == pinned) == (group == "acme", group == "acme")
        ghost = client.post(
            "/v1/completions", json={"model": "echo", "prompt": "g"}, headers={"x-tenant": "ghost"}
        )
        assert ghost.status_code == 503  # workers are up: the group's own error, naming it
        assert ghost.json()["error"]["code"] == "affinity_group_unavailable" and "'ghost'" in ghost.text
        explained = client.post(
            "/debug/route", json={"model": "echo", "prompt": "g"}, headers={"x-tenant": "ghost"}
        ).json()  # as the request is counted (it said in_group)
        assert explained["worker"] is None and explained["affinity_outcome"] == "no_worker"
        assert "'ghost'" in explained["reason"] and "overflow is none" in explained["reason"]  # as answered
        groups = client.get("/workers").json()["affinity_groups"]
        assert groups[0]["name"] == "acme" and groups[0]["members"] == {"echo": [pinned]}
        assert groups[1]["members"] == {"echo": []}
        counts = metric_values(client.get("/metrics").text, "radixgate_affinity_requests_total")
    assert counts['{group="acme",outcome="in_group"}'] == 7
    assert counts['{group="",outcome="ungrouped"}'] == 7
    assert counts['{group="ghost",outcome="no_worker"}'] == 1


def test_a_health_check_tells_affinity_placement_what_a_worker_serves(launch):
    """Placement reads the registry's served() tuple, kept until something changes: a health check
    that learns a worker's models is such a change."""
    import asyncio

    from router.config import RouterConfig
    from router.gateway import Router

    backend = launch.echo_backend("--model", "m1")

    async def run() -> tuple[tuple, tuple]:
        router = Router(RouterConfig(workers=[backend.url]))
        await router.upstream.start()
        try:
            before = router.workers.served()
            await router.health.check(router.workers.get(backend.url))
            return before, router.workers.served()
        finally:
            await router.upstream.close()

    before, after = asyncio.run(run())
    assert before == ((backend.url, frozenset(), ()),) and after == ((backend.url, frozenset({"m1"}), ()),)


@pytest.mark.parametrize("stream_usage", [True, False])
def test_stream_usage_is_read_for_the_metrics_without_reaching_a_client_that_did_not_ask(
    launch, stream_usage
):
    backend = launch.echo_backend()
    router = launch.router([backend.url], *([] if stream_usage else ["--no-stream-usage"]))
    body = {"model": "echo", "prompt": "count my usage", "max_tokens": 3, "stream": True}
    for options in (None, {"include_usage": True}):
        sent = body if options is None else {**body, "stream_options": options}
        with httpx.stream("POST", router.url + "/v1/completions", json=sent, timeout=30) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        usage_events = [e for e in events[:-1] if '"usage"' in e]
        assert len(usage_events) == (0 if options is None else 1)  # only a client that asked sees it
        assert all(orjson.loads(e)["choices"] for e in events[:-1] if e not in usage_events)

    def recorded() -> float:
        text = httpx.get(router.url + "/metrics").text
        values = metric_values(text, "radixgate_upstream_usage_prompt_tokens_total")
        return values.get(f'{{worker="{backend.url}"}}', 0.0)

    # the router read both streams' usage, or (off) only the one whose client asked for it
    want = len(b"count my usage") * (2 if stream_usage else 1)
    wait_until(lambda: recorded() == want, 10, what=f"usage of {want} prompt tokens recorded")


def _burst(url: str, n: int, model: str = "sim-8b") -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            body = {"model": model, "max_tokens": 5}
            return await asyncio.gather(
                *(c.post("/v1/completions", json={**body, "prompt": f"q{i}"}) for i in range(n))
            )

    return asyncio.run(go())


def _narrow_worker(launch) -> object:
    """A simulated worker that runs one request and queues one more (200 ms per decode step)."""
    return launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--max-running", "1",
                         "--max-waiting", "1", "--sim-decode-base-ms", "200")  # fmt: skip


def test_a_worker_with_a_full_queue_passes_the_request_to_one_with_room(launch):
    narrow = _narrow_worker(launch)
    roomy = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    router = launch.router([narrow.url, roomy.url], "--policy", "round_robin")
    responses = _burst(router.url, 8)
    assert [r.status_code for r in responses] == [200] * 8
    served = Counter(r.headers["x-radixgate-worker"] for r in responses)
    assert served[narrow.url] <= 2 and served[roomy.url] >= 6  # round robin sent it 4
    text = httpx.get(router.url + "/metrics").text
    assert metric_values(text, "radixgate_upstream_overloaded_total")[f'{{worker="{narrow.url}"}}'] >= 2
    assert (
        sum(metric_values(text, "radixgate_upstream_errors_total").values()) == 0
    )  # a full queue is no fault
    workers = {w["url"]: w for w in httpx.get(router.url + "/workers").json()["workers"]}
    assert workers[narrow.url]["breaker"] == "closed"


def test_when_every_worker_queue_is_full_the_client_gets_429(launch):
    narrow = [_narrow_worker(launch) for _ in range(2)]
    router = launch.router([w.url for w in narrow], "--policy", "round_robin")
    responses = _burst(router.url, 8)  # room for 2 x (1 running + 1 waiting) at most
    codes = Counter(r.status_code for r in responses)
    assert set(codes) == {200, 429} and codes[200] >= 2  # each worker takes at least its first
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "overloaded" and "full queue" in r.json()["error"]["message"]
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "sim-8b", "prompt": "later", "max_tokens": 1}
    )
    assert ok.status_code == 200  # nothing stays closed once the queues drain


def _slow_worker(launch) -> object:
    """A simulated worker whose requests take ~1 s (5 tokens at 200 ms a step)."""
    return launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--sim-decode-base-ms", "200")


def test_the_router_admits_a_bounded_number_queues_the_next_and_refuses_the_rest(launch):
    worker = _slow_worker(launch)
    router = launch.router([worker.url], "--max-concurrent-requests", "2", "--max-queued-requests", "2")
    responses = _burst(router.url, 6)  # 2 forwarded, 2 queued until a slot frees, 2 refused
    codes = Counter(r.status_code for r in responses)
    assert codes == {200: 4, 429: 2}
    assert all(r.json()["error"]["code"] == "router_queue_full" for r in responses if r.status_code == 429)
    assert all(r.headers["retry-after"] == "1" for r in responses if r.status_code == 429)
    text = httpx.get(router.url + "/metrics").text
    assert metric_values(text, "radixgate_router_queue_refused_total")['{reason="full"}'] == 2
    assert metric_values(text, "radixgate_router_queue_admitted_after_wait_total")[""] == 2
    assert metric_values(text, "radixgate_router_active_requests")[""] == 0  # every slot came back
    assert metric_values(text, "radixgate_router_queued_requests")[""] == 0


def test_a_request_queued_past_the_bound_is_503_and_a_client_that_leaves_frees_its_place(launch):
    worker = _slow_worker(launch)
    router = launch.router([worker.url], "--max-concurrent-requests", "1", "--queue-timeout-s", "0.5")
    responses = _burst(router.url, 3)  # the first holds the slot for ~1 s; the others give up
    assert sorted(r.status_code for r in responses) == [200, 503, 503]
    assert all(r.json()["error"]["code"] == "router_queue_timeout" for r in responses if r.status_code == 503)

    async def leave_while_queued() -> int:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as c:
            body = {"model": "sim-8b", "max_tokens": 5, "prompt": "holder"}
            holder = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.05)  # NOTE: only orders the two sends; the assertion polls
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/completions", json={**body, "prompt": "leaver"}, timeout=0.1)
            return (await holder).status_code

    assert asyncio.run(leave_while_queued()) == 200
    refused = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_router_queue_refused_total")
    assert refused['{reason="timeout"}'] == 2  # the leaver left the queue; it did not time out in it
    wait_until(lambda: metric_values(httpx.get(router.url + "/metrics").text, "radixgate_router_active_requests")[""] == 0,
               10, what="every slot back")  # fmt: skip
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "sim-8b", "max_tokens": 1, "prompt": "x"}, timeout=30
    )
    assert ok.status_code == 200


def test_the_access_log_explains_each_request(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url], "--access-log")
    body = chat("Explain the route.")
    first = httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-1"}, timeout=10
    )
    second = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10)
    bad = httpx.post(router.url + "/v1/chat/completions", json={**body, "model": "gpt-nope"}, timeout=10,
                     headers={"x-request-id": "req-3"})  # fmt: skip
    batch = {"model": "echo", "prompt": ["abc", "defgh"]}  # the echo backend refuses batches: a 400
    batch = httpx.post(router.url + "/v1/completions", json=batch, timeout=10)
    assert (first.status_code, second.status_code, bad.status_code, batch.status_code) == (200, 200, 404, 400)

    wait_until(lambda: len(router.access_lines()) == 4, 10, what="four access lines")
    one, two, three, four = router.access_lines()
    assert four["prompt_tokens"] == 8  # a batch's every prompt, as a worker's usage counts them (one a byte)
    assert three["request_id"] == "req-3" == bad.headers["x-request-id"]  # a refused request's too
    assert one["request_id"] == "req-1" and one["status"] == 200 and one["worker"] == backend.url
    assert one["endpoint"] == "chat" and one["attempts"] == 1 and one["reason"]
    assert one["prompt_tokens"] > len(SYSTEM) and one["usage_prompt_tokens"] > 0 and one["ttft_ms"] > 0
    assert two["stream"] is True and two["predicted_cached_tokens"] > 0  # the index learned the prefix
    assert two["cached_tokens"] is not None and two["duration_ms"] >= two["ttft_ms"]
    assert three["status"] == 404 and three["error"] == "model_not_found" and three["worker"] is None


def test_the_access_log_names_the_error_event_a_worker_ended_a_stream_with(launch):
    """A worker that shuts down mid-stream ends it with its error event after the 200: the access
    log says so (status 200, error its code)."""
    worker = launch.sim_worker("--shutdown-timeout-s", "1", "--sim-decode-base-ms", "5")
    router = launch.router([worker.url], "--access-log")
    body = {"model": "sim-8b", "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as answer:
        chunks = answer.iter_bytes()
        received = next(chunks)
        worker.proc.send_signal(signal.SIGTERM)
        received += b"".join(chunks)
    assert answer.status_code == 200 and b'"shutting_down"' in received
    wait_until(lambda: len(router.access_lines()) == 1, 10, what="the access line")
    (line,) = router.access_lines()
    assert (line["status"], line["error"]) == (200, "shutting_down")


def test_the_access_log_is_written_whatever_the_log_level_quiets(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url], "--access-log", "--log-level", "warning")
    assert httpx.post(router.url + "/v1/chat/completions", json=chat("Quiet."), timeout=10).status_code == 200
    wait_until(lambda: len(router.access_lines()) == 1, 10, what="the access line")


def test_api_keys_guard_the_client_endpoints_and_leave_probes_open(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url], "--api-key", "k-one", "--api-key", "k-two")
    body = chat("Who may ask?")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k-one"}):
        for method, path, payload in (("POST", "/v1/chat/completions", body), ("GET", "/v1/models", None),
                                      ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/debug/route", body),
                                      ("GET", "/workers", None)):  # fmt: skip
            r = httpx.request(method, router.url + path, json=payload, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    for key in ("k-one", "k-two"):
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=10,
        )
        assert r.status_code == 200
    assert httpx.get(router.url + "/v1/models", headers={"authorization": "Bearer k-two"}).status_code == 200
    listed = httpx.get(router.url + "/workers", headers={"authorization": "Bearer k-one"})
    assert listed.status_code == 200 and listed.json()["workers"][0]["url"] == backend.url
    for probe in ("/health", "/ready", "/metrics"):
        assert httpx.get(router.url + probe).status_code == 200
    counted = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_requests_total")
    assert counted['{endpoint="chat",status="401"}'] == 3 and counted['{endpoint="chat",status="200"}'] == 2


def test_the_load_driver_sends_the_api_key_and_never_records_it(launch, tmp_path):
    from loadtest.driver import LoadConfig, run_load

    backend = launch.echo_backend()
    router = launch.router([backend.url], "--api-key", "drive-key")
    config = LoadConfig(url=router.url, requests=4, concurrency=2, max_tokens=2, api_key="drive-key",
                        options={"num_tenants": 2, "system_tokens": 64, "question_tokens": 8})  # fmt: skip
    results = asyncio.run(run_load(config))
    assert results.summary()["ok"] == 4
    assert results.config["api_key"] == "<set>" and "drive-key" not in str(results.config)
    without = asyncio.run(run_load(LoadConfig(**{**config.__dict__, "api_key": None, "model": "echo"})))
    assert without.summary()["ok"] == 0


def test_a_prompt_goes_to_a_worker_whose_context_holds_it(launch):
    """Workers of one model with different contexts (KV pools of different sizes): the router,
    counting tokens as they do, gives a long prompt only to a worker that can hold it, short ones
    to any, and reports the largest context; a prompt no worker holds gets a worker's clear 400."""
    short, long = (launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--sim-context-tokens", n)
                   for n in ("2048", "8192"))  # fmt: skip
    router = launch.router([short.url, long.url], "--policy", "round_robin")
    (model,) = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    assert model["id"] == "sim-8b" and model["max_model_len"] == 8192
    text = "a radix tree of cached prefixes " * 100  # 3,200 byte tokens
    bodies = {
        "/v1/completions": {"prompt": text, "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
        "/v1/responses": {"input": text, "max_output_tokens": 2},
    }
    seen = Counter()
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for path, body in bodies.items():
            for _ in range(4):  # round robin alone would send half of them to the short worker
                r = client.post(path, json={"model": "sim-8b", **body})
                assert r.status_code == 200, r.text
                seen[("long", r.headers["x-radixgate-worker"])] += 1
            r = client.post(path, json={"model": "sim-8b", **body, "stream": True})
            assert r.status_code == 200 and r.headers["x-radixgate-worker"] == long.url
        for _ in range(4):
            r = client.post("/v1/completions", json={"model": "sim-8b", "prompt": "short", "max_tokens": 2})
            seen[("short", r.headers["x-radixgate-worker"])] += 1
        # the worker cuts the prompt to fit: any worker takes it
        cut = {"model": "sim-8b", "prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 1000}
        for _ in range(4):
            r = client.post("/v1/completions", json=cut)
            assert r.status_code == 200, r.text
            seen[("cut", r.headers["x-radixgate-worker"])] += 1
        too_long = client.post(
            "/v1/completions", json={"model": "sim-8b", "prompt": text * 3, "max_tokens": 2}
        )
        assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        explained = client.post("/debug/route", json={"model": "sim-8b", **bodies["/v1/completions"]}).json()
    assert seen == {("long", long.url): 12, ("short", short.url): 2, ("short", long.url): 2,
                    ("cut", short.url): 2, ("cut", long.url): 2}  # fmt: skip
    assert explained["worker"] == long.url and "context is too short" in explained["reason"]
    assert httpx.get(short.url + "/v1/models").json()["data"][0]["max_model_len"] == 2048


def test_models_report_the_smallest_context_when_the_router_counts_tokens_otherwise(launch, tmp_path):
    """Workers whose tokenizer is not the router's: a request may land on any of them."""
    short, long = (launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--sim-context-tokens", n)
                   for n in ("4096", "8192"))  # fmt: skip
    router = launch.router([short.url, long.url], "--tokenizer", str(byte_level_dir(tmp_path / "tok")))
    (model,) = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    assert model["id"] == "sim-8b" and model["max_model_len"] == 4096


def _router_with(launch, tmp_path, backends, **settings) -> object:
    """A router over ``backends`` with YAML ``settings`` (timeouts and breaker have no flags)."""
    path = tmp_path / "router.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in settings.items()))
    return launch.router([b.url for b in backends], "--config", str(path))


def _worker_row(router_url: str) -> dict:
    return httpx.get(router_url + "/workers", timeout=5).json()["workers"][0]


def test_a_half_open_probe_whose_client_leaves_does_not_shut_the_worker_out(launch, tmp_path):
    """The breaker opens on three head timeouts; its probe's client leaves before any verdict; the
    next request must still reach the worker (no 503 for good), and nothing was retried."""
    slow = launch.echo_backend("--prefill-us-per-token", "1000000", "--decode-ms-per-token", "100")
    router = _router_with(launch, tmp_path, [slow], first_byte_timeout_s=0.3, breaker_open_s=0.5,
                          max_retries=0, health_interval_s=60)  # fmt: skip
    prompts = [f"prompt {i} ".ljust(33, "x") for i in range(3)]  # 2 whole blocks (cached once seen) + 1
    for prompt in prompts:  # uncached: 33 s of prefill before the stream's head
        body = {"model": "echo", "prompt": prompt, "max_tokens": 2, "stream": True}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    opened = time.monotonic()
    assert _worker_row(router.url)["breaker"] == "open"
    wait_until(lambda: time.monotonic() > opened + 0.6, 5, what="the breaker's cool-down")
    probe = {"model": "echo", "prompt": prompts[0], "max_tokens": 50}  # cached: 1 s of prefill, 5 s of decode
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=probe, timeout=0.3)
    wait_until(lambda: _worker_row(router.url)["in_flight"] == 0, 10, what="the probe released")
    after = httpx.post(router.url + "/v1/completions", json={**probe, "max_tokens": 1}, timeout=10)
    assert after.status_code == 200, after.text
    assert _worker_row(router.url)["breaker"] == "closed"
    retried = metric_values(httpx.get(router.url + "/metrics").text, "radixgate_upstream_retries_total")
    assert sum(retried.values()) == 0  # --max-retries 0: three failures, nothing moved elsewhere


def test_a_long_non_stream_answer_is_not_cut_off_by_the_first_byte_timeout(launch, tmp_path):
    """A non-stream answer's head comes when it is done: first_byte_timeout_s must not cut it off
    (nor retry it elsewhere). request_timeout_s does, with 504 request_timeout and no retry: a
    non-stream request that got nothing charges its worker, a stream cut off mid-answer does not."""
    backends = [launch.echo_backend("--decode-ms-per-token", "100") for _ in range(2)]
    router = _router_with(launch, tmp_path, backends, first_byte_timeout_s=1.0, request_timeout_s=3.0)
    body = {"model": "echo", "prompt": "take your time", "max_tokens": 15}  # ~1.5 s
    answer = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "x" * 15
    too_long = {**body, "max_tokens": 50}  # ~5 s
    refused = httpx.post(router.url + "/v1/completions", json=too_long, timeout=30)
    assert refused.status_code == 504 and refused.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", router.url + "/v1/completions", json={**too_long, "stream": True},
                      timeout=30) as stream:  # fmt: skip
        text = b"".join(stream.iter_raw())
    assert stream.status_code == 200 and b'"text":"x"' in text  # cut off, and told so:
    *_, error, done = sse_data(text)
    told, kind = orjson.loads(error)["error"], refused.json()["error"]  # typed as the non-stream one is
    assert (told["type"], told["code"]) == (kind["type"], kind["code"]) == ("timeout", "request_timeout")
    assert done == b"[DONE]"
    metrics = httpx.get(router.url + "/metrics").text
    errors = metric_values(metrics, "radixgate_upstream_errors_total")
    charged = {k.split('kind="')[1].split('"')[0]: v for k, v in errors.items() if v}
    assert charged == {"timeout": 1.0}  # the non-stream request's, not the stream's
    assert sum(metric_values(metrics, "radixgate_upstream_retries_total").values()) == 0
    assert sum(metric_values(metrics, "radixgate_upstream_requests_total").values()) == 3  # each sent once
    rows = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
    assert [w["breaker"] for w in rows] == ["closed", "closed"]  # one failure does not open it


def test_a_refused_request_is_not_recorded_as_cached_on_the_worker(launch):
    backend = launch.echo_backend()
    router = launch.router([backend.url])
    body = chat("Refuse me, please.", max_tokens="many")  # the backend answers 400
    routed = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
    assert routed["candidates"][0]["matched_tokens"] == 0
    refused = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
    assert refused.status_code == 400
    routed = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
    assert routed["candidates"][0]["matched_tokens"] == 0
    ok = httpx.post(router.url + "/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200  # what is answered is recorded: the next one matches
    routed = httpx.post(router.url + "/debug/route", json=body, timeout=10).json()
    assert routed["candidates"][0]["matched_tokens"] >= len(SYSTEM) - 16


def test_a_prompt_longer_than_the_workers_context_cannot_flush_the_index(launch):
    """The index records at most what the worker's context holds: a refused 4,000-token prompt
    must not evict what a 200-entry index learned before (the refusal is then taken back)."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--sim-context-tokens", "1024")
    router = launch.router([worker.url], "--max-index-entries", "200")
    wait_until(lambda: _worker_row(router.url)["models"] == ["sim-8b"], 10, what="the worker's models")
    kept = {"model": "sim-8b", "prompt": "a prefix worth keeping " * 20, "max_tokens": 1}
    assert httpx.post(router.url + "/v1/completions", json=kept, timeout=30).status_code == 200
    held = httpx.post(router.url + "/debug/route", json=kept, timeout=10).json()["candidates"][0]
    assert held["matched_tokens"] >= 400
    huge = {"model": "sim-8b", "prompt": "far too long " * 330, "max_tokens": 1}  # ~4.3k tokens
    refused = httpx.post(router.url + "/v1/completions", json=huge, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    after = httpx.post(router.url + "/debug/route", json=kept, timeout=10).json()["candidates"][0]
    assert after["matched_tokens"] == held["matched_tokens"]


def test_answers_carry_a_request_id_and_models_have_created_and_are_listed_one_by_one(fleet):
    router, _ = fleet
    body = chat("Which id?")
    mine = httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-7"}, timeout=30
    )
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "req-7"
    made = httpx.post(router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
    assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
    # an empty id names nothing: one is made, and only that one sent back
    blank = httpx.post(
        router.url + "/v1/chat/completions", json=body, headers={"x-request-id": ""}, timeout=30
    )
    assert blank.headers.get_list("x-request-id") == [blank.headers["x-request-id"]]
    assert len(blank.headers["x-request-id"]) == 32
    refused = httpx.post(router.url + "/v1/chat/completions", json={"model": "echo"}, timeout=30)
    assert refused.status_code == 400 and refused.headers["x-request-id"]
    listed = httpx.get(router.url + "/v1/models", timeout=5).json()["data"]
    assert [m["id"] for m in listed] == ["echo"] and isinstance(listed[0]["created"], int)
    assert httpx.get(router.url + "/v1/models/echo", timeout=5).json() == listed[0]
    missing = httpx.get(router.url + "/v1/models/nope", timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_workers_with_different_block_sizes_are_warned_about(launch):
    """One block size hashes every prompt, so a fleet mixing them matches only some workers'
    prefixes: the router says so, naming the sizes."""
    a = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--block-size", "16")
    b = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--block-size", "32")
    router = launch.router([a.url, b.url])
    wait_until(lambda: "workers advertise block sizes" in router.log(), 30, what="the warning")
    assert "give every worker the same --block-size" in router.log()
    assert "prefix matching follows 16" in router.log()  # NOTE: a tie: the smaller
    c = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--block-size", "16")
    alike = launch.router([a.url, c.url])
    wait_until(lambda: all(w["healthy"] for w in httpx.get(alike.url + "/workers", timeout=2).json()["workers"]),
               30, what="both healthy")  # fmt: skip
    assert "workers advertise block sizes" not in alike.log()


def test_a_burst_on_a_cold_connection_pool_is_routed_by_the_prefix_its_first_requests_sent(launch):
    """A fresh router holds no open connection to its workers, so each request of a first burst
    opens one, and every request is decided while those open: the first one sent to a worker must
    already be in the index then, or the whole burst is routed blind (no predicted prefix, spread
    by load). At most one request a worker may be blind: the one that brought the prefix there."""
    backends = [launch.echo_backend("--name", f"b{i}") for i in range(2)]
    router = launch.router([b.url for b in backends], "--access-log")
    system = "A cold burst shares this long system prompt. " * 16

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=chat(f"q{i}", system=system)) for i in range(16))
            )

    assert all(r.status_code == 200 for r in asyncio.run(burst()))

    wait_until(lambda: len(router.access_lines()) == 16, 10, what="16 access lines")
    blind = [line for line in router.access_lines() if line["predicted_cached_tokens"] < 512]
    assert len(blind) <= 2, [
        (line["worker"], line["predicted_cached_tokens"], line["reason"]) for line in router.access_lines()
    ]


def test_a_request_that_never_reached_its_worker_leaves_nothing_in_the_index(launch):
    """The burst rule records a prompt before its connection opens; when the connection cannot be
    opened (the worker died since its last health check) that record is taken back."""
    backend = launch.echo_backend()
    router = launch.router([backend.url])
    wait_until(lambda: _worker_row(router.url)["healthy"], 10, what="the worker healthy")
    backend.proc.kill()
    backend.proc.wait()
    refused = httpx.post(router.url + "/v1/chat/completions", json=chat("Anyone there?"), timeout=30)
    assert refused.status_code >= 500
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert metric_values(metrics, "radixgate_upstream_errors_total")  # the attempt failed to connect
    assert metric_values(metrics, "radixgate_prefix_index_entries")[""] == 0


def _matched(router_url: str, body: dict) -> dict[str, int]:
    explained = httpx.post(router_url + "/debug/route", json=body, timeout=10).json()
    return {c["url"]: c["matched_tokens"] for c in explained["candidates"]}


def test_a_truncated_prompt_is_recorded_as_the_worker_computes_it(launch):
    """truncate_prompt_tokens k: the worker computes the prompt's last k tokens, so the router records
    those (not the prompt's head, which no KV event would ever take back); -1 on a prompt the
    worker's context cannot hold: the worker keeps its end, nothing of the prompt's head is recorded."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--sim-context-tokens", "1024")
    router = launch.router([worker.url])
    wait_until(lambda: _worker_row(router.url)["models"] == ["sim-8b"], 10, what="the worker's models")
    text = "".join(f"{i:04d} radix " for i in range(60))  # 600 byte tokens, no block repeats
    one = {"model": "sim-8b", "max_tokens": 1}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        cut = client.post("/v1/completions", json={**one, "prompt": text, "truncate_prompt_tokens": 300})
        assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 300
        assert _matched(router.url, {**one, "prompt": text[:350]}) == {worker.url: 0}
        assert _matched(router.url, {**one, "prompt": text[-300:] + "more"}) == {worker.url: 288}
        tail = client.post("/v1/completions", json={**one, "prompt": text[-300:] + "more"}).json()
        assert tail["usage"]["prompt_tokens_details"]["cached_tokens"] == 288  # 18 blocks of 16
        long = "".join(f"{i:05d} kept at the end " for i in range(100))  # 2,000 tokens: past the context
        fitted = client.post("/v1/completions", json={**one, "prompt": long, "truncate_prompt_tokens": -1})
        assert fitted.status_code == 200 and fitted.json()["usage"]["prompt_tokens"] == 1023
        assert _matched(router.url, {**one, "prompt": long[:1000]}) == {worker.url: 0}
        other = long.replace("kept", "held")  # no model named: the worker's own, its context the same
        fitted = client.post(
            "/v1/completions", json={"max_tokens": 1, "prompt": other, "truncate_prompt_tokens": -1}
        )
        assert fitted.status_code == 200 and _matched(router.url, {**one, "prompt": other[:1000]}) == {
            worker.url: 0
        }


def test_a_prompt_of_whole_blocks_is_predicted_cached_but_its_last_block(launch):
    """A worker computes a prompt's last token at least: a 64-token prompt it holds whole is served
    48 cached tokens, and the router's prediction says the same."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b")
    router = launch.router([worker.url])
    body = {"model": "sim-8b", "max_tokens": 1, "prompt": "".join(f"block {i:02d} sixteen" for i in range(4))}
    assert len(body["prompt"]) == 64
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for _ in range(2):
            answer = client.post("/v1/completions", json=body).json()
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        predicted = metric_values(
            client.get("/metrics").text, "radixgate_upstream_predicted_cached_tokens_total"
        )
    assert list(predicted.values()) == [48.0]


def test_debug_route_names_no_kv_source_for_a_salted_prompt(launch):
    """Workers export unsalted prefixes only, so a salted request gets no KV fetch hint: /debug/route
    says so, as the request itself is sent."""
    workers = [launch.module("worker", "--engine", "sim", "--model", "sim-8b") for _ in range(2)]
    router = launch.router([w.url for w in workers], "--policy", "round_robin", "--kv-fetch-min-tokens", "16")
    body = {"model": "sim-8b", "max_tokens": 1, "prompt": "a salted prompt " * 8, "cache_salt": "tenant-a"}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        first = client.post("/v1/completions", json=body)
        explained = client.post("/debug/route", json=body).json()
    held = first.headers["x-radixgate-worker"]
    assert explained["worker"] != held and explained["kv_source"] is None


def test_a_body_that_does_not_arrive_in_time_is_408_and_frees_its_connection(launch, tmp_path):
    """A client that trickles its body (slowloris) holds a connection and a file descriptor: past
    body_timeout_s it gets 408 body_timeout; the router goes on serving."""
    import socket
    import time

    backend = launch.echo_backend()
    router = _router_with(launch, tmp_path, [backend], body_timeout_s=0.5)
    port = int(router.url.rsplit(":", 1)[1])
    for path in (b"/v1/completions", b"/workers"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"prompt\": ")  # fmt: skip
            started = time.monotonic()
            answer = sock.recv(65536)
            waited = time.monotonic() - started
            with contextlib.suppress(OSError):  # NOTE: the client goes on trickling: closed all the same
                sock.sendall(b"1")
            with contextlib.suppress(
                ConnectionResetError
            ):  # NOTE: to the end (the trickled byte may reset it)
                while chunk := sock.recv(65536):  # NOTE: a connection kept open times the test out
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer and waited < 8, answer
    body = {"model": "echo", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=10).status_code == 200


def test_a_large_body_is_tokenized_off_the_event_loop(launch, tmp_path) -> None:
    """With an HF tokenizer, tokenizing megabytes of prompt takes seconds: done on the event loop it
    stalled every other request of the router (its /health too) until it was over."""
    import threading

    from tests.test_tokenization import byte_level_dir

    router = launch.router([], "--tokenizer", str(byte_level_dir(tmp_path / "tok")))
    words = ["routing", "prefix", "cache", "tokens", "worker", "radix", "batch", "stream"]
    prompt = " ".join(words[i * 7 % 8] + str(i % 97) for i in range(400_000))  # ~4.5 MB of varied text
    done = threading.Event()
    answered: list[float] = []

    def big() -> None:
        try:
            httpx.post(router.url + "/debug/route", json={"prompt": prompt, "model": "m"}, timeout=120)
        finally:
            done.set()

    with httpx.Client(base_url=router.url, timeout=30) as client:
        thread = threading.Thread(target=big)
        thread.start()
        done.wait(0.5)  # NOTE: the body is sent by then; its tokenizing takes seconds
        while not done.is_set():
            assert client.get("/health").status_code == 200
            if not done.is_set():
                answered.append(1.0)  # NOTE: answered while the big body was still being read
        thread.join(120)
    assert len(answered) >= 20, len(answered)  # one at most while the loop was held


def test_health_checks_of_a_large_fleet_are_spread_over_the_interval(launch) -> None:
    """Started all at once, one interval's checks of hundreds of workers ran tens of ms of CPU in one
    burst, and every request waited behind it: they start in slices of ROUND_SLICE workers spread
    over the interval, each worker still checked once an interval."""
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from router.health import ROUND_SLICE

    checks: list[tuple[float, int]] = []  # (arrival, worker port)

    async def health(request):
        checks.append((time.monotonic(), request.scope["server"][1]))
        return JSONResponse({"status": "ok"})

    app = Starlette(routes=[
        Route("/health", health),
        Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "m"}]})),
    ])  # fmt: skip
    socks = [socket.socket() for _ in range(3 * ROUND_SLICE)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True).start()
    try:
        wait_until(lambda: server.started, 10, what="the fleet's server")
        ports = [s.getsockname()[1] for s in socks]
        launch.router([f"http://127.0.0.1:{p}" for p in ports], "--health-interval-s", "0.6")
        start = time.monotonic()
        time.sleep(2.5)
        window = [(t, p) for t, p in checks if t > start]  # NOTE: after the start-up check of all
        per_port = Counter(p for _, p in window)
        assert set(per_port) == set(ports) and min(per_port.values()) >= 3, per_port  # ~4 intervals
        times = sorted(t for t, _ in window)
        together = max(sum(1 for u in times if t <= u < t + 0.05) for t in times)
        assert together <= ROUND_SLICE, together  # 48 within a few ms when started at once
    finally:
        server.should_exit = True


def test_a_conversations_next_turn_reuses_its_cached_prefix_ids_and_says_so(launch, tmp_path) -> None:
    """With a model's tokenizer, the next turn of a conversation encodes only what it adds; the
    cache's hits and misses are in /metrics, and the block hashes are those of the whole prompt."""
    backend = launch.echo_backend()
    router = launch.router([backend.url], "--tokenizer", str(byte_level_dir(tmp_path / "tok")))
    messages = [{"role": "system", "content": "Héllo 🙂 " * 20}, {"role": "user", "content": "first"}]
    second = [*messages, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "second"}]
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for turn in (messages, second):
            assert (
                client.post("/v1/chat/completions", json={"model": "echo", "messages": turn}).status_code
                == 200
            )
        routed = client.post("/debug/route", json={"model": "echo", "messages": second}).json()
        lookups = metric_values(client.get("/metrics").text, "radixgate_prompt_prefix_ids_total")
    assert lookups['{outcome="hit"}'] >= 2 and lookups['{outcome="miss"}'] >= 1, lookups
    tok = HFTokenizer(str(tmp_path / "tok"))
    assert routed["prompt_tokens"] == len(
        tok.encode_text(tok.render_chat(second, add_generation_prompt=True))
    )


def test_a_redis_that_stays_away_is_logged_once_not_at_every_reconnection(launch):
    """Redis down (here: a port that takes each connection and closes it): the KV event stream's
    reader tries again every 5 s at most, for as long as it takes (6 tries: 0.2 s to 5 s apart, ~9 s);
    each try was a warning in the router's log (720 an hour per model), where the replica sync and the
    workers log the first."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    tries = []

    def refuse_all() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                tries.append(conn)
                conn.close()

    threading.Thread(target=refuse_all, daemon=True).start()
    backend = launch.echo_backend()
    redis_url = f"redis://127.0.0.1:{server.getsockname()[1]}"
    router = launch.router([backend.url], "--redis-url", redis_url, "--replica-sync", "off")
    try:
        wait_until(lambda: len(tries) >= 6, 60, what="the reader trying again and again")
    finally:
        server.close()
    assert router.log().count("redis stream radixgate:kv:echo:") <= 2


def test_a_worker_that_never_answered_does_not_turn_an_unknown_model_into_a_503(launch):
    """A registered worker that has not answered yet (a pod still starting, one --workers entry down)
    may serve any model once it answers, not while it is down: a name no worker serves is a 404, as
    without it, and its own model still routes. With no worker's models known, a model is a 503."""
    import socket

    echo = launch.echo_backend()
    # NOTE: bound, never listening: connections to it are refused, and no other server takes it
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    down = f"http://127.0.0.1:{held.getsockname()[1]}"
    router = launch.router([echo.url, down])
    for path in ("/v1/completions", "/tokenize"):
        refused = httpx.post(router.url + path, json={"model": "gpt-4o", "prompt": "x"}, timeout=10)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["code"] == "model_not_found"
    ok = httpx.post(
        router.url + "/v1/completions", json={"model": "echo", "prompt": "x", "max_tokens": 1}, timeout=10
    )
    assert ok.status_code == 200
    alone = launch.router([down])
    waiting = httpx.post(alone.url + "/v1/completions", json={"model": "gpt-4o", "prompt": "x"}, timeout=10)
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "no_healthy_worker"
    held.close()


def test_a_worker_whose_models_list_does_not_answer_takes_no_other_workers_models(launch):
    """A worker whose /v1/models does not answer (slow, or failing for a while) is not taken for a
    worker of every model: a radixgate worker's health report lists what it serves, and one that
    tells nothing (another backend) gets no request for a model other workers told they serve, so
    those stay with their own workers instead of getting its 404."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.support import serve_in_thread

    def without_models_list(upstream: str) -> tuple[str, object]:
        async def forward(request):
            if request.url.path == "/v1/models":
                return Response(b"busy", 503)
            async with httpx.AsyncClient() as client:
                r = await client.request(request.method, upstream + request.url.path, content=await request.body(),
                                         headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

        routes = [Route("/{path:path}", forward, methods=["GET", "POST"])]
        return serve_in_thread(Starlette(routes=routes), "a worker whose /v1/models fails")

    alpha = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--served-model-name", "alpha")
    beta = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--served-model-name", "beta")
    beta_url, beta_proxy = without_models_list(beta.url)
    other_url, other_proxy = without_models_list(launch.echo_backend("--model", "other").url)
    try:
        router = launch.router([alpha.url, beta_url, other_url])

        def rows() -> dict[str, dict]:
            return {
                row["url"]: row for row in httpx.get(router.url + "/workers", timeout=5).json()["workers"]
            }

        wait_until(lambda: all(row["healthy"] for row in rows().values()), 15, what="every worker healthy")
        assert (rows()[beta_url]["models"], rows()[other_url]["models"]) == (["beta"], [])
        answered = Counter()
        for i in range(8):
            for model in ("alpha", "beta"):
                body = {"model": model, "prompt": f"question {i} " * 8, "max_tokens": 1}
                r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
                answered[model, r.status_code, r.headers.get("x-radixgate-worker")] += 1
        assert answered == {("alpha", 200, alpha.url): 8, ("beta", 200, beta_url): 8}
    finally:
        beta_proxy.should_exit = other_proxy.should_exit = True


def test_a_request_naming_no_model_is_refused_where_the_fleet_serves_several(launch):
    """Without ``model`` a request is served as the fleet's one base model; in a fleet of several, which
    one answered would be the policy's pick from one request to the next: a 400, as OpenAI and vLLM
    answer it, before any worker sees it."""
    a, b = launch.echo_backend("--model", "alpha"), launch.echo_backend("--model", "beta")
    router = launch.router([a.url, b.url])
    wait_until(lambda: len(httpx.get(router.url + "/v1/models", timeout=5).json()["data"]) == 2, 10,
               what="both models listed")  # fmt: skip
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat("x"))):
        body.pop("model", None)
        refused = httpx.post(router.url + path, json=body, timeout=10)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "missing_required_parameter"
        named = httpx.post(router.url + path, json={**body, "model": "beta", "max_tokens": 1}, timeout=10)
        assert named.status_code == 200 and named.headers["x-radixgate-worker"] == b.url
    for path, body in (
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [120]}),
    ):  # whose tokenizer?
        refused = httpx.post(router.url + path, json=body, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "missing_required_parameter"
    alone = launch.router([a.url])
    served = httpx.post(alone.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert served.status_code == 200 and served.json()["model"] == "alpha"


def test_a_model_whose_workers_render_with_another_template_is_not_refused_by_the_routers(launch, tmp_path):
    """With ``--tokenizer DIR`` the router renders chat with that model's template; a worker that does
    not count tokens as the router does (here one of the bytes tokenizer) renders with its own, so a
    conversation the router's template refuses goes to it and is answered there."""
    backend = launch.echo_backend()
    router = launch.router([backend.url], "--tokenizer", str(byte_level_dir(tmp_path / "tok")))
    messages = [
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "hi"},
    ]  # not user first
    r = httpx.post(
        router.url + "/v1/chat/completions", json={"model": "echo", "messages": messages}, timeout=10
    )
    assert r.status_code == 200, r.text


def _proxy_failing(upstream: str, path: str, failures: int) -> tuple[str, object]:
    """A pass-through proxy to ``upstream`` whose ``path`` answers 503 its first ``failures`` times."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from tests.support import serve_in_thread

    left, to = [failures], [upstream]

    async def forward(request):
        if request.url.path == path and left[0] > 0:
            left[0] -= 1
            return Response(b"busy", 503)
        async with httpx.AsyncClient() as client:
            r = await client.request(request.method, to[0] + request.url.path, content=await request.body(),
                                     headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    url, server = serve_in_thread(
        Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])]), path
    )
    server.fail, server.to = (
        left,
        to,
    )  # NOTE: a test may fail more calls, or stand another process behind the URL
    return url, server


def test_a_worker_whose_cache_info_failed_once_is_asked_again(launch):
    """A radixgate worker's /v1/cache/info (block size, tokenizer) that failed when the router first
    learned the worker is asked again at the next checks: one failure left it unknown for good (no
    block size, no context filtering, its KV events not followed)."""
    worker = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--block-size", "32")
    url, proxy = _proxy_failing(worker.url, "/v1/cache/info", 2)
    try:
        router = launch.router([url])

        def block_size() -> int | None:
            return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]["block_size"]

        wait_until(lambda: block_size() == 32, 15, what="the cache info read again")
    finally:
        proxy.should_exit = True


def test_the_block_size_most_workers_advertise_is_the_fleets(launch):
    """In a fleet mixing --block-size values the router hashes prompts by the size most workers advertise,
    as workers are learned and removed (it took the last one learned: a race at start-up, one worker of
    another size added or restarted switched it, and its removal did not switch it back)."""
    sim = ("worker", "--engine", "sim", "--model", "sim-8b", "--block-size")
    workers = [launch.module(*sim, "16") for _ in range(2)]
    odd, more = launch.module(*sim, "8"), launch.module(*sim, "8")
    prompt = {"model": "sim-8b", "prompt": "a shared system prompt " * 20, "max_tokens": 1}
    held = httpx.post(workers[1].url + "/v1/completions", json=prompt, timeout=30)  # NOTE: cached there
    assert held.status_code == 200
    router = launch.router([w.url for w in workers])

    def route() -> dict:
        return httpx.post(router.url + "/debug/route", json=prompt, timeout=5).json()

    def predicted(url: str) -> int:
        return next(c["predicted_cached_tokens"] for c in route()["candidates"] if c["url"] == url)

    def eights() -> int:
        return [
            w["block_size"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        ].count(8)

    def workers_call(method: str, url: str) -> int:
        return httpx.request(method, router.url + "/workers", json={"url": url}, timeout=5).status_code

    wait_until(lambda: route()["block_size"] == 16, 15, what="the workers' block size")
    assert workers_call("POST", odd.url) in (200, 201)
    wait_until(lambda: eights() == 1, 15, what="the odd worker learned")
    assert route()["block_size"] == 16
    assert "prefix matching follows 16" in router.log()
    assert workers_call("POST", more.url) in (200, 201)
    wait_until(lambda: eights() == 2, 15, what="both learned")
    assert route()["block_size"] == 8  # NOTE: 2 and 2: the smaller, whatever the order (replicas agree)
    assert workers_call("DELETE", odd.url) == 200  # NOTE: a removed worker's size counts no more
    assert route()["block_size"] == 16
    assert workers_call("POST", odd.url) in (200, 201)
    wait_until(lambda: route()["block_size"] == 8, 15, what="the tie again")
    assert workers_call("DELETE", workers[0].url) == 200
    assert route()["block_size"] == 8
    for w in (odd, more):
        assert workers_call("DELETE", w.url) == 200
    assert route()["block_size"] == 16
    # NOTE: the index was hashed in 8s meanwhile: what the worker of 16 holds is read again from its snapshot
    again = httpx.post(workers[1].url + "/v1/completions", json=prompt, timeout=30).json()["usage"]
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    wait_until(lambda: predicted(workers[1].url) == cached, 10, what="the worker's prefix predicted again")


def test_a_restarted_worker_whose_models_list_fails_keeps_no_context_of_its_last_life(launch):
    """A worker restarted (a new epoch) with a smaller --max-model-len while its /v1/models does not answer:
    the router forgot its last life's context rather than keep routing long prompts there by it."""
    before = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--max-model-len", "2048")
    after = launch.module("worker", "--engine", "sim", "--model", "sim-8b", "--max-model-len", "256")
    url, proxy = _proxy_failing(before.url, "/v1/models", 0)
    try:
        router = launch.router([url])

        def context() -> int | None:
            return httpx.get(router.url + "/v1/models", timeout=5).json()["data"][0].get("max_model_len")

        wait_until(lambda: context() == 2048, 15, what="the first life's context")
        proxy.fail[0], proxy.to[0] = 10**6, after.url  # the restart: another epoch, its models list failing
        wait_until(lambda: context() != 2048, 15, what="the last life's context forgotten")
        assert context() is None
    finally:
        proxy.should_exit = True
