"""Python clients for `tangram serve`: ``TangramClient`` (asyncio) and
``TangramSyncClient`` (blocking, for synchronous environments). The adapters
in the shapes RL frameworks expect (verl tools, gymnasium and SkyRL-gym
environments) live in ``tangram_sdk.integrations``.

    async with TangramClient("http://127.0.0.1:8000", token) as tg:
        tid = await tg.open_trajectory(task="coding", mem_gb=4)
        await tg.put_file(tid, "fix.patch", patch_bytes)
        result = await tg.run(tid, command="git apply fix.patch && pytest -q", shell=True)
        await tg.close_trajectory(tid)
"""

from __future__ import annotations

import os
import uuid
from typing import Any
from urllib.parse import quote

import httpx


class TangramError(RuntimeError):
    """The server refused a request; ``status`` is the HTTP status."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {detail}")


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("TANGRAM_TOKEN")
    if not token:
        raise ValueError("token: pass one or set TANGRAM_TOKEN")
    return {"Authorization": f"Bearer {token}"}


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        raise TangramError(resp.status_code, detail)


def _trajectory_body(trajectory: str | None, task: str, mem_gb: float | None,
                     image: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": trajectory, "task": task, "mem_gb": mem_gb}
    if image is not None:  # only servers that know per-trajectory images get the field
        body["image"] = image
    return body


def _fork_body(trajectory: str, count: int, prefix: str | None,
               action: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"fork_of": trajectory, "count": count}
    if prefix is not None:
        body["id"] = prefix
    if action is not None:  # only servers whose forks are actions know the field
        body["action"] = action
    return body


def _file_url(trajectory: str, path: str) -> str:
    return f"/v1/trajectories/{quote(trajectory, safe='')}/files/{quote(path, safe='/')}"


def _batch(actions: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {"actions": [{"trajectory": tid, "action": {"id": uuid.uuid4().hex, **action}}
                        for tid, action in actions]}


def _finished(res: dict[str, Any]) -> bool:
    return res["status"] not in ("queued", "running")


#: requests in flight on one connection pool before the client opens another. httpx's
#: pool (httpcore) walks every connection it holds on each request and each release, so n
#: requests at once cost O(n^2): with 2,048 trajectories in one process that walk was ~95%
#: of the client's CPU (py-spy; ~18 ms per action). Several small pools keep it O(n).
POOL_SHARE = 32
#: how long an open that names an image may take: the node pulls a missing one first
PULL_TIMEOUT_S = 1800.0


def _pull_timeout(image: str | None) -> dict[str, float]:
    """The open's request timeout when it names an image (else the client's own)."""
    return {"timeout": PULL_TIMEOUT_S} if image else {}


class TangramClient:
    """Asyncio client; every method raises TangramError when the server refuses."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0,
                 max_connections: int = 4096) -> None:
        # every waiting trajectory holds one long-poll: the pools together must not be the
        # limit (httpx's default of 100 made thousands of trajectories queue for a
        # connection and time out there), and kept-alive connections spare a handshake per
        # call. ``max_connections`` in all: pools of POOL_SHARE, as many as that makes
        self._share = share = min(POOL_SHARE, max_connections)
        limits = httpx.Limits(max_connections=share, max_keepalive_connections=share,
                              keepalive_expiry=30)
        headers = _headers(token)
        self._new_pool = lambda: httpx.AsyncClient(
            base_url=base_url.rstrip("/"), limits=limits,
            timeout=httpx.Timeout(timeout_s, pool=None), headers=headers)
        self._pools = [self._new_pool()]
        self._busy = [0]  # requests in flight per pool
        self._most_pools = max(1, -(-max_connections // share))

    def _pick(self) -> int:
        """The first pool with room (kept-alive connections are reused from the first ones
        first), a new one when none has; when there are enough pools, the least busy (the
        request then waits there for a connection: ``max_connections`` is the cap)."""
        for i, n in enumerate(self._busy):
            if n < self._share:
                return i
        if len(self._pools) < self._most_pools:
            self._pools.append(self._new_pool())
            self._busy.append(0)
            return len(self._pools) - 1
        return min(range(len(self._busy)), key=self._busy.__getitem__)

    async def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        i = self._pick()
        self._busy[i] += 1
        try:
            return await self._pools[i].request(method, path, **kw)
        finally:
            self._busy[i] -= 1

    async def __aenter__(self) -> TangramClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = await self._request(method, path, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError,
                httpx.ReadTimeout):
            # a kept-alive connection closed under the request, or an overloaded server:
            # once more, where repeating is harmless (reads; actions are idempotent by id)
            if not (method == "GET" or path.endswith("/actions")):
                raise
            resp = await self._request(method, path, **kw)
        _raise_for(resp)
        return resp.json()

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/healthz")

    async def open_trajectory(self, trajectory: str | None = None, task: str = "default",
                              mem_gb: float | None = None, image: str | None = None) -> str:
        """Open a trajectory (its id is generated when None); returns its id."""
        body = _trajectory_body(trajectory, task, mem_gb, image)
        # an image not on the node is pulled before the open answers: minutes for a large one
        return (await self._call("POST", "/v1/trajectories", json=body,
                                 **_pull_timeout(image)))["id"]

    async def fork(self, trajectory: str, count: int, prefix: str | None = None,
                   action: str | None = None) -> dict[str, Any]:
        """Open ``count`` trajectories whose sandboxes start as copies of ``trajectory``'s
        files now (it must have no action in flight); ``prefix`` names them
        ``<prefix>-0``... ``action``: the fork action's id (generated when None), to look
        it up or cancel it (:meth:`cancel`) while it runs. The answer: ``ids``, ``action``,
        ``method`` (how the files were copied), ``fork_s``."""
        return await self._call("POST", "/v1/trajectories",
                                json=_fork_body(trajectory, count, prefix, action))

    async def close_trajectory(self, trajectory: str) -> dict[str, Any]:
        """Close it (what it has queued or running is cancelled first)."""
        return await self._call("DELETE", f"/v1/trajectories/{trajectory}", timeout=90.0)

    async def trajectories(self) -> list[dict[str, Any]]:
        """The open trajectories: state, node, actions in flight, idle time, memory."""
        return (await self._call("GET", "/v1/trajectories"))["trajectories"]

    async def trajectory(self, trajectory: str) -> dict[str, Any]:
        """One open trajectory (TangramError 404 once closed)."""
        return await self._call("GET", f"/v1/trajectories/{trajectory}")

    async def cancel(self, action_id: str) -> dict[str, Any]:
        """Cancel a queued or running action; returns its state once it ended."""
        return await self._call("DELETE", f"/v1/actions/{action_id}", timeout=90.0)

    async def submit_batch(self, actions: list[tuple[str, dict[str, Any]]]
                           ) -> list[dict[str, Any]]:
        """Submit many ``(trajectory, action)`` pairs in one request: all are checked
        before any is accepted. An action without an ``id`` gets one. Returns their states."""
        return (await self._call("POST", "/v1/actions:batch", json=_batch(actions)))["actions"]

    async def submit(self, trajectory: str, *, action_id: str | None = None,
                     **action: Any) -> dict[str, Any]:
        """Submit an action (fields of the server's ActionIn); returns its state."""
        body = {"id": action_id or uuid.uuid4().hex, **action}
        return await self._call("POST", f"/v1/trajectories/{trajectory}/actions", json=body)

    async def wait(self, action_id: str, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Block until the action ends (long-polling) and return its result."""
        deadline = timeout_s
        while True:
            step = min(deadline, 25.0)
            res = await self._call("GET", f"/v1/actions/{action_id}", params={"wait": step},
                                   timeout=step + 60)
            deadline -= step
            if _finished(res) or deadline <= 0:
                return res

    async def run(self, trajectory: str, *, action_id: str | None = None,
                  **action: Any) -> dict[str, Any]:
        """Submit an action and return its result (``shell=True``: ``sh -c command``): one
        round trip when it ends within 25 s (the submit waits for it), long-polls after."""
        body = {"id": action_id or uuid.uuid4().hex, **action}
        state = await self._call("POST", f"/v1/trajectories/{trajectory}/actions", json=body,
                                 params={"wait": 25.0}, timeout=85.0)
        if _finished(state):
            return state
        return await self.wait(state["id"])

    async def put_file(self, trajectory: str, path: str, data: bytes | str) -> dict[str, Any]:
        """Write ``data`` to ``path`` (relative to the sandbox's working directory)."""
        content = data.encode() if isinstance(data, str) else data
        return await self._call("PUT", _file_url(trajectory, path), content=content)

    async def get_file(self, trajectory: str, path: str) -> bytes:
        """The bytes of ``path`` in the trajectory's sandbox."""
        resp = await self._request("GET", _file_url(trajectory, path))
        _raise_for(resp)
        return resp.content

    async def metrics(self) -> str:
        resp = await self._request("GET", "/metrics")
        resp.raise_for_status()
        return resp.text


class TangramSyncClient:
    """The same calls, blocking (for synchronous environments such as gymnasium's)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                  headers=_headers(token))

    def __enter__(self) -> TangramSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._http.request(method, path, **kw)
        _raise_for(resp)
        return resp.json()

    def open_trajectory(self, trajectory: str | None = None, task: str = "default",
                        mem_gb: float | None = None, image: str | None = None) -> str:
        body = _trajectory_body(trajectory, task, mem_gb, image)
        return self._call("POST", "/v1/trajectories", json=body,
                          **_pull_timeout(image))["id"]

    def fork(self, trajectory: str, count: int, prefix: str | None = None,
             action: str | None = None) -> dict[str, Any]:
        """As :meth:`TangramClient.fork`."""
        return self._call("POST", "/v1/trajectories",
                          json=_fork_body(trajectory, count, prefix, action))

    def close_trajectory(self, trajectory: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/trajectories/{trajectory}", timeout=90.0)

    def trajectories(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/trajectories")["trajectories"]

    def trajectory(self, trajectory: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/trajectories/{trajectory}")

    def cancel(self, action_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/actions/{action_id}", timeout=90.0)

    def submit_batch(self, actions: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
        return self._call("POST", "/v1/actions:batch", json=_batch(actions))["actions"]

    def submit(self, trajectory: str, *, action_id: str | None = None,
               **action: Any) -> dict[str, Any]:
        body = {"id": action_id or uuid.uuid4().hex, **action}
        return self._call("POST", f"/v1/trajectories/{trajectory}/actions", json=body)

    def wait(self, action_id: str, timeout_s: float = 3600.0) -> dict[str, Any]:
        deadline = timeout_s
        while True:
            step = min(deadline, 25.0)
            res = self._call("GET", f"/v1/actions/{action_id}", params={"wait": step},
                             timeout=step + 10)
            deadline -= step
            if _finished(res) or deadline <= 0:
                return res

    def run(self, trajectory: str, **action: Any) -> dict[str, Any]:
        state = self.submit(trajectory, **action)
        if _finished(state):
            return state
        return self.wait(state["id"])

    def put_file(self, trajectory: str, path: str, data: bytes | str) -> dict[str, Any]:
        content = data.encode() if isinstance(data, str) else data
        return self._call("PUT", _file_url(trajectory, path), content=content)

    def get_file(self, trajectory: str, path: str) -> bytes:
        resp = self._http.get(_file_url(trajectory, path))
        _raise_for(resp)
        return resp.content
