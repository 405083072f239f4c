"""The router's upstream HTTP/1.1 client against real servers on loopback: a uvicorn app for the
normal paths and raw asyncio servers for the misbehaving ones (stalls, drops, no length)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.http_client import Abandoned, ConnectFailed, ConnectionBroken, HTTPClient, ResponseTimeout
from tests.support import free_port

pytestmark = pytest.mark.asyncio


async def _echo(request: Request) -> Response:
    body = await request.body()
    return JSONResponse(
        {"len": len(body), "auth": request.headers.get("authorization"), "path": request.url.path}
    )


async def _stream(request: Request) -> Response:
    async def chunks():
        for i in range(5):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.02)

    return StreamingResponse(chunks(), media_type="text/event-stream")


async def _fail(request: Request) -> Response:
    return JSONResponse({"error": "boom"}, status_code=503)


@contextlib.asynccontextmanager
async def uvicorn_server(keep_alive: float = 5.0, cert: str | None = None, key: str | None = None):
    """The test app on 127.0.0.1 (over TLS when ``cert``/``key`` are given); yields (URL, server)."""
    app = Starlette(
        routes=[
            Route("/echo", _echo, methods=["POST"]),
            Route("/base/echo", _echo, methods=["POST"]),
            Route("/stream", _stream, methods=["POST"]),
            Route("/fail", _fail, methods=["POST"]),
        ]
    )
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=keep_alive,
        ssl_certfile=cert, ssl_keyfile=key,
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"{'https' if cert else 'http'}://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def raw_server(handler):
    """A TCP server whose connections run ``handler(reader, writer)``; yields its URL."""
    connections: list[int] = []

    async def on_connect(reader, writer):
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


async def test_post_reads_body_and_reuses_the_connection():
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        bodies = []
        conns = set()
        for n in (0, 10, 100_000):  # 100 KB goes out as a second write
            resp = await client.post(url, "/echo", b"x" * n, {"authorization": "Bearer t"})
            conns.add(id(resp._conn))
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            bodies.append(await resp.read())
            resp.close()
        assert [b'"len":%d' % n in b for n, b in zip((0, 10, 100_000), bodies, strict=True)] == [True] * 3
        assert b'"auth":"Bearer t"' in bodies[0]
        assert len(conns) == 1  # one keep-alive connection served all three
        client.close()


async def test_base_url_path_prefix_is_kept():
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        resp = await client.post(url + "/base/", "/echo", b"{}")
        assert b'"path":"/base/echo"' in await resp.read()
        resp.close()
        client.close()


async def test_streamed_body_arrives_chunk_by_chunk():
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        resp = await client.post(url, "/stream", b"{}")
        assert resp.status == 200
        seen = []
        async for chunk in resp.chunks():
            seen.append(chunk)
        resp.close()
        assert b"".join(seen) == b"".join(f"data: {i}\n\n".encode() for i in range(5))
        assert len(seen) >= 3  # chunked framing removed, chunks not merged into one
        assert resp.at_end
        client.close()


async def test_error_status_is_returned_not_raised():
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        resp = await client.post(url, "/fail", b"{}")
        assert resp.status == 503 and b"boom" in await resp.read()
        resp.close()
        client.close()


async def test_connection_refused_is_connect_failed():
    client = HTTPClient(connect_timeout=1.0)
    with pytest.raises(ConnectFailed):
        await client.post(f"http://127.0.0.1:{free_port()}", "/echo", b"{}")


async def test_read_timeout_when_the_server_never_answers():
    async def stall(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(5)

    async with raw_server(stall) as (url, _):
        client = HTTPClient(read_timeout=0.2)
        with pytest.raises(ResponseTimeout):
            await client.post(url, "/x", b"{}")
        client.close()


async def test_timeout_between_body_chunks():
    async def half(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(5)

    async with raw_server(half) as (url, _):
        client = HTTPClient(read_timeout=0.2)
        resp = await client.post(url, "/x", b"{}")
        with pytest.raises(ResponseTimeout):
            await resp.read()
        resp.close()
        client.close()


async def body_is_broken(handler) -> None:
    """The answer the raw server's ``handler`` gives has its head, and its body reads as ConnectionBroken."""
    async with raw_server(handler) as (url, _):
        client = HTTPClient()
        resp = await client.post(url, "/x", b"{}")
        with pytest.raises(ConnectionBroken):
            await resp.read()
        resp.close()
        client.close()


async def test_connection_dropped_mid_body_is_broken():
    async def drop(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
        await writer.drain()

    await body_is_broken(drop)


async def test_body_until_close_without_length():
    async def no_length(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    async with raw_server(no_length) as (url, conns):
        client = HTTPClient()
        for _ in range(2):
            resp = await client.post(url, "/x", b"{}")
            assert await resp.read() == b"all of it"
            resp.close()
        assert len(conns) == 2  # a connection that closes is never pooled
        client.close()


async def test_garbage_response_is_broken():
    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with raw_server(garbage) as (url, _):
        client = HTTPClient(read_timeout=2)
        with pytest.raises(ConnectionBroken):
            await client.post(url, "/x", b"{}")
        client.close()


async def test_idle_connection_closed_by_server_is_replaced_transparently():
    """The server drops idle keep-alive connections (here after 0.2 s); the next request must
    not fail because of that."""
    async with uvicorn_server(keep_alive=0.2) as (url, _):
        client = HTTPClient(idle_timeout=60)  # keep our side's idle limit out of the way
        resp = await client.post(url, "/echo", b"{}")
        first = resp._conn
        await resp.read()
        resp.close()
        await asyncio.sleep(0.6)  # the server has closed it by now
        assert not client._pools[url][0]._idle  # and it left the pool when it closed
        resp = await client.post(url, "/echo", b"{}")
        assert resp.status == 200 and resp._conn is not first
        await resp.read()
        resp.close()
        client.close()


async def test_stale_connection_that_dies_as_we_write_is_retried_once():
    """The race the idle check cannot see: the pooled connection is still open when taken, and
    the server closes it without reading the request. One fresh connection, no error."""
    served = 0

    async def once_then_drop(reader, writer):
        nonlocal served
        await _read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.read(1), 0.3)  # close as the next request arrives

    async with raw_server(once_then_drop) as (url, conns):
        client = HTTPClient(idle_timeout=60)
        for _ in range(2):
            resp = await client.post(url, "/x", b"{}")
            assert await resp.read() == b"ok"
            resp.close()
        assert served == 2 and len(conns) == 2
        client.close()


async def test_a_request_a_reused_connection_held_before_closing_is_not_sent_again():
    """The server reads the second request on a kept-alive connection, holds it (working on it),
    then closes without an answer: not the idle-close race, so it is not sent once more (it was,
    invisibly: the server ran it twice and the client waited twice as long); the caller is told."""
    requests = 0

    async def answer_then_hold_and_close(reader, writer):
        nonlocal requests
        await _read_request(reader)
        requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await _read_request(reader)
        requests += 1
        await asyncio.sleep(1.0)  # working on it; then it fails without an answer

    async with raw_server(answer_then_hold_and_close) as (url, conns):
        client = HTTPClient(idle_timeout=60)
        resp = await client.post(url, "/x", b"{}")
        assert await resp.read() == b"ok"
        resp.close()
        with pytest.raises(ConnectionBroken):
            await client.post(url, "/x", b"{}")
        assert requests == 2 and len(conns) == 1
        client.close()


async def test_a_connection_the_server_closes_at_once_is_broken_not_written_to():
    """The server accepts each connection and closes it unread. A request finds it closed before its
    write (a write to it raised an uncaught RuntimeError under uvloop, a bare 500 with no retry, and
    waited out the read timeout under asyncio) or closed after: either way ConnectionBroken, at once."""

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def close_at_once() -> None:  # NOTE: a thread of its own: it closes while the client's loop runs on
        while not stop.is_set():
            with contextlib.suppress(OSError):
                listener.accept()[0].close()

    threading.Thread(target=close_at_once, daemon=True).start()
    client = HTTPClient(read_timeout=5.0)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(20):
            started = loop.time()
            with pytest.raises(ConnectionBroken):
                await client.post(f"http://127.0.0.1:{listener.getsockname()[1]}", "/x", b"{}")
            assert loop.time() - started < 2.5  # NOTE: not the read timeout (5 s)
    finally:
        stop.set()
        client.close()
        listener.close()


async def test_an_idle_connection_found_closing_is_replaced_and_its_request_sent_once():
    """A pooled connection whose close has begun but not ended (taken in that window) is not written to:
    the request goes on a new connection, and on_sent runs once, there."""
    calls: list[str] = []
    async with uvicorn_server() as (url, _):
        client = HTTPClient(idle_timeout=60)
        resp = await client.post(url, "/echo", b"{}")
        await resp.read()
        resp.close()
        (idle,) = client._pools[url][0]._idle
        idle._transport.close()  # NOTE: closing: connection_lost has not run yet, so it is not `closed`
        resp = await client.post(url, "/echo", b"{}", on_sent=lambda: calls.append("sent"))
        assert resp.status == 200 and resp._conn is not idle and calls == ["sent"]
        await resp.read()
        resp.close()
        client.close()


async def test_header_injection_is_refused():
    client = HTTPClient()
    with pytest.raises(ValueError):
        await client.post("http://127.0.0.1:1", "/x", b"", {"x-a": "v\r\nx-evil: 1"})
    with pytest.raises(ValueError):
        await client.post("ftp://example", "/x", b"")


async def test_an_ipv6_origin_gets_a_bracketed_host_header():
    heads: list[bytes] = []

    async def on_connect(reader, writer):
        heads.append(await _read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(on_connect, "::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = server.sockets[0].getsockname()[1]
    client = HTTPClient()
    try:
        resp = await client.post(f"http://[::1]:{port}", "/x", b"{}")
        assert resp.status == 200
        resp.close()
    finally:
        client.close()
        server.close()
        await server.wait_closed()
    assert f"\r\nhost: [::1]:{port}\r\n".encode() in heads[0].lower(), heads[0]


async def test_on_sent_runs_once_after_the_write_and_never_without_a_connection():
    calls: list[str] = []
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        resp = await client.post(url, "/echo", b"{}", on_sent=lambda: calls.append("sent"))
        assert calls == ["sent"]  # before the response head was awaited
        await resp.read()
        resp.close()
        client.close()
    dead = HTTPClient(connect_timeout=1.0)
    with pytest.raises(ConnectFailed):
        await dead.post(f"http://127.0.0.1:{free_port()}", "/x", b"{}", on_sent=lambda: calls.append("dead"))
    assert calls == ["sent"]


async def test_on_connect_runs_before_a_new_connection_opens_and_not_on_an_idle_one():
    calls: list[str] = []

    def post(client: HTTPClient, url: str, name: str):
        return client.post(url, "/echo", b"{}", on_sent=lambda: calls.append(f"{name} sent"),
                           on_connect=lambda: calls.append(f"{name} connect"))  # fmt: skip

    async with uvicorn_server() as (url, _):
        client = HTTPClient(idle_timeout=60)
        for name in ("first", "second"):
            resp = await post(client, url, name)
            await resp.read()
            resp.close()
        client.close()
    assert calls == ["first connect", "first sent", "second sent"]  # the second took the idle one
    dead = HTTPClient(connect_timeout=1.0)
    with pytest.raises(ConnectFailed):
        await post(dead, f"http://127.0.0.1:{free_port()}", "dead")
    assert calls[3:] == ["dead connect"]


async def test_on_sent_runs_once_across_the_stale_connection_retry():
    async def once_then_drop(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.read(1), 0.3)

    calls = []
    async with raw_server(once_then_drop) as (url, conns):
        client = HTTPClient(idle_timeout=60)
        for i in range(2):
            resp = await client.post(url, "/x", b"{}", on_sent=lambda i=i: calls.append(i))
            assert await resp.read() == b"ok"
            resp.close()
        assert len(conns) == 2 and calls == [0, 1]
        client.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_https_upstream_verifies_the_certificate(tmp_path, monkeypatch):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True, capture_output=True,
    )  # fmt: skip
    async with uvicorn_server(cert=cert, key=key) as (url, _):
        untrusted = HTTPClient(connect_timeout=2)
        with pytest.raises(ConnectFailed):  # a self-signed certificate nobody trusts is refused
            await untrusted.post(url, "/echo", b"{}")
        monkeypatch.setenv("SSL_CERT_FILE", cert)  # the operator's CA, as OpenSSL reads it
        client = HTTPClient()
        for _ in range(2):
            resp = await client.post(url, "/echo", b"tls")
            assert resp.status == 200 and b'"len":3' in await resp.read()
            resp.close()
        client.close()


async def test_a_forgotten_origin_closes_its_connections_idle_and_in_use():
    """A worker removed from the fleet: its idle connection is closed at once, one in use when its
    exchange ends, and nothing of it stays in the client; a later request opens a new pool."""
    async with uvicorn_server() as (url, _):
        client = HTTPClient()
        idle = await client.post(url, "/echo", b"{}")
        await idle.read()
        idle.close()  # back to the pool
        idle_conn = idle._conn
        busy = await client.post(url, "/stream", b"{}")  # takes the idle connection
        assert busy._conn is idle_conn
        second = await client.post(url, "/echo", b"{}")  # a second connection, now idle after reading
        await second.read()
        second.close()
        client.forget(url)
        assert second._conn.closed and not client._pools
        async for _ in busy.chunks():
            pass
        busy.close()
        assert busy._conn.closed  # not kept: its pool was forgotten
        again = await client.post(url, "/echo", b"{}")
        assert again.status == 200 and again._conn is not busy._conn
        await again.read()
        again.close()
        client.close()


async def test_origins_past_the_bound_forget_the_oldest_and_https_ones_share_one_tls_context():
    """A worker fetching KV from sources its clients name meets any number of origins: the client
    keeps at most max_pools (the oldest forgotten first, a request to it opens a new pool), and its
    https pools share one context (each context holds the CA store)."""
    async with uvicorn_server() as (url, _):
        client = HTTPClient(connect_timeout=2)
        client.max_pools = 3
        kept = await client.post(url, "/echo", b"{}")
        await kept.read()
        kept.close()
        for port in (1, 2, 3):  # never connected to: only their pools are made
            client._pool(f"https://127.0.0.1:{port}")
        assert list(client._pools) == [f"https://127.0.0.1:{p}" for p in (1, 2, 3)]
        assert kept._conn.closed  # the oldest origin's idle connection went with its pool
        contexts = {id(pool.ssl) for pool, _ in client._pools.values()}
        assert len(contexts) == 1 and None not in {pool.ssl for pool, _ in client._pools.values()}
        again = await client.post(url, "/echo", b"{}")
        assert again.status == 200 and len(client._pools) == 3 and url in client._pools
        await again.read()
        again.close()
        client.close()


async def test_a_reset_before_a_body_without_length_ended_is_broken_not_the_whole_body():
    """No length and not chunked: the body ends at a clean close; a reset in the middle of it is a
    broken response, not half a body passed on as whole."""
    import socket
    import struct

    async def reset(reader, writer):
        await _read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"half": ')
        await writer.drain()
        await asyncio.sleep(0.1)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.transport.abort()

    await body_is_broken(reset)


async def test_connections_idle_past_the_idle_timeout_are_closed_as_others_come_back():
    """After a burst, the connections it opened are not kept for good: once idle past idle_timeout
    they are closed as the traffic that goes on returns its own."""
    async with uvicorn_server() as (url, _):
        client = HTTPClient(idle_timeout=0.3)
        burst = await asyncio.gather(*(client.post(url, "/stream", b"{}") for _ in range(4)))
        for resp in burst:
            await resp.read()
            resp.close()
        pool, _ = client._pool(url)
        assert len(pool._idle) == 4
        for _ in range(12):  # steady traffic, one request at a time: it keeps one connection busy
            resp = await client.post(url, "/echo", b"{}")
            await resp.read()
            resp.close()
            await asyncio.sleep(0.05)
        assert len(pool._idle) == 1 and all(not c.closed for c in pool._idle)
        client.close()


async def test_out_of_file_descriptors_is_the_clients_own_failure_not_a_connect_failure(tmp_path):
    """A process out of file descriptors cannot open a connection: OutOfResources (the router's own
    limit: no worker's fault), not ConnectFailed."""
    script = tmp_path / "emfile.py"
    script.write_text(
        "import asyncio, resource, socket\n"
        "from router.http_client import HTTPClient, OutOfResources\n"
        "server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen()\n"
        "url = f'http://127.0.0.1:{server.getsockname()[1]}'\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "held = []\n"
        "async def main():\n"
        "    client = HTTPClient()\n"
        "    try:\n"
        "        while True:\n"
        "            held.append(open('/dev/null'))\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        "        await client.post(url, '/x', b'{}')\n"
        "    except OutOfResources as exc:\n"
        "        print('out of resources', exc)\n"
        "asyncio.run(main())\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    done = await asyncio.to_thread(subprocess.run, [sys.executable, str(script)], capture_output=True, text=True,
                                   timeout=60, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert done.stdout.startswith("out of resources"), done.stdout + done.stderr


async def test_abandoning_heads_gives_up_on_silent_requests_and_keeps_a_head_already_arrived():
    """abandon_heads fails the requests still without a response head (their connections closed,
    never pooled again), but a request whose head arrived in the same loop turn (its task not yet
    resumed) keeps its answer: the server did answer it."""
    answered = asyncio.Event()

    async def silent(reader, writer):
        await _read_request(reader)
        await answered.wait()

    async with raw_server(silent) as (url, _):
        client = HTTPClient(read_timeout=30, total_timeout=30)
        try:
            waiting = [asyncio.create_task(client.post(url, "/x", b"{}")) for _ in range(2)]
            pool = client._pool(url)[0]
            while len(pool.heads) < 2:
                await asyncio.sleep(0.01)
            done, hung = list(pool.heads)
            # the answer's bytes arrive, and the health check gives up, in the same loop turn
            done.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            assert client.abandon_heads(url, "no answer") == 1
            results = await asyncio.gather(*waiting, return_exceptions=True)
            (resp,) = [r for r in results if not isinstance(r, Exception)]
            (error,) = [r for r in results if isinstance(r, Exception)]
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.close()
            assert isinstance(error, Abandoned) and hung.closed
            assert not pool.heads
        finally:
            answered.set()
            client.close()


@pytest.mark.parametrize(
    "interim", [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"]
)
@pytest.mark.parametrize("apart", [False, True])
async def test_an_interim_response_is_skipped_for_the_answer_after_it(interim, apart):
    """A 1xx before the answer (RFC 9110 15.2), in the same read or in one of its own: taken for the answer, it
    reached clients as a 100 of no body (which they wait past for good) or an empty 103, and the answer was lost."""

    async def hints_first(reader, writer):
        await _read_request(reader)
        writer.write(interim)
        if apart:
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nanswer!")
        await writer.drain()
        await asyncio.sleep(1)

    async with raw_server(hints_first) as (url, _):
        client = HTTPClient(read_timeout=5)
        resp = await client.post(url, "/x", b"{}")
        assert resp.status == 200 and "link" not in resp.headers
        assert await resp.read() == b"answer!"
        resp.close()
        client.close()


async def test_a_chunked_body_is_chunked_however_its_coding_is_spelt():
    """ "Chunked" was read as no length (a body ending at close): a body cut before its last chunk then ended
    cleanly, and every such connection was closed instead of pooled."""
    answers = 0

    async def capital(reader, writer):
        nonlocal answers
        while True:
            await _read_request(reader)
            answers += 1
            if answers == 2:  # the second answer is cut before its last chunk
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n3\r\nabc\r\n")
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
            await writer.drain()

    async with raw_server(capital) as (url, conns):
        client = HTTPClient(read_timeout=5)
        resp = await client.post(url, "/x", b"{}")
        assert await resp.read() == b"abc"
        resp.close()
        resp = await client.post(url, "/x", b"{}")
        with pytest.raises(ConnectionBroken):
            await resp.read()
        resp.close()
        assert len(conns) == 1  # the first answer's connection was pooled and carried the second request
        client.close()


@pytest.mark.parametrize("later", [False, True])
async def test_a_response_after_the_answer_is_neither_its_body_nor_the_next_requests_answer(later):
    """A server that sends a second response (in the answer's read, or later on the idle connection): its
    body was joined to the answer's, or handed to the next request on the connection as its answer."""

    stray_sent = asyncio.Event()

    async def two_answers(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nmine")
        if later:
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")
        await writer.drain()
        stray_sent.set()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond")
            await writer.drain()
        await asyncio.sleep(1)

    async with raw_server(two_answers) as (url, conns):
        client = HTTPClient(read_timeout=5)
        resp = await client.post(url, "/x", b"{}")
        assert await resp.read() == b"mine", later
        resp.close()
        await stray_sent.wait()  # NOTE: sent after the next request, it could only be taken for its answer
        await asyncio.sleep(0.2)
        resp = await client.post(url, "/x", b"{}")
        assert await resp.read() != b"stray", later  # a new connection's answer, not the stray one
        resp.close()
        assert len(conns) == 2, later  # the connection that sent it was not reused
        client.close()
