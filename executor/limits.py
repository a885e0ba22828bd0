"""A request-body size limit for the ASGI app (uvicorn sets none).

Bodies are read up to the limit before the app sees them: a larger one gets
413 at once, without being buffered whole, and nothing slow runs on the loop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimit:
    """At most ``max_bytes`` per request body, except on paths matching ``large_paths``
    (a regex): passed through unbuffered to a route that bounds what it reads itself."""

    def __init__(self, app: ASGIApp, max_bytes: int, large_paths: str | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.large_paths = re.compile(large_paths) if large_paths else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if self.large_paths is not None and self.large_paths.match(scope.get("path", "")):
            await self.app(scope, receive, send)  # the file API bounds what it reads itself
            return
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._too_large(send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: disconnects, for streaming responses

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        data = json.dumps({"detail": f"request body larger than {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": data})
