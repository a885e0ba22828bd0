"""HTTP backend: outbound API calls. Admission (concurrency or per-window
quotas) is the core's quota manager; this backend sends the request and, on a
429, a 5xx or a timeout, backs off exponentially and retries, so a call is
never lost: it ends with the provider's answer or with a failed outcome that
says how many attempts were made."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import time
from collections.abc import Callable

import httpx

from executor.backends.http.urls import FORBIDDEN_HEADERS
from tangram.api.backoff import Backoff
from tangram.model import Dispatch, Outcome

RETRY_STATUS = {429, 500, 502, 503, 504}


class HttpBackend:
    name = "http"

    def __init__(self, attempts: int = 6, backoff: Backoff = Backoff(0.2, 5.0),
                 timeout_s: float = 30.0) -> None:
        self.attempts = attempts
        self.backoff = backoff
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # redirects are not followed: the allow-list checked this URL, no other
            self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
        return self._client

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(d, on_done))
        self._tasks[d.action.id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(d.action.id, None))

    async def _guarded(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        """Whatever fails (a header httpx cannot encode...), the action ends."""
        try:
            await self._call(d, on_done)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure must end the action
            on_done(Outcome(d.action.id, "failed", None,
                            error=f"request failed: {type(e).__name__}: {e}"))

    async def _call(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        req = dict((d.action.payload or {}).get("request") or {})
        if not req.get("url"):
            on_done(Outcome(d.action.id, "failed", None, error="payload.request.url: missing"))
            return
        if (d.action.payload or {}).get("public_only"):
            # allowed by a '*' entry: the name must not lead to this host or its network
            host = httpx.URL(str(req["url"])).host
            if await asyncio.to_thread(is_private, host):
                on_done(Outcome(d.action.id, "failed", None, error=(
                    f"request.url: {host!r} resolves to a loopback or private address (list "
                    "it explicitly with --allow-url to reach it)")))
                return
        method = str(req.get("method", "GET")).upper()
        # the service refuses these at submit; dropped here too for any other caller
        headers = {k: v for k, v in (req.get("headers") or {}).items()
                   if k.strip().lower() not in FORBIDDEN_HEADERS}
        timeout = float((d.action.payload or {}).get("timeout_s") or self.timeout_s)
        last = ""
        t0 = time.time()
        for attempt in range(self.attempts):
            try:
                resp = await self._http().request(
                    method, req["url"], headers=headers, params=req.get("params"),
                    json=req.get("json"), content=req.get("body"), timeout=timeout)
                if resp.status_code not in RETRY_STATUS:
                    on_done(Outcome(d.action.id, "ok", resp.status_code, resp.text,
                                    extra={"retries": attempt, "http_status": resp.status_code,
                                           "elapsed_s": time.time() - t0}))
                    return
                last = f"HTTP {resp.status_code}"
                delay = _retry_after(resp)
            except httpx.TimeoutException:
                last, delay = f"timed out after {timeout:g} s", None
            except httpx.HTTPError as e:
                last, delay = f"{type(e).__name__}: {e}", None
            except asyncio.CancelledError:
                on_done(Outcome(d.action.id, "cancelled", None, error="cancelled"))
                raise
            # a Retry-After the provider sent is honoured as given (no jitter below it)
            await asyncio.sleep(delay if delay is not None
                                else self.backoff.delay(attempt, random.random()))
        on_done(Outcome(d.action.id, "failed", None,
                        error=f"gave up after {self.attempts} attempts (last: {last})",
                        extra={"retries": self.attempts - 1}))

    def cancel(self, action_id: str) -> None:
        task = self._tasks.get(action_id)
        if task:
            task.cancel()

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        pass

    def close_trajectory(self, trajectory: str) -> None:
        pass

    def shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            try:
                asyncio.get_running_loop().create_task(client.aclose())
            except RuntimeError:
                pass


def is_private(host: str) -> bool:
    """Whether ``host`` (an IP literal or a name) is or resolves to a non-public address."""
    try:
        addrs = {ipaddress.ip_address(host.strip("[]"))}
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return True  # unresolvable: refuse rather than guess
        addrs = {ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos}
    return any(not a.is_global for a in addrs)


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return min(float(value), 30.0) if value else None
    except ValueError:
        return None
