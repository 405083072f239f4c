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

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": code}}
    )


def error_response(status: int, message: str, code: str | None = None) -> Response:
    return Response(error_body(status, message, code), status_code=status, media_type="application/json")
