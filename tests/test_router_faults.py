"""The router as a real process in front of a worker that misbehaves on purpose (a real uvicorn
server in this test process): what the client, the worker's connection and the metrics see."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.support import serve_in_thread, wait_until
from tests.test_router_integration import metric_values


class FaultyWorker:
    """/health and /v1/models as a worker answers them; POST paths answered by ``handlers``."""

    def __init__(self, **handlers) -> None:
        routes = [
            Route("/health", lambda r: JSONResponse({"status": "ok", "running": 0, "waiting": 0})),
            Route("/v1/models", lambda r: JSONResponse({"data": [{"id": "faulty"}]})),
            *(Route(f"/v1/{path}", fn, methods=["POST"]) for path, fn in handlers.items()),
        ]
        self.url, self.server = serve_in_thread(Starlette(routes=routes), "the faulty worker")

    def stop(self) -> None:
        self.server.should_exit = True


@pytest.fixture
def faulty():
    started: list[FaultyWorker] = []

    def start(**handlers) -> FaultyWorker:
        started.append(FaultyWorker(**handlers))
        return started[-1]

    yield start
    for worker in started:
        worker.stop()


def test_a_client_leaving_while_the_router_reads_a_workers_error_closes_that_connection(launch, faulty):
    """The worker's 500 body comes slowly; the client leaves meanwhile. The router must close its
    connection to the worker (which then stops its work), not leave it open."""
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

        return StreamingResponse(body(), status_code=500, media_type="application/json")

    worker = faulty(completions=completions)
    router = launch.router([worker.url])
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json={"model": "faulty", "prompt": "x"}, timeout=1.0)
    assert sent.is_set()
    wait_until(closed.is_set, 10, what="the router closing its connection to the worker")


def test_a_responses_stream_cut_inside_an_events_number_is_numbered_from_the_last_whole_event(launch, faulty):
    """The stream breaks off after ``"sequence_number": 1`` of event 12: the error event is 12,
    following the 12 whole events (0..11) the client could read, not 2."""

    async def responses(request: Request):
        async def body():
            for n in range(12):
                yield f'data: {{"type":"response.output_text.delta","sequence_number":{n},"delta":"x"}}\n\n'.encode()
            yield b'data: {"type":"response.output_text.delta","sequence_number":1'
            raise RuntimeError("the worker dies here")

        return StreamingResponse(body(), media_type="text/event-stream")

    worker = faulty(responses=responses)
    router = launch.router([worker.url])
    body = {"model": "faulty", "input": "cut me off", "stream": True}
    with httpx.stream("POST", router.url + "/v1/responses", json=body, timeout=30) as r:
        received = b"".join(r.iter_raw())
    numbers = []
    for line in received.splitlines():
        if line.startswith(b"data: "):
            with contextlib.suppress(orjson.JSONDecodeError):  # the event cut off is not JSON
                numbers.append(orjson.loads(line.removeprefix(b"data: "))["sequence_number"])
    assert numbers == list(range(13)), numbers


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
