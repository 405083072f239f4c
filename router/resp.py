"""A small Redis client for replica sync's two hot paths: PUBLISH without waiting for each reply,
and one SUBSCRIBE stream delivered straight from the socket callback.

Why not redis-py here: with messages one at a time, as replica sync sends them (a few per request),
its asyncio client spent 200-310 us of CPU per PUBLISH and 110-160 us per message received on this
machine (connection pool, a reply awaited per command, a task switch each way); this client 33-96
and 55-87 us (`python -m loadtest.bench_replica_sync`, three alternating runs each). Everything else that
talks to Redis (KV event streams) keeps redis-py. TCP URLs only: ``redis://`` with an optional user
and password (parsed by redis-py), and ``rediss://`` (TLS with the system's CA store; not exercised
by the tests). The database number does not matter to pub/sub.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from redis.connection import SSLConnection, parse_url

from router.http_client import without_credentials

INCOMPLETE = object()  # parse(): the buffer ends inside a value


class RespError(Exception):
    """An error reply from Redis (``-ERR ...``)."""


def command(*parts: bytes | str) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def parse(buf: bytes | bytearray, pos: int = 0) -> tuple[Any, int]:
    """One RESP2 value from ``buf[pos:]`` and the position after it, or (INCOMPLETE, pos).
    Error replies come back as RespError instances (not raised)."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return INCOMPLETE, pos
    kind, line = buf[pos], bytes(buf[pos + 1 : end])
    if kind == 0x2B:  # +simple string
        return line.decode(), end + 2
    if kind == 0x2D:  # -error
        return RespError(line.decode(errors="replace")), end + 2
    if kind == 0x3A:  # :integer
        return int(line), end + 2
    if kind == 0x24:  # $bulk string
        n = int(line)
        if n < 0:
            return None, end + 2
        if len(buf) < end + 4 + n:
            return INCOMPLETE, pos
        return bytes(buf[end + 2 : end + 2 + n]), end + 4 + n
    if kind == 0x2A:  # *array
        n, items, at = int(line), [], end + 2
        for _ in range(max(n, 0)):
            item, at = parse(buf, at)
            if item is INCOMPLETE:
                return INCOMPLETE, pos
            items.append(item)
        return (items if n >= 0 else None), at
    raise ValueError(f"not RESP: {bytes(buf[pos : pos + 16])!r}")


def redis_url_error(url: str) -> str | None:
    """Why redis-py cannot read ``url`` (as the KV event reader and publisher connect with it), with no
    credentials in it; None when it can."""
    try:
        parse_url(url)
    except ValueError as exc:
        return f"{without_credentials(url)!r}: {exc}"
    return None


def tcp_url_options(url: str) -> dict[str, Any]:
    """redis-py's reading of a Redis URL; ValueError unless it names a TCP server."""
    opts = parse_url(url)
    if "path" in opts:
        raise ValueError(
            f"a TCP Redis URL is needed (redis:// or rediss://), not {without_credentials(url)!r}"
        )
    return opts


class _Protocol(asyncio.Protocol):
    """Parses replies as they arrive and hands each to ``on_value``."""

    def __init__(self, on_value: Callable[[Any], None]) -> None:
        self.on_value = on_value
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        pos = 0
        while pos < len(self._buf):
            value, pos_after = parse(self._buf, pos)
            if value is INCOMPLETE:
                break
            pos = pos_after
            self.on_value(value)
        del self._buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


class RespConnection:
    """One connection: ``send`` writes a command without waiting; replies go to ``on_value``
    (after the handshake). ``closed`` resolves when the connection goes away."""

    def __init__(self, protocol: _Protocol) -> None:
        self._protocol = protocol

    @classmethod
    async def open(cls, url: str, on_value: Callable[[Any], None], timeout_s: float = 2.0) -> RespConnection:
        opts = tcp_url_options(url)
        tls = ssl.create_default_context() if opts.get("connection_class") is SSLConnection else None
        loop = asyncio.get_running_loop()
        handshake: asyncio.Queue[Any] = asyncio.Queue()
        protocol = _Protocol(handshake.put_nowait)
        await asyncio.wait_for(
            loop.create_connection(
                lambda: protocol, opts.get("host", "localhost"), opts.get("port", 6379), ssl=tls
            ),
            timeout_s,
        )
        conn = cls(protocol)
        if opts.get("password"):
            user = [opts["username"]] if opts.get("username") else []
            conn.send(command("AUTH", *user, opts["password"]))
            reply = await asyncio.wait_for(handshake.get(), timeout_s)
            if isinstance(reply, RespError):
                conn.close()
                raise reply
        protocol.on_value = on_value
        return conn

    @property
    def closed(self) -> asyncio.Future:
        return self._protocol.closed

    @property
    def is_closed(self) -> bool:
        t = self._protocol.transport
        return self._protocol.closed.done() or t is None or t.is_closing()

    def send(self, data: bytes) -> None:
        assert self._protocol.transport is not None
        self._protocol.transport.write(data)

    @property
    def unsent(self) -> int:
        """Bytes written but not yet taken by the socket (they grow while Redis does not read)."""
        t = self._protocol.transport
        return 0 if t is None else t.get_write_buffer_size()

    def close(self) -> None:
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is unsent (``close`` waits for a peer that may never read it)."""
        if self._protocol.transport is not None:
            self._protocol.transport.abort()
