"""A small pooled HTTP/1.1 client for the router's hot path: POST a body, get the status and
headers, then read the body whole or chunk by chunk as it arrives.

Why not aiohttp here: on this project's CI machine one aiohttp request costs ~370 us of CPU,
more than the router's whole added-latency budget; this client (asyncio protocol + httptools,
the parser uvicorn uses) costs ~135 us for the same request (python -m loadtest.bench_http_clients,
docs/benchmarks/router-overhead.md).
It does only what the router needs: POST with a body, keep-alive pooling per origin, chunked and
content-length responses, streaming with back-pressure, three timeouts, http and https.
Health checks and event streams (not per request) keep using aiohttp.

Timeouts: ``connect_timeout`` for opening a connection; ``read_timeout`` for the response head and
for every gap between body chunks (a stuck worker); ``total_timeout`` for the whole exchange.

A request that fails on a *reused* keep-alive connection before any response byte arrived and
within ``IDLE_RACE_S`` of its write (the server closed an idle connection as we wrote) is sent once
more on a new connection; any other failure raises (a server that held the request longer before
closing may have run it), and the caller decides about retrying on another worker.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import re
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

# errors of this process, not of the server it connects to (too many open files, no buffers, no memory)
_LOCAL_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
_HIGH_WATER = 1 << 20  # pause reading a streamed body when this many bytes wait unread
_LOW_WATER = 1 << 18


class HTTPClientError(Exception):
    """Base of every failure this client raises."""


class ConnectFailed(HTTPClientError):
    """The connection could not be opened (refused, unreachable, connect timeout)."""


class OutOfResources(HTTPClientError):
    """This process could not open a connection (out of file descriptors or memory): no fault of the
    server it was for."""


class ResponseTimeout(HTTPClientError):
    """No response head, or no next body chunk, within the timeout; or (``total``) the request's
    total timeout ran out."""

    def __init__(self, message: str, total: bool = False) -> None:
        super().__init__(message)
        self.total = total


class ConnectionBroken(HTTPClientError):
    """The connection closed or sent something unparseable before the response ended."""


class Abandoned(HTTPClientError):
    """The caller gave up waiting for the response head (HTTPClient.abandon_heads)."""


class Response:
    """One response. Read it with ``read()`` or ``chunks()``, then ``close()`` (always; it returns
    the connection to the pool when the body was fully read, else closes it)."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers  # lower-case names; the last value wins for repeated headers

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self):
        """The body as it arrives: each item is everything received since the last one (no
        re-framing, no waiting to fill a buffer)."""
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    @property
    def at_end(self) -> bool:
        """The whole body has arrived and been handed out (the last chunk was the last)."""
        return self._conn.drained

    def close(self) -> None:
        self._conn.release()


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its response parsed as bytes arrive."""

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.sent_at = 0.0  # when the request was written
        self._reset()

    def _reset(self) -> None:
        self._headers: dict[str, str] = {}
        self._waiter: asyncio.Future | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._head_done = False
        self._complete = False
        self._error: HTTPClientError | None = None
        self.received = False
        self.wrote = False  # the request is written (else the connection was found closed first)
        self._paused = False
        self._until_close = False
        self._keep_alive = False
        self._interim = False  # parsing a 1xx response (100 Continue, 103 Early Hints): not the answer

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ConnectionBroken("the server tried to switch protocols"))
        except httptools.HttpParserCallbackError as exc:
            if self._complete:  # NOTE: on_message_begin: a response after the answer, which stands; the
                self.abort()  # connection is out of step with its requests: never reused
            else:
                self._fail(ConnectionBroken(str(exc.__context__ or exc)))
        except httptools.HttpParserError as exc:
            self._fail(ConnectionBroken(f"malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.discard(self)  # an idle connection the server closed leaves the pool at once
        if self._head_done and self._until_close and not self._complete and exc is None:
            self.on_message_complete()  # no length and not chunked: the body ends at a clean close
        elif not self._complete:
            self._fail(ConnectionBroken(f"connection closed before the response ended ({exc or 'EOF'})"))

    # ------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        # NOTE: after the answer ended (or on an idle connection): a response nobody asked for; the parser
        # stops there (data_received)
        if self._complete:
            raise ConnectionError("the server sent a response after the answer")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if 100 <= self._parser.get_status_code() < 200:  # NOTE: an interim response: the answer follows
            self._interim = True  # (101 raises HttpParserUpgrade instead)
            self._headers = {}
            return
        headers = self._headers
        # NOTE: a transfer coding's name is case-insensitive (RFC 9112 7): "Chunked" is chunked
        self._until_close = (
            "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()
        )
        self._head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # only valid inside the callback
        self._wake()

    # ------------------------------------------------------------ request side
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HTTPClientError) -> None:
        if self._error is None:
            self._error = error
        self._wake()
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, deadline: float, read_timeout: float) -> None:
        """Wait for the next parser event, or raise the connection's error or a timeout."""
        if self._error is not None:
            raise self._error
        left = deadline - self._loop.time()
        if left <= 0:
            raise ResponseTimeout(_TOTAL_RAN_OUT, total=True)
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(min(read_timeout, left), _expire, waiter, left <= read_timeout)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def send(
        self,
        head: bytes,
        body: bytes,
        deadline: float,
        on_sent: Callable[[], None] | None,
        head_timeout: float | None = None,
    ) -> Response:
        self._reset()
        assert self._transport is not None
        # NOTE: a connection the server closed before anything was written (a new one it accepted and
        # closed at once): written to, it raised an uncaught RuntimeError under uvloop (a bare 500, no
        # retry) and under asyncio waited out the read timeout
        if self.closed or self._transport.is_closing():
            raise ConnectionBroken("the server closed the connection before the request was sent")
        self._deadline = deadline
        self._transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self._transport.write(body)
        self.wrote, self.sent_at = True, self._loop.time()
        if on_sent is not None:
            on_sent()
        heads = self._pool.heads
        heads.add(self)
        try:
            while not self._head_done:
                await self._wait(deadline, self._pool.read_timeout if head_timeout is None else head_timeout)
        finally:
            heads.discard(self)
        status = self._parser.get_status_code()
        return Response(self, status, self._headers)

    async def next_chunk(self) -> bytes | None:
        while not self._chunks:
            if self._complete:
                return None
            await self._wait(self._deadline, self._pool.read_timeout)
        chunks = self._chunks
        # Everything that has already arrived, in one piece: a fast upstream's SSE events then
        # cost one write to the client, not one each. Nothing waits for more to arrive.
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self._buffered < _LOW_WATER and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    @property
    def drained(self) -> bool:
        return self._complete and not self._chunks

    def release(self) -> None:
        """Back to the pool if the exchange ended cleanly and the server keeps the connection."""
        reusable = (
            self._complete
            and self._error is None
            and not self.closed
            and not self._until_close
            and self._keep_alive
        )
        if reusable:
            self._parser = httptools.HttpResponseParser(self)
            self.idle_since = self._loop.time()
            self._pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


_TOTAL_RAN_OUT = "the request's total timeout ran out"
# NOTE: a server's close of an idle connection that crossed our request ends it within a round trip of
# the write; a close later than this came with the request in hand
IDLE_RACE_S = 0.25


def _expire(waiter: asyncio.Future, total: bool) -> None:
    if not waiter.done():
        message = _TOTAL_RAN_OUT if total else "no response from the worker within the read timeout"
        waiter.set_exception(ResponseTimeout(message, total))


_DEFAULT_PORTS = {"http": 80, "https": 443}


def without_credentials(url: str) -> str:
    """``url`` as it may be shown (errors, logs): a user and password before the host as ``***``."""
    return re.sub(r"(//)[^/@]*@", r"\1***@", url, count=1)


def worker_base_url(url: object) -> str:
    """``url`` as a worker's base URL in one spelling per worker: the host in lower case, the
    port as a plain number and left out where it is the scheme's default, no trailing slash (so
    ``HTTP://W1:08000/`` and ``http://w1:8000`` name one worker). ValueError unless it is an http(s)
    URL in ASCII with a host, a port in range (if any), and no credentials, query, fragment or
    whitespace."""
    if not isinstance(url, str) or not url[:8].lower().startswith(("http://", "https://")):
        raise ValueError(f"worker URL must start with http:// or https://: {url!r}")
    if not url.isascii():
        # NOTE: requests to it are written as its text is (the Host header, the request line)
        raise ValueError(f"worker URL {url!r} must be ASCII: a host in its IDNA form, a path percent-encoded")
    try:
        parts = urlsplit(url)  # NOTE: the scheme comes back in lower case
        if parts.port == 0:  # NOTE: .port raises for one out of range or not a number
            raise ValueError("out of range")
    except ValueError as exc:
        why = "its port is out of range 1-65535" if "out of range" in str(exc) else exc
        raise ValueError(f"worker URL {without_credentials(url)!r}: {why}") from None
    if not parts.hostname or any(c.isspace() or c in "?#" for c in url):  # NOTE: an empty query too
        raise ValueError(
            f"worker URL {without_credentials(url)!r} needs a host, and takes no query, fragment or spaces"
        )
    if "@" in parts.netloc:
        # NOTE: never sent (the router's key for workers is --worker-api-key), yet a worker's URL is
        # shown on the open /metrics and in every answer's x-radixgate-worker header
        raise ValueError(f"worker URL {parts.hostname!r} takes no user or password: use --worker-api-key")
    try:
        parts.hostname.encode("idna")  # NOTE: as a connection would: an empty or over-long label fails
    except UnicodeError:
        raise ValueError(f"worker URL {url!r}: {parts.hostname!r} is not a host name") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # NOTE: .hostname is lower case
    port = "" if parts.port in (None, _DEFAULT_PORTS[parts.scheme]) else f":{parts.port}"
    return f"{parts.scheme}://{host}{port}{parts.path}".rstrip("/")


class _Pool:
    """Idle connections to one origin, most recently used first."""

    def __init__(self, client: HTTPClient, host: str, port: int, tls: bool) -> None:
        self.host, self.port = host, port
        self.ssl = client.tls_context() if tls else None
        self.read_timeout = client.read_timeout
        self._client = client
        self._idle: dict[_Connection, None] = {}  # an ordered set: most recently used last
        self.heads: set[_Connection] = set()  # connections whose request waits for its response head
        name = f"[{host}]" if ":" in host else host  # NOTE: an IPv6 address is bracketed in Host
        self.host_header = name if port in (80, 443) else f"{name}:{port}"
        self.closed = False  # forgotten by its client: connections coming back are closed

    def put(self, conn: _Connection) -> None:
        if self.closed:
            conn.abort()
            return
        idle, limit = self._idle, asyncio.get_running_loop().time() - self._client.idle_timeout
        idle[conn] = None
        while (oldest := next(iter(idle))) is not conn and oldest.idle_since <= limit:
            del idle[oldest]  # NOTE: idle too long: closed, not kept for a burst that is over
            oldest.abort()

    def discard(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)

    def take(self) -> _Connection | None:
        idle, now = self._idle, asyncio.get_running_loop().time()
        while idle:
            conn, _ = idle.popitem()
            if not conn.closed and now - conn.idle_since < self._client.idle_timeout:
                return conn
            conn.abort()
        return None

    async def connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self._client.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectFailed(f"connect to {self.host}:{self.port} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            if exc.errno in _LOCAL_ERRNOS:
                raise OutOfResources(f"cannot open a connection to {self.host}:{self.port}: {exc}") from None
            raise ConnectFailed(f"connect to {self.host}:{self.port} failed: {exc}") from None
        return conn

    def close(self) -> None:
        self.closed = True
        for conn in list(self._idle):
            conn.abort()
        self._idle.clear()


class HTTPClient:
    """Pooled keep-alive connections to any number of origins (one pool per scheme/host/port), at most
    ``max_pools`` at once: a worker that fetches KV from sources its clients may name (``--kv-hints
    any``) meets any number of them, and each pool is held until forgotten."""

    max_pools = 4096

    def __init__(
        self,
        connect_timeout: float = 2.0,
        read_timeout: float = 120.0,
        total_timeout: float = 600.0,
        idle_timeout: float = 4.0,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.total_timeout = total_timeout
        self.idle_timeout = idle_timeout  # below uvicorn's default keep-alive of 5 s
        self._pools: dict[str, tuple[_Pool, bytes]] = {}
        self._tls: ssl.SSLContext | None = None

    def tls_context(self) -> ssl.SSLContext:
        """One for every https pool (a context holds the CA store: ~0.8 MiB each)."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _pool(self, base_url: str) -> tuple[_Pool, bytes]:
        found = self._pools.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"not an http(s) URL: {base_url!r}")
            if len(self._pools) >= self.max_pools:
                self.forget(next(iter(self._pools)))  # NOTE: the oldest; its exchanges under way still end
            tls = parts.scheme == "https"
            pool = _Pool(self, parts.hostname, parts.port or (443 if tls else 80), tls)
            found = self._pools[base_url] = (pool, parts.path.rstrip("/").encode("latin-1"))
        return found

    async def post(
        self,
        base_url: str,
        path: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        on_sent: Callable[[], None] | None = None,
        head_timeout: float | None = None,
        on_connect: Callable[[], None] | None = None,
    ) -> Response:
        """Send ``POST base_url + path`` and return once the response head arrived.

        ``on_sent`` runs once, right after the request has been handed to a connection (never
        if no connection could be opened): work that must not delay the request goes there.
        ``on_connect`` runs when no idle connection is at hand, right before a new one is opened,
        whether it then opens or not: opening one yields to other tasks, and what they must see
        by then (the router's optimistic index insert) goes there.
        ``head_timeout`` replaces the read timeout for the head (a server that answers only when
        done: only the total timeout bounds it)."""
        pool, prefix = self._pool(base_url)
        lines = [
            b"POST %s%s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n"
            % (prefix, path.encode("latin-1"), pool.host_header.encode("latin-1"), len(body))
        ]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} contains a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        head = b"".join(lines)
        deadline = asyncio.get_running_loop().time() + self.total_timeout
        conn = pool.take()
        if conn is not None:
            try:
                return await conn.send(head, body, deadline, on_sent, head_timeout)
            except ConnectionBroken:
                conn.abort()
                if conn.received or (
                    conn.wrote and asyncio.get_running_loop().time() - conn.sent_at > IDLE_RACE_S
                ):
                    raise
                # The server closed this idle connection as (or before) we wrote: once more on a new one.
                if conn.wrote:
                    on_sent = None  # it already ran
            except BaseException:
                conn.abort()
                raise
        elif on_connect is not None:
            on_connect()
        conn = await pool.connect()
        try:
            return await conn.send(head, body, deadline, on_sent, head_timeout)
        except BaseException:
            conn.abort()
            raise

    def forget(self, base_url: str) -> None:
        """Drop ``base_url``'s pool (a worker removed from the fleet): its idle connections are
        closed now, those in use when their exchange ends. A later request opens a new one."""
        found = self._pools.pop(base_url, None)
        if found is not None:
            found[0].close()

    def abandon_heads(self, base_url: str, why: str) -> int:
        """Give up on every request to ``base_url`` still waiting for its response head (a server
        that stopped answering): each raises Abandoned(``why``) and its connection is closed.
        Returns how many there were. NOTE: a head that arrived in this loop turn (its request's
        task not yet resumed) is kept: the server answered that one."""
        found = self._pools.get(base_url)
        waiting = [c for c in found[0].heads if not c._head_done] if found is not None else []
        for conn in waiting:
            conn._fail(Abandoned(why))
        return len(waiting)

    def close(self) -> None:
        for pool, _ in self._pools.values():
            pool.close()
        self._pools.clear()
