"""Upstream calls to workers over pooled keep-alive connections: non-stream and SSE pass-through.

Retries (connect error, timeout, 5xx, or a full queue's 429 before the first byte) go to the next
best worker, bounded by the caller. Once a byte has reached the client a request is never retried. Every path releases
the worker's in-flight count exactly once and reads usage (cached tokens) from the response."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from router.errors import RouterError
from router.http_client import (
    Abandoned,
    ConnectionBroken,
    HTTPClient,
    HTTPClientError,
    OutOfResources,
    Response,
    ResponseTimeout,
)
from router.workers import Worker

# Headers of the client request worth passing on; hop-by-hop and length headers are recomputed.
FORWARDED_HEADERS = ("authorization", "x-request-id", "openai-organization", "openai-project")


HOPS_HEADER = "x-radixgate-hops"  # routers a request has passed through
MAX_HOPS = 8


def forwarded_headers(client: Mapping[str, str]) -> dict[str, str]:
    """The headers a request to a worker carries: JSON, and the client's own worth passing on
    (its Authorization is replaced by the worker key where the router has one: ``Upstream``), and the
    routers it has passed through, this one included: a request that has passed ``MAX_HOPS`` is in
    a loop (a router among its own workers, two among each other's: each request forwarded itself
    until something ran out) and is refused, 508."""
    hops = client.get(HOPS_HEADER, "0")
    passed = int(hops) if hops.isascii() and hops.isdigit() and len(hops) < 4 else 0
    if passed >= MAX_HOPS:
        raise RouterError(508, f"the request has passed {passed} routers: they route in a loop (a router "
                          "listed among its own workers?)", "loop_detected")  # fmt: skip
    headers = {"content-type": "application/json", HOPS_HEADER: str(passed + 1)}
    for name in FORWARDED_HEADERS:
        value = client.get(name)
        if value is not None:
            headers[name] = value
    return headers


class UpstreamFailure(Exception):
    """The worker failed before sending a usable response: retry elsewhere if allowed."""

    def __init__(self, kind: str, message: str, status: int = 502, body: bytes | None = None) -> None:
        super().__init__(message)
        # connect | timeout | http_5xx | overloaded (429: alive, but its queue is full) | stream_broken (a
        # whole answer's body cut off after its head) | request_timeout (the request's own total time,
        # request_timeout_s, ran out: no fault of the worker's)
        self.kind = kind
        self.status = status
        self.body = body


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0


def parse_usage(obj: object) -> Usage | None:
    """usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens of a response or chunk;
    for the Responses API, input_tokens and input_tokens_details of a response object or of the
    ``response`` a stream event carries."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    return Usage(
        prompt_tokens=prompt if isinstance(prompt, int) else 0,
        cached_tokens=cached if isinstance(cached, int) else 0,
    )


_USAGE_VALUE = re.compile(rb"\s*:\s*\{")
_WHOLE_PARSE_MAX = 1 << 16  # bytes: a larger answer or event has its usage object read alone


def body_usage(payload: bytes) -> Usage | None:
    """``parse_usage`` of one JSON answer or event, parsing only its last ``"usage"`` object where the
    answer is large (logprobs, many choices): a whole parse of megabytes would hold the event loop."""
    if len(payload) <= _WHOLE_PARSE_MAX:
        try:
            return parse_usage(orjson.loads(payload))
        except orjson.JSONDecodeError:
            return None
    end = len(payload)
    while (at := payload.rfind(b'"usage"', 0, end)) >= 0:
        if (m := _USAGE_VALUE.match(payload, at + 7)) is not None:
            break
        end = at  # NOTE: a value "usage", not the key
    else:
        return None
    start = depth = 0
    quoted = escaped = False
    for i in range(m.end() - 1, min(len(payload), m.end() + _WHOLE_PARSE_MAX)):
        c = payload[i]
        if quoted:
            escaped, quoted = (False, True) if escaped else (c == 0x5C, c != 0x22)
        elif c == 0x22:
            quoted = True
        elif c == 0x7B:
            start, depth = (i if depth == 0 else start), depth + 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                try:
                    return parse_usage({"usage": orjson.loads(payload[start : i + 1])})
                except orjson.JSONDecodeError:
                    return None
    return None


class SSEUsageScanner:
    """Finds the usage object in an SSE byte stream without holding more than one partial line.

    ``feed`` returns what to pass on to the client. By default that is the chunk itself, as it
    came. With ``strip`` (the router asked for a usage chunk the client did not) it is the complete
    lines so far without the usage-only event (``choices: []``); a partial line waits for its end."""

    def __init__(self, strip: bool = False) -> None:
        self.strip = strip
        self._partial: list[bytes] = []  # a line's start, in the pieces it came in (joined once, at its end)
        self._drop_blank = False  # the dropped event's terminating blank line is still to come
        self.usage: Usage | None = None
        self.error: str | None = None  # the code of an error event the stream ended with (stream_error_code)

    def feed(self, chunk: bytes) -> bytes:
        end = chunk.rfind(b"\n")
        if end < 0:
            self._partial.append(chunk)
            return b"" if self.strip else chunk
        data = b"".join((*self._partial, chunk)) if self._partial else chunk
        end += len(data) - len(chunk)
        self._partial = [data[end + 1 :]] if end + 1 < len(data) else []
        complete = data[: end + 1]
        if b'"usage"' not in complete and b'"error"' not in complete and not self._drop_blank:
            return complete if self.strip else chunk
        kept = []
        for line in complete[:-1].split(b"\n"):
            if self._drop_blank and line in (b"", b"\r"):
                self._drop_blank = False
                continue
            if (
                line.startswith(b"data:")
                and b'"error"' in line
                and (code := stream_error_code(line)) is not None
            ):
                self.error = code
            if line.startswith(b"data:") and b'"usage"' in line:
                obj = None
                if (
                    len(line) <= _WHOLE_PARSE_MAX
                ):  # NOTE: a usage chunk is small; a large event is read in part
                    with contextlib.suppress(orjson.JSONDecodeError):
                        obj = orjson.loads(line[5:])
                found = parse_usage(obj) if obj is not None else body_usage(line[5:])
                if found is not None:
                    self.usage = found
                    if self.strip and isinstance(obj, dict) and obj.get("choices") == []:
                        self._drop_blank = True
                        continue
            kept.append(line)
        if not self.strip:
            return chunk
        return b"\n".join(kept) + b"\n" if kept else b""

    def flush(self) -> bytes:
        """The end of the stream: a held partial line (``strip`` only)."""
        rest, self._partial = b"".join(self._partial), []
        return rest if self.strip else b""


def stream_error_code(line: bytes) -> str | None:
    """The code of the error a stream's ``data:`` line ends it with: a chat or completions error
    chunk's (``{"error": {..., "code"}}``), a Responses ``error`` event's, or a ``response.failed``
    event's (ours is its error's ``type``: its ``code`` is one of OpenAI's); None for any other line.
    NOTE: every Responses event carrying its response has ``"error": null``: one over _WHOLE_PARSE_MAX
    is parsed only if it is a ``response.failed`` (an error chunk is small)"""
    if len(line) > _WHOLE_PARSE_MAX and b'"response.failed"' not in line[:64]:
        return None
    try:
        event = orjson.loads(line[5:])
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    if event.get("type") == "error":
        code = event.get("code")
    elif event.get("type") == "response.failed":
        error = event["response"].get("error") if isinstance(event.get("response"), dict) else None
        code = (error.get("type") or error.get("code")) if isinstance(error, dict) else "response_failed"
    elif isinstance(error := event.get("error"), dict):
        code = error.get("code") or error.get("type")
    else:
        return None
    return code if isinstance(code, str) else "error"


def _timeout(exc: ResponseTimeout, message: str) -> UpstreamFailure:
    if exc.total:
        return UpstreamFailure(
            "request_timeout", "the request ran past its total timeout (request_timeout_s)", 504
        )
    return UpstreamFailure("timeout", message, 504)


class Upstream:
    """Upstream clients to all workers: the pooled hot-path client for completions
    (router/http_client.py) and an aiohttp session for health checks and event streams."""

    def __init__(
        self, connect_timeout_s: float, first_byte_timeout_s: float, request_timeout_s: float,
        worker_api_key: str | None = None,
    ) -> None:  # fmt: skip
        self._connect_timeout = connect_timeout_s
        self.client = HTTPClient(connect_timeout_s, first_byte_timeout_s, request_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        # NOTE: replaces the client's own Authorization on every request to a worker (open, session)
        self.authorization = f"Bearer {worker_api_key}" if worker_api_key else None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, keepalive_timeout=30)
        headers = {"Authorization": self.authorization} if self.authorization else None
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",), headers=headers
        )

    async def close(self) -> None:
        self.client.close()
        if self.session is not None:
            await self.session.close()

    async def open(
        self,
        worker: Worker,
        path: str,
        body: bytes,
        headers: dict[str, str],
        on_sent: Callable[[], None] | None = None,
        head_timeout: float | None = None,
        on_connect: Callable[[], None] | None = None,
    ) -> Response:
        """Send the request and wait for the response head (``head_timeout``: HTTPClient.post). Raises UpstreamFailure on a worker
        fault or a 429 (the response is closed); returns the open response on any other status < 500.
        ``on_sent`` runs once the request is on a connection (never if none could be opened);
        ``on_connect`` before a new connection is opened for it (HTTPClient.post).
        With a worker key, it is the request's Authorization (never the client's)."""
        if self.authorization is not None:
            headers = {**headers, "authorization": self.authorization}
        try:
            resp = await self.client.post(worker.url, path, body, headers, on_sent, head_timeout, on_connect)
        except ResponseTimeout as exc:
            raise _timeout(exc, f"worker {worker.url} did not answer in time") from None
        except OutOfResources as exc:  # NOTE: the router's own limit: not the worker's fault, no retry
            raise RouterError(503, f"the router cannot open a connection now ({exc})", "router_out_of_resources",
                              retry_after=1) from None  # fmt: skip
        except Abandoned as exc:  # NOTE: its health checks stopped answering (HealthChecker)
            raise UpstreamFailure(
                "unresponsive", f"worker {worker.url} stopped answering: {exc}", 504
            ) from None
        except ConnectionBroken as exc:  # NOTE: it was reached: it closed (died?) or garbled before its head
            raise UpstreamFailure(
                "closed", f"worker {worker.url} broke off before answering: {exc}", 502
            ) from None
        except HTTPClientError as exc:
            raise UpstreamFailure("connect", f"worker {worker.url} unreachable: {exc}", 502) from None
        if resp.status >= 500 or resp.status == 429:
            try:
                payload = await asyncio.wait_for(resp.read(), timeout=self._connect_timeout)
            except (asyncio.TimeoutError, HTTPClientError):
                payload = None
            finally:  # NOTE: a client gone mid-read cancels this: the connection must not stay open
                resp.close()
            kind = "overloaded" if resp.status == 429 else "http_5xx"
            raise UpstreamFailure(kind, f"worker {worker.url} answered {resp.status}", resp.status, payload)
        return resp

    async def read_all(self, resp: Response) -> bytes:
        """The whole body; the caller closes ``resp``."""
        try:
            return await resp.read()
        except ResponseTimeout as exc:
            raise _timeout(exc, "worker stopped sending before the response ended") from None
        except HTTPClientError as exc:  # NOTE: after the head: the body broke off
            raise UpstreamFailure("stream_broken", f"worker connection lost: {exc}", 502) from None
