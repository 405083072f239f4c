"""Every HTTP answer carries ``x-request-id``: the client's own, or one made here. A made one is
also added to the request's headers, so what the router forwards upstream (and its access log)
carries the same id. Pure ASGI, shared by the router and the worker."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

HEADER = b"x-request-id"


class RequestId:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope["headers"]:  # NOTE: a repeated one's last value, as routing reads headers
            if name == HEADER:
                rid = value
        if rid is None or not rid.strip():  # NOTE: an empty one names nothing: made here too
            # NOTE: the header list is copied without the empty one only where there is one
            headers = scope["headers"] if rid is None else [h for h in scope["headers"] if h[0] != HEADER]
            rid = os.urandom(16).hex().encode()  # NOTE: 128 random bits, a quarter of uuid4()'s cost
            scope = {**scope, "headers": [*headers, (HEADER, rid)]}

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
