"""The HTTP/1.1 server protocol of the router and the worker: uvicorn's httptools protocol with limits on
a request's head (its request line and headers), which uvicorn sets none of.

- Size: a head over ``max_head_bytes`` (64 KiB; URL and header names and values, 4 bytes a header for
  ": " and CRLF) is answered 431 and its connection closed. httptools holds a header until it ends, so
  the bytes of a head not yet complete are counted as they arrive: one that never ends is cut off
  after at most ``max_head_bytes`` plus one read.
- Time: a head must be complete within ``head_timeout_s`` (30 s) of its first byte, and a new
  connection must send one within as long: otherwise 408 (no answer to a connection that sent
  nothing, as a client may have opened it ahead of need) and the connection is closed. Between
  requests uvicorn's keep-alive timeout applies, and a response still being sent is never cut off.

These refusals, and a request the parser cannot read (400 ``invalid_http_request``, uvicorn's plain text
otherwise), are answered in OpenAI's error shape with an ``x-request-id`` made for them, as every other
answer. The rest (request parsing, pipelining, flow control, shutdown) is uvicorn's;
``uvicorn.Config(http=...)`` takes the class."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from http import HTTPStatus

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import error_body

log = logging.getLogger("radixgate.http")

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the parser stops, and uvicorn answers with send_400_response."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._in_head = True  # from the connection's start, and from each request's first byte to its body
        self._head_bytes = 0  # the head's parts parsed so far (URL, header names and values)
        self._head_received = 0  # bytes received while the head is unfinished (after the read it began in)
        self._head_started = False  # a byte of the head arrived (a silent connection gets no answer)
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[HTTPStatus, str, str] | None = None  # status, message, error code

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # NOTE: refused: nothing after the head is read
        if self._in_head:
            self._head_started = True
            self._head_received += len(data)
        super().data_received(data)
        if self._in_head and self._head_received > self.max_head_bytes and not self.transport.is_closing():
            self._refuse(*self._too_large())  # an unfinished head

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._head_received = True, 0, 0
        if self._head_timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request the parser could not read (and where it stopped at _HeadTooLarge)."""
        if self._refusal is None:
            message = "invalid HTTP request: its request line or headers could not be parsed"
            self._refusal = (HTTPStatus.BAD_REQUEST, message, "invalid_http_request")
        self._send_refusal()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.max_head_bytes:
            self._refusal = self._too_large()
            raise _HeadTooLarge

    def _too_large(self) -> tuple[HTTPStatus, str, str]:
        message = f"request head over {self.max_head_bytes} bytes (request line and headers)"
        return HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, message, "request_head_too_large"

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # NOTE: a pipelined head behind a response still being sent: that response first
            return
        if not self._head_started:
            self.transport.close()  # a connection that never sent a byte
            return
        message = f"request head not complete within {self.head_timeout_s:g} s"
        self._refuse(HTTPStatus.REQUEST_TIMEOUT, message, "request_head_timeout")

    def _refuse(self, status: HTTPStatus, message: str, code: str) -> None:
        self._refusal = (status, message, code)
        self._send_refusal()

    def _send_refusal(self) -> None:
        status, message, code = self._refusal
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("%s: %d %s", client, status.value, message)
        body = error_body(status.value, message, code)
        head = [f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()]
        for name, value in self.server_state.default_headers:  # NOTE: server and date, as uvicorn sends
            head += (name, b": ", value, b"\r\n")
        head.append(
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {os.urandom(16).hex()}\r\nconnection: close\r\n\r\n".encode()
        )
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        self._disarm()


def run_server(server: uvicorn.Server) -> bool:
    """``server.run()``; True where a Ctrl-C ended it. uvicorn raises the signal it shut down on again as
    it ends, which asyncio's runner turns into a KeyboardInterrupt for SIGINT: ``uvicorn.run`` swallows it
    (exit status 0), a bare ``run()`` ends in its traceback. The caller cleans up, then ends by
    ``exit_by_sigint``: quietly, with the status a Ctrl-C gives (130)."""
    try:
        server.run()
    except KeyboardInterrupt:
        return True
    return False


def exit_by_sigint() -> None:
    """End this process by SIGINT, its default action (no handler, no traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.raise_signal(signal.SIGINT)
