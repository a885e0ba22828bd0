"""A request-body size limit and read deadline for the ASGI app (uvicorn sets neither).

Bodies are read up to the limit before the app sees them: a larger one gets
413 at once, without being buffered whole, and nothing slow runs on the loop.
A client that stops sending its body for ``READ_TIMEOUT_S`` gets 408 (it would
otherwise hold the request, and its connection, forever).
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

#: seconds a request body may go without a byte arriving
READ_TIMEOUT_S = 30.0


class _Stalled(Exception):
    pass


def deadline(receive: Receive, timeout_s: float) -> Receive:
    """``receive`` that gives up (``_Stalled``) when a body chunk takes ``timeout_s``;
    once the body is complete, waits as long as asked (a streaming response waits
    for the disconnect)."""
    import asyncio

    complete = False

    async def timed() -> Message:
        nonlocal complete
        if complete:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), timeout_s)
        except TimeoutError:
            raise _Stalled from None
        complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed


class BodyLimit:
    """At most ``max_bytes`` per request body, except on paths matching ``large_paths``
    (a regex): passed through unbuffered to a route that bounds what it reads itself."""

    def __init__(self, app: ASGIApp, max_bytes: int, large_paths: str | None = None,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.large_paths = re.compile(large_paths) if large_paths else None
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._limited(scope, deadline(receive, self.read_timeout_s), tracked)
        except _Stalled:
            if not started:
                await self._stalled(send)

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        if body.startswith(b"\xef\xbb\xbf"):
            # JSON senders must not add one (RFC 8259 8.1); accepting it here but not in
            # other parsers of the same body is how two readers come to disagree
            await self._reply(send, 400, "request body: starts with a UTF-8 byte order mark "
                                         "(send JSON without one)")
            return

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: disconnects, for streaming responses

        await self.app(scope, replay, send)

    async def _stalled(self, send: Send) -> None:
        await self._reply(send, 408, f"request body: nothing received for "
                                     f"{self.read_timeout_s:g} s")

    @staticmethod
    async def _reply(send: Send, status: int, detail: str) -> None:
        await send_json(send, status, json.dumps({"detail": detail}).encode(),
                        (b"connection", b"close"))

    async def _too_large(self, send: Send) -> None:
        await self._reply(send, 413, f"request body larger than {self.max_bytes} bytes")


async def send_json(send: Send, status: int, data: bytes,
                    *headers: tuple[bytes, bytes]) -> None:
    """A whole JSON response (``data``), with ``headers`` after its type and length."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *headers]})
    await send({"type": "http.response.body", "body": data})
