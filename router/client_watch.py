"""Watching for a client that leaves: one task per request reads ASGI ``receive`` after the body
and cancels the request's task on ``http.disconnect``, so upstream work and load are released."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class ClientWatch:
    """Cancels the request's task when its client disconnects: one watcher task per request,
    started once the body is read (from then on the only message ``receive`` yields is the
    disconnect). ``stop()`` before the last ``send``: the server then reports a disconnect too."""

    __slots__ = ("_task", "_watcher", "gone")

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self._task = asyncio.current_task()
        self.gone = False
        self._watcher = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive: Callable[[], Awaitable[dict]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        self._watcher.cancel()
