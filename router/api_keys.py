"""Client API keys (``--api-key``): a request must carry ``Authorization: Bearer <key>`` for one of
them, compared in constant time. No keys configured: every request passes."""

from __future__ import annotations

import hmac

from router.errors import RouterError


class APIKeys:
    def __init__(self, keys: list[str]) -> None:
        self._expected = [f"Bearer {k}".encode() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._expected)

    def check(self, authorization: str | None) -> None:
        """RouterError 401 unless keys are off or ``authorization`` names one of them."""
        if not self._expected:
            return
        given = (authorization or "").encode()
        if not any(hmac.compare_digest(given, key) for key in self._expected):
            raise RouterError(
                401, "a valid API key is required (Authorization: Bearer <key>)", "invalid_api_key"
            )
