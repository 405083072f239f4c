"""router.http_server: a request's head has a size limit (431) and a time limit (408) at the router and the
worker; a complete request, a keep-alive gap and a response being sent are untouched."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from router.http_server import MAX_HEAD_BYTES, LimitedHttpToolsProtocol
from tests.support import free_port


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _get(path: str, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: test", *headers, "", ""]
    return "\r\n".join(lines).encode()


def _send_head_and_read(port: int, head: bytes) -> bytes:
    with _connect(port) as sock:
        # NOTE: refused before the whole head was sent: its answer is still there to read
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(head)
        return _read_all(sock)


def _error_of(answer: bytes) -> dict:
    """The error object of a refusal: OpenAI's shape, JSON, with an x-request-id as every answer has."""
    head, _, body = answer.partition(b"\r\n\r\n")
    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
    assert fields[b"content-type"] == b"application/json" and len(fields[b"x-request-id"]) == 32, head
    assert int(fields[b"content-length"]) == len(body) and fields[b"connection"] == b"close"
    return orjson.loads(body)["error"]


def _first_response(port: int, head: bytes) -> bytes:
    with _connect(port) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        return data


@pytest.mark.parametrize("kind", ["router", "worker"])
def test_a_head_over_the_limit_is_431_and_the_server_keeps_serving(launch, kind):
    proc = launch.router([launch.echo_backend().url]) if kind == "router" else launch.sim_worker()
    port = int(proc.url.rsplit(":", 1)[1])
    under = _first_response(port, _get("/health", "x-pad: " + "a" * (MAX_HEAD_BYTES - 1024)))
    assert under.startswith(b"HTTP/1.1 200"), under[:200]
    # one header over the limit, complete
    over = _send_head_and_read(port, _get("/health", "x-pad: " + "a" * (MAX_HEAD_BYTES + 1)))
    assert over.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), over[:200]
    error = _error_of(over)
    assert error["code"] == "request_head_too_large" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"request head over {MAX_HEAD_BYTES} bytes")
    # many headers, each small, over the limit together
    many = _send_head_and_read(port, _get("/health", *(f"x-h{i}: {'b' * 100}" for i in range(1000))))
    assert many.startswith(b"HTTP/1.1 431"), many[:200]
    # a header that never ends: cut off after the limit (and one read), not held whole
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nx-pad: ")
        sent, refused = 0, False
        try:
            while sent < 64 * MAX_HEAD_BYTES:
                sock.sendall(b"c" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            refused = True
        answer = _read_all(sock)
    assert refused or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert sent < 64 * MAX_HEAD_BYTES
    # a request line the parser cannot read: uvicorn's 400, in the same shape
    garbled = _send_head_and_read(port, b"GARBAGE\r\n\r\n")
    assert garbled.startswith(b"HTTP/1.1 400 Bad Request\r\n"), garbled[:200]
    assert _error_of(garbled)["code"] == "invalid_http_request"
    again = _first_response(port, _get("/health"))
    assert again.startswith(b"HTTP/1.1 200"), again[:200]
    assert "431" in proc.log()


class _Server:
    """A real uvicorn server in a thread, on LimitedHttpToolsProtocol with a 0.5 s head timeout."""

    def __init__(self, delay_s: float = 0.0) -> None:
        async def answer(request):
            await asyncio.sleep(delay_s)
            return PlainTextResponse("x" * 1000)

        class Short(LimitedHttpToolsProtocol):
            head_timeout_s = 0.5

        self.port = free_port()
        app = Starlette(routes=[Route("/", answer)])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, http=Short, log_level="warning",
                                timeout_keep_alive=10, lifespan="off")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server():
    servers = []

    def start(delay_s: float = 0.0) -> _Server:
        servers.append(_Server(delay_s))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_a_head_under_the_limit_sent_in_many_pieces_is_served(server):
    """Counted once: its parts as parsed, not again as the bytes that carried them."""
    head = _get("/", *(f"x-h{i}: {'d' * 90}" for i in range(400)))  # ~40 KiB
    assert MAX_HEAD_BYTES // 2 < len(head) < MAX_HEAD_BYTES
    with _connect(server().port) as sock:
        for start in range(0, len(head), 2048):
            sock.sendall(head[start : start + 2048])
            time.sleep(0.005)  # NOTE: each piece its own read
        answer = b""
        while not answer.endswith(b"x" * 1000):
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_a_head_not_finished_in_time_is_408_and_a_silent_connection_is_closed(server):
    port = server().port
    with _connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nx-slow: ")
        started = time.monotonic()
        answer = _read_all(sock)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert _error_of(answer) == {"message": "request head not complete within 0.5 s",
                                 "type": "invalid_request_error", "code": "request_head_timeout"}  # fmt: skip
    assert waited < 5
    with _connect(port) as sock:  # nothing sent: closed without an answer
        assert _read_all(sock) == b""


def test_keep_alive_gaps_and_responses_being_sent_are_not_timed_as_heads(server):
    port = server(delay_s=1.0).port
    with _connect(port) as sock:
        sock.sendall(_get("/"))
        first = b""
        while not first.endswith(b"x" * 1000):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        time.sleep(1.0)  # idle between requests for twice the head timeout: keep-alive's, not the head's
        # a second request, then the start of a third's head while the second's response takes 1 s
        sock.sendall(_get("/") + b"GET / HTTP/1.1\r\nHost: test\r\n")
        rest = _read_all(sock)
    assert rest.startswith(b"HTTP/1.1 200"), rest[:200]
    assert b"x" * 1000 in rest  # the second response whole
    assert rest.count(b"HTTP/1.1 ") == 2 and b"HTTP/1.1 408 Request Timeout" in rest  # then the third's 408
