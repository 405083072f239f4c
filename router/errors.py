"""OpenAI-shaped error responses: {"error": {"message", "type", "code"}} with honest status codes.

Every error the router returns goes through here, so clients see one shape."""

from __future__ import annotations

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


# s: the Retry-After of a 429 for a full queue (the router's or every worker's): queues drain in about a
# request's time, so a client that waits a second finds room or the same answer, not a storm of retries
QUEUE_FULL_RETRY_AFTER_S = 1


class RouterError(Exception):
    """Raised anywhere below the app; the app turns it into an OpenAI error response."""

    def __init__(
        self, status: int, message: str, code: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after  # s: sent as Retry-After (a rate limit, a full queue)


def error_payload(status: int, message: str, code: str | None = None) -> dict:
    """{"error": {"message", "type", "code"}}: the body of an error response, or a stream's error event
    (a client error the table does not name is an invalid request, not the server's)."""
    kind = _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": code}}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return orjson.dumps(error_payload(status, message, code))


def stream_error_event(
    responses: bool, status: int, message: str, code: str, sequence_number: int | None,
    response: dict | None = None,
) -> bytes:  # fmt: skip
    """The event that ends a stream the router cannot finish (its worker broke off: 502, or the
    request ran out of time: 504): chat and completions streams get the error object the same
    failure gets without a stream (``status`` picks its type) and ``[DONE]``, as a radixgate worker
    ends a stream whose request failed; a Responses stream gets ``response.failed`` (``response``, the
    object its ``response.created`` event carried, failed with OpenAI's ``server_error``, ``code`` its
    type), as a worker ends one whose generation failed, or its ``error`` event where the stream broke
    before that; numbered after the last event passed on."""
    if responses:
        seq = 0 if sequence_number is None else sequence_number + 1
        if response is not None:
            error = {"code": "server_error", "message": message, "type": code, "param": None}
            failed = {**response, "status": "failed", "error": error}
            event = {"type": "response.failed", "sequence_number": seq, "response": failed}
            return b"event: response.failed\ndata: " + orjson.dumps(event) + b"\n\n"
        event = {"type": "error", "sequence_number": seq, "code": code, "message": message, "param": None}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"


def error_response(
    status: int, message: str, code: str | None = None, retry_after: int | None = None
) -> Response:
    headers = {k.decode(): v.decode() for k, v in _headers(status, retry_after)}
    return Response(error_body(status, message, code), status, headers, "application/json")


def router_error_response(exc: RouterError) -> Response:
    """``exc`` as a response, with its headers (``error_headers``)."""
    return error_response(exc.status, exc.message, exc.code, exc.retry_after)


def error_headers(exc: RouterError) -> list[tuple[bytes, bytes]]:
    """``Retry-After`` for an error that says when to come back; ``connection: close`` for a body that
    did not arrive in time or was too large (its rest is not read: the connection is not kept for it)."""
    return _headers(exc.status, exc.retry_after)


def _headers(status: int, retry_after: int | None) -> list[tuple[bytes, bytes]]:
    out = [] if retry_after is None else [(b"retry-after", str(retry_after).encode())]
    # NOTE: 408 and 413 answer a body not read (whole): the connection is not kept for its rest (a client
    # that held the body back after `Expect: 100-continue` would have its next request read as that body)
    return [*out, (b"connection", b"close")] if status in (408, 413) else out


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such endpoint, a method the endpoint does not take) in the same
    shape, so a client's error handling never meets a plain-text body."""
    assert isinstance(exc, HTTPException)
    what = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message, code = f"no such endpoint: {what}", "unknown_endpoint"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message, code = f"{what}: method not allowed (allowed: {allowed})", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    response = error_response(exc.status_code, message, code)
    response.headers.update(exc.headers or {})
    return response


HTTP_ERROR_HANDLERS = {HTTPException: http_error}
