"""The two requests every action makes, answered without FastAPI's per-request machinery.

``POST /v1/trajectories/{tid}/actions`` (submit, usually waiting for the end: one round
trip per action) and ``GET /v1/actions/{aid}`` (the long-poll after it) are the server's
per-action work. Through FastAPI each costs routing across every router, dependency
solving for the path, query, token and body, and re-validating the returned model: about
a fifth of the server's CPU per trivial action (`tangram bench serve`, profiled with a
CPU-clock profiler). This layer answers the *well-formed* ones itself - the same
checks (token, id pattern, ``wait`` bounds, the body's model), the same ``Service`` calls,
the same JSON and status codes - and hands every other request to FastAPI untouched,
with its body. So every client error (401, 422 in FastAPI's shape, a route that does not
exist) still comes from one place, and the routes in ``routes/actions.py`` stay the
contract the OpenAPI document describes; this is a faster implementation of two of them,
tested to answer as they do (tests/test_fast_routes.py).

It sits inside ``BodyLimit`` (bodies arrive whole and bounded) and inside Starlette's
error middleware (an unexpected exception is a 500 as on any route).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from executor.server.limits import ASGIApp, Message, Receive, Scope, Send, send_json
from executor.server.schemas import ID_MAX, ID_PATTERN, MAX_TIMEOUT_S, ActionIn, ActionOut
from executor.server.service import Refused, Service
from executor.server.tokens import Tokens

_SUBMIT = re.compile(r"/v1/trajectories/([^/]+)/actions")
_GET = re.compile(r"/v1/actions/([^/]+)")
_ID = re.compile(ID_PATTERN)
#: the ``wait`` values taken here (what the clients send: ``str(float)``); any other
#: spelling goes to FastAPI, which decides what it means
_WAIT = re.compile(rb"wait=([0-9]{1,9}(?:\.[0-9]{1,9})?)")
_JSON = b"application/json"


class FastActions:
    """ASGI middleware: submit and wait for well-formed requests; the rest to ``app``.

    ``token``: the bearer tokens (only ``Bearer <token>`` exactly is taken here; any other
    header, right or wrong, goes to FastAPI's check); the request acts as its token's
    name, the owner FastAPI's routes would see (executor/server/tokens.py).
    ``on_error``: the app's handler for ``Refused`` and ``ValueError`` (the same response
    a route would give)."""

    def __init__(self, app: ASGIApp, token: str | Tokens,
                 on_error: Callable[[Any, Exception], Any]) -> None:
        self.app = app
        tokens = Tokens.single(token) if isinstance(token, str) else token
        # only where these bytes are exactly what FastAPI's reading accepts (it decodes the
        # header as latin-1 and strips the credentials): otherwise the token's requests are
        # FastAPI's
        self.auth = Tokens({b"Bearer " + t: name for t, name in tokens.names.items()
                            if _plain(t)})
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            method = scope["method"]
            if method == "POST":
                m = _SUBMIT.fullmatch(scope["path"])
                if m is not None and await self._submit(scope, receive, send, m.group(1)):
                    return
            elif method == "GET":
                m = _GET.fullmatch(scope["path"])
                if m is not None and await self._get(scope, send, m.group(1)):
                    return
        await self.app(scope, receive, send)

    def _wait(self, scope: Scope) -> float | None:
        """The request's ``wait`` (0 without one), or None to leave it to FastAPI."""
        query = scope.get("query_string", b"")
        if not query:
            return 0.0
        m = _WAIT.fullmatch(query)
        if m is None:
            return None
        wait = float(m.group(1))
        return wait if wait <= MAX_TIMEOUT_S else None

    def _authorised(self, scope: Scope, json_body: bool) -> str | None:
        """The name of the request's token, or None to leave the request to FastAPI."""
        if not self.auth:
            return None
        who: str | None = None
        auth = typed = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                if auth:  # two of them: FastAPI's reading decides
                    return None
                who = self.auth.who(value)  # as check_token: no timing
                auth = who is not None
                if not auth:
                    return None
            elif json_body and name == b"content-type":
                if typed:  # two of them: FastAPI reads the first, which may not be JSON
                    return None
                typed = value == _JSON
                if not typed:
                    return None
        return who if auth and (typed or not json_body) else None

    async def _get(self, scope: Scope, send: Send, aid: str) -> bool:
        wait = self._wait(scope)
        who = self._authorised(scope, json_body=False)
        if wait is None or not _ok_id(aid) or who is None:
            return False
        service: Service = scope["app"].state.service
        try:
            view = await service.wait(aid, wait, who)
        except (Refused, ValueError) as e:
            await self._error(scope, send, e)
            return True
        await _reply(send, 200, view)
        return True

    async def _submit(self, scope: Scope, receive: Receive, send: Send, tid: str) -> bool:
        wait = self._wait(scope)
        who = self._authorised(scope, json_body=True)
        if wait is None or not _ok_id(tid) or who is None:
            return False
        message = await receive()  # BodyLimit hands the body over whole, in one message
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        try:
            # as FastAPI reads a JSON body: json.loads, then the model in Python mode
            action = ActionIn.model_validate(json.loads(body))
        # (json's errors are ValueErrors; too deep a nesting is a RecursionError, FastAPI's 400)
        except (ValueError, ValidationError, RecursionError):
            await self.app(scope, _replay(message, receive), send)  # FastAPI's 422
            return True
        service: Service = scope["app"].state.service
        try:
            view, created = await service.submit(tid, action, who)
            if wait > 0 and view.status in ("queued", "running"):
                view = await service.wait(action.id, wait, who)
        except (Refused, ValueError) as e:
            await self._error(scope, send, e)
            return True
        await _reply(send, 202 if created else 200, view)
        return True

    async def _error(self, scope: Scope, send: Send, e: Exception) -> None:
        response = await self.on_error(None, e)
        await response(scope, _no_body, send)


def _plain(token: bytes) -> bool:
    return token.isascii() and token == token.strip() and token != b""


def _ok_id(value: str) -> bool:
    # fullmatch: the pattern's ``$`` also matches before a final newline in Python's re
    # (not in pydantic's regex engine, FastAPI's check: "a\n" is its 422)
    return len(value) <= ID_MAX and _ID.fullmatch(value) is not None


def _replay(message: Message, receive: Receive) -> Receive:
    """``receive`` that gives ``message`` again first (the body this layer read)."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return message
        return await receive()

    return again


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _reply(send: Send, status: int, view: ActionOut) -> None:
    await send_json(send, status, view.model_dump_json().encode())
