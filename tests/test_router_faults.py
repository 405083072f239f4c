"""The router as a real process in front of a worker that misbehaves on purpose (a real uvicorn
server in this test process): what the client, the worker's connection and the metrics see."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
import uuid

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.support import serve_in_thread, wait_until
from tests.test_end_to_end import matched_tokens
from tests.test_router_integration import metric_values


class FaultyWorker:
    """/health and /v1/models as a worker answers them; POST paths answered by ``handlers``; with
    ``events``, a KV event stream and an empty snapshot, so the router's index follows it."""

    def __init__(self, events: bool = False, **handlers) -> None:
        epoch = uuid.uuid4().hex
        health = {
            "status": "ok",
            "running": 0,
            "waiting": 0,
            **({"epoch": epoch, "kv_event_seq": 0} if events else {}),
        }
        self.health_status = 200  # what /health answers with: a test may fail its checks
        self.health_checks = 0

        def answer_health(request: Request) -> JSONResponse:
            self.health_checks += 1
            return JSONResponse(health, self.health_status)

        routes = [
            Route("/health", answer_health),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "faulty"}]})),
            *(Route(f"/v1/{path}", fn, methods=["POST"]) for path, fn in handlers.items()),
        ]
        if events:

            def snapshot(request: Request) -> JSONResponse:
                return JSONResponse({"version": 1, "worker": self.url, "epoch": epoch, "seq": 0, "ts": time.time(),
                                     "block_size": 16, "stored": [], "removed": [], "cleared": True})  # fmt: skip

            async def stream(request: Request) -> StreamingResponse:
                async def body():
                    yield f": kv events {epoch}\n\n".encode()
                    while True:
                        await asyncio.sleep(0.5)
                        yield b": ping\n\n"

                return StreamingResponse(body(), media_type="text/event-stream")

            info = {"block_size": 16, "namespace": "faulty", "model": "faulty", "tokenizer": "bytes", "epoch": epoch,
                    "hash_version": 1, "event_version": 1, "redis_stream": None}  # fmt: skip
            routes += [
                Route("/v1/cache/info", lambda r: JSONResponse({**info, "worker": self.url})),
                Route("/v1/cache/snapshot", snapshot),
                Route("/v1/cache/events", stream),
            ]
        self.url, self.server = serve_in_thread(Starlette(routes=routes), "the faulty worker")

    def stop(self) -> None:
        self.server.should_exit = True


@pytest.fixture
def faulty():
    started: list[FaultyWorker] = []

    def start(events: bool = False, **handlers) -> FaultyWorker:
        started.append(FaultyWorker(events, **handlers))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


@pytest.mark.parametrize("status", [500, 200])
def test_a_client_leaving_while_the_router_reads_a_workers_answer_closes_that_connection(
    launch, faulty, status
):
    """The worker's body (an error's, or a whole answer's, read before any of it is sent on) comes
    slowly; the client leaves meanwhile. The router must close its connection to the worker (which
    then stops its work), not leave it open."""
    sent, closed = threading.Event(), threading.Event()

    async def completions(request: Request):
        async def body():
            try:
                yield b'{"error": {"message": "the start of'
                sent.set()
                await asyncio.sleep(60)  # the rest never comes
                yield b' it"}}'
            finally:
                closed.set()  # NOTE: uvicorn ends the body when its client (the router) disconnects

        return StreamingResponse(body(), status_code=status, media_type="application/json")

    worker = faulty(completions=completions)
    router = launch.router([worker.url])
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json={"model": "faulty", "prompt": "x"}, timeout=1.0)
    assert sent.is_set()
    wait_until(closed.is_set, 10, what="the router closing its connection to the worker")


def _responses_stream_cut_after(launch, faulty, chunks: list[bytes]) -> bytes:
    """What a client of the router receives of a Responses stream whose worker sends ``chunks`` and dies."""

    async def responses(request: Request):
        async def body():
            for chunk in chunks:
                yield chunk
            raise RuntimeError("the worker dies here")

        return StreamingResponse(body(), media_type="text/event-stream")

    router = launch.router([faulty(responses=responses).url])
    body = {"model": "faulty", "input": "cut me off", "stream": True}
    with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=30) as r:
        return b"".join(r.iter_raw())


def test_a_responses_stream_cut_inside_an_events_number_is_numbered_from_the_last_whole_event(launch, faulty):
    """The stream breaks off after ``"sequence_number": 1`` of event 12: the error event is 12,
    following the 12 whole events (0..11) the client could read, not 2."""

    deltas = [f'data: {{"type":"response.output_text.delta","sequence_number":{n},"delta":"x"}}\n\n'.encode()
              for n in range(12)]  # fmt: skip
    received = _responses_stream_cut_after(
        launch, faulty, [*deltas, b'data: {"type":"response.output_text.delta","sequence_number":1']
    )
    numbers = []
    for line in received.splitlines():
        if line.startswith(b"data: "):
            with contextlib.suppress(orjson.JSONDecodeError):  # the event cut off is not JSON
                numbers.append(orjson.loads(line.removeprefix(b"data: "))["sequence_number"])
    assert numbers == list(range(13)), numbers


def test_a_responses_stream_the_worker_breaks_off_ends_with_response_failed(launch, faulty):
    """As a worker ends a Responses stream whose generation failed: ``response.failed`` failing the object
    ``response.created`` carried, numbered after the last event, instead of a bare ``error`` event that
    leaves clients without a final response."""
    created = {"id": "resp_x", "object": "response", "status": "in_progress", "output": [], "error": None}

    head = orjson.dumps({"type": "response.created", "sequence_number": 0, "response": created})
    received = _responses_stream_cut_after(
        launch, faulty, [b"event: response.created\ndata: " + head + b"\n\n",
                         b'data: {"type":"response.output_text.delta","sequence_number":1,"delta":"x"}\n\n'],
    )  # fmt: skip
    events = [orjson.loads(line[6:]) for line in received.splitlines() if line.startswith(b"data: ")]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1]
    assert failed["sequence_number"] == 2 and received.count(b"event: response.failed\n") == 1
    assert failed["response"]["id"] == "resp_x" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert failed["response"]["error"]["type"] == "stream_broken" and failed["response"]["error"]["message"]


def test_a_last_line_without_its_newline_reaches_the_client_when_the_body_ends_in_a_read_of_its_own(
    launch, faulty
):
    """With the usage line stripped (a client that did not ask for usage), the scanner holds back a line not
    ended yet: when the body's end came in a read after it, that line was dropped."""

    async def completions(request: Request):
        async def body():
            yield b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            yield b"data: [DONE]"
            await asyncio.sleep(0.2)  # NOTE: the chunked body's end, in a write of its own

        return StreamingResponse(body(), media_type="text/event-stream")

    worker = faulty(completions=completions)
    router = launch.router([worker.url])
    with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                      json={"model": "faulty", "prompt": "x", "stream": True}) as r:  # fmt: skip
        received = b"".join(r.iter_raw())
    assert received == b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]'


def test_a_stream_request_the_worker_refuses_is_timed_as_a_stream_request(launch, faulty):
    async def completions(request: Request):
        return JSONResponse({"error": {"message": "no", "code": "bad"}}, status_code=400)

    worker = faulty(completions=completions)
    router = launch.router([worker.url])
    body = {"model": "faulty", "prompt": "x", "stream": True}
    assert httpx.post(router.url + "/v1/completions", json=body, timeout=30).status_code == 400
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for family in ("radixgate_ttft_seconds_count", "radixgate_request_duration_seconds_count"):
        counts = metric_values(text, family)
        assert counts['{stream="true"}'] == 1 and counts.get('{stream="false"}', 0) == 0, (family, counts)


def test_a_repeated_request_id_is_read_as_its_last_value_everywhere(launch, faulty):
    """The answer, the worker and the access log must name one request id."""
    seen: list[str | None] = []

    async def completions(request: Request):
        seen.append(request.headers.get("x-request-id"))
        return JSONResponse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    worker = faulty(completions=completions)
    router = launch.router([worker.url], "--access-log")
    headers = [("x-request-id", "first"), ("x-request-id", "second")]
    body = orjson.dumps({"model": "faulty", "prompt": "x"})
    resp = httpx.post(router.url + "/v1/completions", content=body, headers=headers, timeout=30)
    assert resp.status_code == 200 and resp.headers.get_list("x-request-id") == ["second"]
    assert seen == ["second"]
    wait_until(lambda: len(router.access_lines()) == 1, 10, what="the access line")
    assert router.access_lines()[0]["request_id"] == "second"


def test_event_numbers_are_read_from_whole_lines_across_chunks():
    from router.gateway import _EventNumbers

    numbers = _EventNumbers()
    for chunk, last in [(b'data: {"sequence_number":1', None), (b'1,"x":1}\n\ndata: {"sequence_number":1', 11),
                        (b"2", 11), (b'}\n\ndata: {"sequence_number":13', 12)]:  # fmt: skip
        numbers.feed(chunk)
        assert numbers.last == last


async def _broken_stream(request: Request) -> StreamingResponse:
    """A stream that breaks off after its first event (the worker dies)."""

    async def body():
        yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
        raise RuntimeError("the worker dies here")

    return StreamingResponse(body(), media_type="text/event-stream")


def test_a_worker_that_breaks_off_every_stream_after_its_head_opens_its_breaker(launch, faulty):
    """Broken streams are faults (docs/router.md): three in a row open the breaker. The head of each
    had cleared the worker's faults in a row, so it never opened, and the worker kept its share of
    the traffic, every one of those requests failing."""
    worker = faulty(completions=_broken_stream)
    router = launch.router([worker.url])
    body = {"model": "faulty", "prompt": "x", "stream": True}
    for _ in range(3):
        answer = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200 and b"stream_broken" in answer.content
    states = [w["breaker"] for w in httpx.get(router.url + "/workers", timeout=10).json()["workers"]]
    assert states == ["open"]


def test_a_whole_answer_cut_off_after_its_head_goes_to_the_next_worker(launch, faulty):
    """A non-stream answer is read whole before any byte of it reaches the client: one that breaks
    off after its head is moved to the next worker (it was a 502 "connect"), and counted as a
    broken answer, not a connection error."""

    async def cut(request: Request) -> StreamingResponse:
        async def body():
            yield b'{"choices": [{"index": 0, "te'
            raise RuntimeError("the worker dies here")

        return StreamingResponse(body(), media_type="application/json")

    async def fine(request: Request) -> JSONResponse:
        return JSONResponse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    broken, good = faulty(completions=cut), faulty(completions=fine)
    router = launch.router([broken.url, good.url], "--policy", "round_robin")
    for i in range(2):  # round robin: one of them tries the broken worker first
        answer = httpx.post(
            router.url + "/v1/completions", json={"model": "faulty", "prompt": f"x{i}"}, timeout=30
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok", answer.text
        assert answer.headers["x-radixgate-worker"] == good.url
    text = httpx.get(router.url + "/metrics", timeout=10).text
    errors = metric_values(text, "radixgate_upstream_errors_total")
    tries = errors.get(f'{{kind="stream_broken",worker="{broken.url}"}}', 0)
    assert tries >= 1 and sum(errors.values()) == tries, errors
    assert metric_values(text, "radixgate_upstream_retries_total")[f'{{worker="{broken.url}"}}'] == tries


class HangingUpWorker:
    """Answers GET /health and /v1/models as a worker does (any other GET: 404); a POST is read
    whole, then its connection closed with no response head, as a worker that dies mid-request."""

    def __init__(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        start = asyncio.start_server(self._serve, sock=sock)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers = {
            "/health": {"status": "ok", "running": 0, "waiting": 0},
            "/v1/models": {"data": [{"id": "faulty"}]},
        }
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ")
                sizes = [
                    int(v)
                    for k, _, v in (line.partition(":") for line in lines[1:])
                    if k.lower() == "content-length"
                ]
                await reader.readexactly(sizes[0] if sizes else 0)
                if method == "POST":
                    break
                body = orjson.dumps(answers.get(path, {"error": "not found"}))
                status = b"200 OK" if path in answers else b"404 Not Found"
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(body), body))  # fmt: skip
                await writer.drain()
        writer.close()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)


def test_a_worker_that_hangs_up_before_its_answers_head_is_charged_as_closed_not_unreachable(launch, faulty):
    """A worker that takes a request and closes the connection before any response head (it died
    mid-request) was reached: its fault is counted as `closed`, not as a connection error, and the
    request goes to the next worker."""

    async def fine(request: Request) -> JSONResponse:
        return JSONResponse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    hanging, good = HangingUpWorker(), faulty(completions=fine)
    try:
        router = launch.router([hanging.url, good.url], "--policy", "round_robin")
        for i in range(2):  # round robin: one of them tries the hanging worker first
            answer = httpx.post(
                router.url + "/v1/completions", json={"model": "faulty", "prompt": f"x{i}"}, timeout=30
            )
            assert answer.status_code == 200 and answer.headers["x-radixgate-worker"] == good.url, answer.text
        errors = metric_values(
            httpx.get(router.url + "/metrics", timeout=10).text, "radixgate_upstream_errors_total"
        )
        tries = errors.get(f'{{kind="closed",worker="{hanging.url}"}}', 0)
        assert tries >= 1 and sum(errors.values()) == tries, errors
    finally:
        hanging.stop()


def test_a_fault_then_a_full_queue_is_the_faults_error_not_a_429(launch, faulty):
    """The client gets 429 only when every worker tried had a full queue; a 500 on one worker and a
    429 on the next read "every worker tried has a full queue" in that order."""

    async def error(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    async def full(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "full", "code": "queue_full"}}, status_code=429)

    failing, busy = faulty(completions=error), faulty(completions=full)
    router = launch.router([failing.url, busy.url], "--policy", "round_robin")
    for i in range(2):  # round robin: the two orders
        answer = httpx.post(
            router.url + "/v1/completions", json={"model": "faulty", "prompt": f"x{i}"}, timeout=30
        )
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "http_5xx", answer.text
    busy_only = launch.router([busy.url])
    answer = httpx.post(
        busy_only.url + "/v1/completions", json={"model": "faulty", "prompt": "z"}, timeout=30
    )
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "overloaded"
    assert answer.headers["retry-after"] == "1"  # OpenAI's clients wait that long before their retry


def test_a_stream_the_worker_broke_off_takes_back_its_prefix_where_the_index_follows_its_events(
    launch, faulty
):
    """The worker's KV events put back what it computed; the router's optimistic insert of a stream
    that broke off stayed, predicting a prefix the worker never cached (cache_aware kept sending it
    there)."""
    worker = faulty(events=True, completions=_broken_stream)
    router = launch.router([worker.url])
    wait_until(
        lambda: metric_values(httpx.get(router.url + "/metrics", timeout=10).text,
                              "radixgate_upstream_kv_resyncs_total").get(f'{{worker="{worker.url}"}}', 0) >= 1,
        30, what="the router reading the worker's snapshot",
    )  # fmt: skip
    body = {"model": "faulty", "prompt": "a shared prefix of some length " * 10, "stream": True}
    answer = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200 and b"stream_broken" in answer.content
    assert matched_tokens(router.url, body)[worker.url] == 0


def test_faults_between_whole_streams_whose_last_bytes_come_apart_open_no_breaker(launch, faulty):
    """A stream whose body ends in a read of its own (the chunked encoding's end after [DONE]) is
    whole: it clears the worker's faults in a row. It was taken as broken off, so three 500s between
    whole streams opened the breaker."""
    calls = itertools.count()

    async def completions(request: Request):
        if next(calls) % 2 == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def body():
            yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n'
            await asyncio.sleep(0.05)  # the body's end comes in a read of its own

        return StreamingResponse(body(), media_type="text/event-stream")

    worker = faulty(completions=completions)
    router = launch.router([worker.url], "--max-retries", "0")
    for i in range(5):
        body = {"model": "faulty", "prompt": "x", "stream": i % 2 == 1}
        answer = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == (200 if i % 2 else 502), answer.text
    states = [w["breaker"] for w in httpx.get(router.url + "/workers", timeout=10).json()["workers"]]
    assert states == ["closed"]


def test_an_open_breaker_stays_open_when_its_worker_comes_back_from_failed_health_checks(
    launch, faulty, tmp_path
):
    """A worker that fails every answer opens its breaker; its health checks then fail for a while
    and pass again, the same process (its epoch unchanged). Passing checks say nothing of its answers:
    the breaker stays open for its cool-down (it was closed at once, and each flap of /health let
    three more requests fail on it)."""

    async def failing(request: Request) -> JSONResponse:
        return JSONResponse({"error": {"message": "broken"}}, 500)

    worker = faulty(events=True, completions=failing)
    config = tmp_path / "router.yaml"
    config.write_text("health_interval_s: 0.2\nbreaker_open_s: 60\nmax_retries: 0\n")
    router = launch.router([worker.url], "--config", str(config))

    def row() -> dict:
        return httpx.get(router.url + "/workers", timeout=5).json()["workers"][0]

    wait_until(lambda: row()["healthy"], 10, what="the worker healthy")
    for _ in range(3):
        answer = httpx.post(
            router.url + "/v1/completions", json={"model": "faulty", "prompt": "x"}, timeout=30
        )
        assert answer.status_code == 502, answer.text
    assert row()["breaker"] == "open"
    worker.health_status = 503
    wait_until(lambda: not row()["healthy"], 10, what="the worker's checks failing")
    worker.health_status = 200
    wait_until(lambda: row()["healthy"], 10, what="the worker healthy again")
    assert row()["breaker"] == "open"


@pytest.mark.parametrize("endpoint", ["completions", "responses"])
def test_a_client_that_leaves_after_the_streams_last_event_got_its_answer(launch, faulty, endpoint):
    """The worker sends a stream's last event ([DONE]; a Responses stream's response.completed) and
    ends its body a moment later. A client that read the last event and closed got the whole answer:
    a 200, the worker's success, not a 499 with its prefix taken back (1 in 25 such streams was)."""
    last = (b"data: [DONE]\n\n" if endpoint == "completions"
            else b'event: response.completed\ndata: {"type":"response.completed","sequence_number":1}\n\n')  # fmt: skip

    async def stream(request: Request) -> StreamingResponse:
        async def body():
            yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n' + last
            await asyncio.sleep(1.0)  # the body's end comes in a read of its own

        return StreamingResponse(body(), media_type="text/event-stream")

    worker = faulty(**{endpoint: stream})
    router = launch.router([worker.url])
    body = orjson.dumps(
        {"model": "faulty", "input" if endpoint == "responses" else "prompt": "x", "stream": True}
    )
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/%s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                     % (endpoint.encode(), len(body)) + body)  # fmt: skip
        got = b""
        while last not in got:
            got += sock.recv(65536) or pytest.fail(f"the stream ended without its last event: {got!r}")
    # closed: the answer read to its end

    def counted() -> dict:
        text = httpx.get(router.url + "/metrics", timeout=10).text
        return {k: v for k, v in metric_values(text, "radixgate_requests_total").items() if v}

    wait_until(lambda: counted(), 10, what="the request counted")
    time.sleep(1.5)  # the worker's body ended meanwhile
    (labels,) = counted()
    assert 'status="200"' in labels, counted()


def test_a_silent_worker_does_not_slow_the_other_workers_health_checks(launch, faulty, tmp_path):
    """A worker that takes connections and never answers: each of its checks waits health_timeout_s.
    The other worker is still checked once an interval (every round waited for its slowest check, so
    one silent worker checked the whole fleet once per interval + timeout)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # NOTE: never accepted: connections open, nothing answers
    try:
        worker = faulty()
        config = tmp_path / "router.yaml"
        config.write_text("health_interval_s: 0.2\nhealth_timeout_s: 3\n")
        router = launch.router(
            [worker.url, f"http://127.0.0.1:{silent.getsockname()[1]}"], "--config", str(config)
        )
        time.sleep(1.0)  # past the start-up checks
        before = worker.health_checks
        time.sleep(3.0)
        # NOTE: once per 0.2 s: ~15; rounds waiting on the silent worker's 3 s checks: at most 2
        assert worker.health_checks - before >= 6, worker.health_checks - before
        rows = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
        assert [w["healthy"] for w in rows] == [True, False]
    finally:
        silent.close()


def test_a_request_that_has_passed_too_many_routers_is_a_loop_refused(launch, faulty):
    """Each router counts itself in x-radixgate-hops; one that finds 8 already refuses the request,
    508 loop_detected: routers among each other's workers forwarded each request until something ran
    out (~10,000 times in 11 s for a router that discovered itself)."""
    seen: list[str | None] = []

    async def completions(request: Request) -> JSONResponse:
        seen.append(request.headers.get("x-radixgate-hops"))
        return JSONResponse({"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    worker = faulty(completions=completions)
    router = launch.router([worker.url])
    body = {"model": "faulty", "prompt": "x"}
    for sent, passed in ((None, "1"), ("3", "4"), ("7", "8"), ("junk", "1")):
        headers = {} if sent is None else {"x-radixgate-hops": sent}
        answer = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert answer.status_code == 200 and seen[-1] == passed, (sent, answer.text)
    refused = httpx.post(
        router.url + "/v1/completions", json=body, headers={"x-radixgate-hops": "8"}, timeout=30
    )
    assert refused.status_code == 508 and refused.json()["error"]["code"] == "loop_detected"
    assert len(seen) == 4
