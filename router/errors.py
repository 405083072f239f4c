"""OpenAI-shaped error responses: {"error": {"message", "type", "code"}} with honest status codes.

Every error the router returns goes through here, so clients see one shape."""

from __future__ import annotations

import orjson
from starlette.responses import Response

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


class RouterError(Exception):
    """Raised anywhere below the app; the app turns it into an OpenAI error response."""

    def __init__(
        self, status: int, message: str, code: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after  # s: sent as Retry-After (a rate limit)


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": code}}
    )


def error_response(status: int, message: str, code: str | None = None) -> Response:
    return Response(error_body(status, message, code), status_code=status, media_type="application/json")


def retry_headers(exc: RouterError) -> list[tuple[bytes, bytes]]:
    """``Retry-After`` for an error that says when to come back, else nothing."""
    return [] if exc.retry_after is None else [(b"retry-after", str(exc.retry_after).encode())]
