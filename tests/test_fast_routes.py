"""The per-action requests' own path (executor/server/routes/fast.py) answers as FastAPI's routes do.

Against a real server, every request is sent twice: with ``Bearer`` (taken by the fast
path when well-formed) and with ``bearer`` (a scheme HTTP reads case-insensitively, which
the fast path leaves to FastAPI): the answers must match. Which path took which request
is checked on the middleware itself, with a service of our own standing in for the
executor's."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from conftest import TOKEN

from executor.server.app import _error
from executor.server.routes.fast import FastActions
from executor.server.schemas import ActionOut
from executor.server.service import Refused

#: what differs between two runs of the same command (timings, where it ran)
VOLATILE = {"queue_s", "exec_s", "cores", "units", "lane"}


def _same(fast: httpx.Response, slow: httpx.Response) -> None:
    assert fast.status_code == slow.status_code, (fast.text, slow.text)
    assert fast.headers["content-type"] == slow.headers["content-type"]
    # each path's ids carry its suffix (-F, -S): the same answer reads the same without it
    a, b = (json.loads(r.text.replace("-F", "").replace("-S", "")) for r in (fast, slow))
    if isinstance(a, dict) and "status" in a:
        a = {k: v for k, v in a.items() if k not in VOLATILE}
        b = {k: v for k, v in b.items() if k not in VOLATILE}
    assert a == b


def test_both_paths_answer_alike(process_server):
    fast = httpx.Client(base_url=process_server.url, timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    slow = httpx.Client(base_url=process_server.url, timeout=60,
                        headers={"Authorization": f"bearer {TOKEN}"})
    for c, tid in ((fast, "fr-F"), (slow, "fr-S")):
        assert c.post("/v1/trajectories", json={"id": tid, "task": "t"}).status_code == 201

    def both(method: str, path: str, **kw) -> tuple[httpx.Response, httpx.Response]:
        """The same request on each path (each in its own trajectory / with its own id)."""
        out = []
        for c, tid, suffix in ((fast, "fr-F", "-F"), (slow, "fr-S", "-S")):
            p = path.format(tid=tid, s=suffix)
            body = kw.get("json")
            if isinstance(body, dict) and "id" in body:
                body = {**body, "id": body["id"] + suffix}
            out.append(c.request(method, p, **{**kw, "json": body} if "json" in kw else kw))
        return out[0], out[1]

    ran = both("POST", "/v1/trajectories/{tid}/actions", params={"wait": 30},
               json={"id": "a1", "argv": ["sh", "-c", "echo hi; exit 3"]})
    _same(*ran)
    assert ran[0].status_code == 202 and ran[0].json()["output"] == "hi\n"
    assert ran[0].json()["exit_code"] == 3
    # the same id and body again: 200 with the stored result; another body: 409
    _same(*both("POST", "/v1/trajectories/{tid}/actions",
                json={"id": "a1", "argv": ["sh", "-c", "echo hi; exit 3"]}))
    _same(*both("POST", "/v1/trajectories/{tid}/actions", json={"id": "a1", "argv": ["true"]}))
    # no wait: 202 while queued or running, then the long-poll
    queued = both("POST", "/v1/trajectories/{tid}/actions",
                  json={"id": "a2", "argv": ["sleep", "0.5"]})
    assert all(r.status_code == 202 for r in queued)
    _same(*both("GET", "/v1/actions/a2{s}", params={"wait": 30.5}))
    _same(*both("GET", "/v1/actions/a2{s}"))
    _same(*both("GET", "/v1/actions/nope{s}"))
    _same(*both("POST", "/v1/trajectories/nope/actions", json={"id": "a3", "argv": ["true"]}))
    # the service refuses (422 in FastAPI's shape, from the app's own handler)
    _same(*both("POST", "/v1/trajectories/{tid}/actions",
                json={"id": "a4", "command": "'unclosed"}))
    # the model refuses: FastAPI's 422 either way (the fast path hands it over)
    _same(*both("POST", "/v1/trajectories/{tid}/actions", json={"id": "a5", "argv": []}))
    _same(*both("POST", "/v1/trajectories/{tid}/actions", content=b"{not json",
                headers={"content-type": "application/json"}))
    _same(*both("POST", "/v1/trajectories/{tid}/actions", params={"wait": -1},
                json={"id": "a6", "argv": ["true"]}))
    bad = httpx.post(process_server.url + "/v1/trajectories/fr-F/actions",
                     headers={"Authorization": "Bearer wrong"}, json={"id": "a7-F", "argv": ["true"]})
    assert bad.status_code == 401
    assert fast.get("/v1/actions/a7-F").status_code == 404  # the refused one never ran


class _Service:
    """Stands in for executor.server.service.Service: records what the fast path asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def submit(self, tid, body, owner):
        assert owner == "default"  # the one token's name (executor/server/tokens.py)
        self.calls.append(("submit", tid, body.id))
        if tid == "missing":
            raise Refused(404, f"unknown trajectory {tid!r}")
        return ActionOut(id=body.id, trajectory=tid, status="queued"), True

    async def wait(self, aid, wait_s, owner):
        assert owner == "default"
        self.calls.append(("wait", aid, wait_s))
        return ActionOut(id=aid, trajectory="t", status="ok", exit_code=0)


def _call(method: str, path: str, query: bytes = b"", body: bytes = b"",
          headers: tuple = ((b"authorization", b"Bearer " + TOKEN.encode()),
                            (b"content-type", b"application/json"))):
    """Run one request through FastActions; (who answered, status, body, service calls)."""
    service = _Service()
    inner_saw: list[bytes] = []

    async def inner(scope, receive, send):  # FastAPI's place
        message = await receive()
        inner_saw.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "query_string": query,
             "headers": list(headers), "app": SimpleNamespace(state=SimpleNamespace(
                 service=service))}
    asyncio.run(FastActions(inner, TOKEN, _error)(scope, receive, send))
    who = "fastapi" if inner_saw else "fast"
    if inner_saw:
        assert inner_saw == [body]  # handed over with its body, unread
    return who, sent[0]["status"], sent[-1]["body"], service.calls


SUBMIT = json.dumps({"id": "x1", "argv": ["true"]}).encode()


@pytest.mark.parametrize(("method", "path", "query", "body", "headers", "who"), [
    ("POST", "/v1/trajectories/t/actions", b"wait=25.0", SUBMIT, None, "fast"),
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT, None, "fast"),
    ("GET", "/v1/actions/x1", b"wait=3", b"", None, "fast"),
    ("GET", "/v1/actions/x1", b"", b"", None, "fast"),
    # everything else is FastAPI's: another scheme spelling, a wrong or a second token,
    # another content type, a query it must interpret, an id out of pattern, a bad body
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT,
     ((b"authorization", b"bearer " + TOKEN.encode()), (b"content-type", b"application/json")),
     "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT,
     ((b"authorization", b"Bearer no"), (b"content-type", b"application/json")), "fastapi"),
    ("GET", "/v1/actions/x1", b"", b"",
     ((b"authorization", b"Bearer " + TOKEN.encode()),
      (b"authorization", b"Bearer " + TOKEN.encode())), "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT,
     ((b"authorization", b"Bearer " + TOKEN.encode()), (b"content-type", b"text/plain")),
     "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT,
     ((b"authorization", b"Bearer " + TOKEN.encode()),), "fastapi"),
    ("GET", "/v1/actions/x1", b"wait=-1", b"", None, "fastapi"),
    ("GET", "/v1/actions/x1", b"wait=1e3", b"", None, "fastapi"),
    ("GET", "/v1/actions/x1", b"wait=1&wait=2", b"", None, "fastapi"),
    ("GET", "/v1/actions/x1", b"wait=999999999", b"", None, "fastapi"),  # > 24 h
    ("GET", "/v1/actions/..", b"", b"", None, "fastapi"),
    ("GET", "/v1/actions/" + "a" * 129, b"", b"", None, "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", b'{"id": "x1", "argv": []}', None, "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", b"[1]", None, "fastapi"),
    ("POST", "/v1/trajectories/t/actions", b"", b"\xff", None, "fastapi"),
    ("POST", "/v1/trajectories/t/actions/x", b"", SUBMIT, None, "fastapi"),
    ("PUT", "/v1/trajectories/t/actions", b"", SUBMIT, None, "fastapi"),
    # an id with a final newline: Python's ``$`` matches before it, FastAPI's pattern does not
    ("GET", "/v1/actions/x1\n", b"", b"", None, "fastapi"),
    ("POST", "/v1/trajectories/t\n/actions", b"", SUBMIT, None, "fastapi"),
    # two content types: FastAPI reads the first (not JSON here: its 422)
    ("POST", "/v1/trajectories/t/actions", b"", SUBMIT,
     ((b"authorization", b"Bearer " + TOKEN.encode()), (b"content-type", b"text/plain"),
      (b"content-type", b"application/json")), "fastapi"),
    # nested too deep for json.loads (a RecursionError): FastAPI's 400, not a 500
    ("POST", "/v1/trajectories/t/actions", b"", b"[" * 100_000, None, "fastapi"),
])
def test_only_well_formed_requests_take_the_fast_path(method, path, query, body, headers, who):
    kw = {} if headers is None else {"headers": headers}
    got, status, _, calls = _call(method, path, query, body, **kw)
    assert got == who
    assert (calls != []) == (who == "fast")


def test_the_fast_path_answers_with_the_service_and_its_error_handler():
    who, status, body, calls = _call("POST", "/v1/trajectories/t/actions", b"wait=25.0", SUBMIT)
    assert (who, status) == ("fast", 202)
    assert calls == [("submit", "t", "x1"), ("wait", "x1", 25.0)]  # queued: it waits
    assert json.loads(body)["status"] == "ok"
    who, status, body, _ = _call("POST", "/v1/trajectories/missing/actions", b"", SUBMIT)
    assert (who, status) == ("fast", 404)
    assert json.loads(body) == {"detail": "unknown trajectory 'missing'"}


@pytest.mark.parametrize("token", [" lead", "trail ", "caf\u00e9"])
def test_a_token_fastapi_reads_otherwise_leaves_every_request_to_it(token):
    """FastAPI strips the credentials and decodes the header as latin-1: for such a token
    the exact bytes ``Bearer <token>`` are not what it accepts, so none is taken here."""
    seen: list[str] = []

    async def inner(scope, receive, send):
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "GET", "path": "/v1/actions/x1", "query_string": b"",
             "headers": [(b"authorization", b"Bearer " + token.encode())],
             "app": SimpleNamespace(state=SimpleNamespace(service=_Service()))}
    asyncio.run(FastActions(inner, token, _error)(scope, receive, send))
    assert seen == ["/v1/actions/x1"]
