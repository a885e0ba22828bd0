"""The live status page of `tangram serve`: ``/`` (a static page), ``/v1/status`` (one JSON
snapshot) and ``/v1/status/events`` (server-sent events: a snapshot whenever it changes).

The page holds no data itself, so ``/`` needs no token; it asks for the server's bearer
token in a form, keeps it in the tab's sessionStorage (never in a URL or a cookie) and sends
it as ``Authorization: Bearer`` on the two data endpoints, which use the API's own auth.

Everything the page shows comes from :func:`snapshot`, a pure function of the core's
:class:`~tangram.protocol.Snapshot` (nodes, leases and resident services, queues, quotas)
and the runtime's finished records, so it is tested without a server and reads the same
whether a policy shares cores (AOE) or holds pods.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from executor.server.images import image_status_of
from tangram.model import Dispatch
from tangram.protocol import Snapshot
from tangram.runtime import Record

#: longest lists the snapshot carries (the page is a glance, not a log)
MAX_QUEUED = 50
MAX_RECENT = 30
#: how often the event stream looks for a change, and sends a keep-alive comment
POLL_S = 0.25
KEEPALIVE_S = 15.0
#: concurrent event streams one token may hold (the page opens one per tab)
MAX_STREAMS = 16

# The page's own files; no CDN (nothing outside can be reached from a cluster).
STATIC = resources.files("executor.server") / "static"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _holder(d: Dispatch, now: float) -> dict[str, Any]:
    return {"action": d.action.id, "trajectory": d.action.trajectory, "kind": d.action.kind,
            "task": d.action.task, "units": d.lease.units, "running_s": round(now - d.start_s, 3)}


def _nodes(snap: Snapshot, now: float) -> list[dict[str, Any]]:
    """Per CPU node: who holds each core (a running action, or an idle pod), the light
    actions running on its shared lane, memory."""
    holders: dict[tuple[str, int], dict[str, Any]] = {}
    lanes: dict[str, list[dict[str, Any]]] = {}
    for d in snap.running.values():
        lease = d.lease
        if lease.node is None or not lease.cores:
            continue
        if lease.lane:  # shares the node's cores: no core of its own
            lanes.setdefault(lease.node, []).append(_holder(d, now))
            continue
        for c in lease.cores:
            holders[(lease.node, c)] = _holder(d, now)
    bound: dict[str, list[str]] = {}
    for trajectory, view in snap.trajectories.items():
        if view.node is not None:
            bound.setdefault(view.node, []).append(trajectory)
    out = []
    for node in snap.cpu_nodes:
        name = node.name
        cores: list[dict[str, Any] | None] = []
        for c in range(node.cores):
            held = holders.get((name, c))
            if held is None and c not in node.free:
                # pod policies (k8s): a pod holds its cores between its trajectory's actions
                pod = node.pods.get(c)
                held = {"action": None, "trajectory": pod, "kind": "pod" if pod else "reserved"}
            cores.append(held)
        out.append({"name": name, "cores": cores, "numa": node.numa,
                    "domain_size": node.domain_size, "mem_gb": node.mem_gb,
                    "mem_reserved_gb": round(node.mem_reserved_gb, 3),
                    "trajectories": sorted(bound.get(name, [])),
                    "lane": sorted(lanes.get(name, []), key=lambda h: h["action"]),
                    "lane_slots": node.lane_slots})
    return out


def _queues(snap: Snapshot, now: float) -> list[dict[str, Any]]:
    """Each pool's wait queue in order (plus trajectories waiting to be bound to a node)."""
    out = []
    for q in snap.queues:
        out.append({"pool": q.pool, "resource": q.resource, "length": len(q.waiting), "waiting": [
            {"action": w.action.id, "trajectory": w.action.trajectory, "kind": w.action.kind,
             "task": w.action.task, "units_min": w.units_min, "submit_s": round(w.submit_s, 3),
             "waiting_s": round(now - w.submit_s, 3)}
            for w in q.waiting[:MAX_QUEUED]]})
    return out


def _gpus(snap: Snapshot, now: float) -> list[dict[str, Any]]:
    """Per GPU node: busy and free chunks, and the service variants resident in memory."""
    busy: dict[tuple[str, int], dict[str, Any]] = {}
    for d in snap.running.values():
        lease = d.lease
        if lease.node is not None and lease.gpus:
            busy[(lease.node, min(lease.gpus))] = {
                **_holder(d, now), "service": d.action.service,
                "size": len(lease.gpus), "restore_s": lease.restore_s}
    out = []
    for node in snap.gpu_nodes:
        name = node.name
        chunks = [{"start": start, "size": size, "state": "free"} for start, size in node.free]
        chunks += [{"start": start, "size": held["size"], "state": "busy", **held}
                   for (n, start), held in busy.items() if n == name]
        resident = [{"service": svc, "dop": size, "start": start,
                     "mem_gb": snap.service_gb.get(svc)}
                    for svc, size, start in node.resident]
        out.append({"name": name, "gpus": node.gpus, "gpu_mem_gb": node.gpu_mem_gb,
                    "chunks": sorted(chunks, key=lambda c: c["start"]), "resident": resident,
                    "mem_used_gb": [round(m, 3) for m in node.mem_used]})
    return out


def _quotas(snap: Snapshot) -> list[dict[str, Any]]:
    return [{"key": q.key.removeprefix("quota:"), "mode": q.mode, "limit": q.limit,
             "window_s": q.window_s, "used": q.used}
            for q in snap.quotas]


def _recent(records: Sequence[Record]) -> list[dict[str, Any]]:
    return [{"action": r.action_id, "trajectory": r.trajectory, "kind": r.kind,
             "status": r.status, "exit_code": r.exit_code, "units": r.units, "node": r.node,
             "cores": r.cores, "gpus": r.gpus, "queue_s": round(r.start_s - r.submit_s, 3),
             "exec_s": round(r.end_s - r.start_s, 3), "end_s": round(r.end_s, 3)}
            for r in reversed(records[-MAX_RECENT:])]


def snapshot(snap: Snapshot, records: Sequence[Record], now: float,
             finished: dict[str, int] | None = None,
             images: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the status page shows, as JSON-ready data (times in the core's seconds),
    from the core's :class:`~tangram.protocol.Snapshot` and the runtime's records; ``images``:
    the docker backend's pulls and image cache (executor/backends/docker/cache.py), where
    it has them."""
    out = {
        "now_s": round(now, 3),
        "policy": snap.policy,
        "totals": {"queued": snap.queued, "running": snap.running_count,
                   "trajectories": snap.open_trajectories,
                   "finished": dict(sorted((finished or {}).items()))},
        "nodes": _nodes(snap, now),
        "queues": _queues(snap, now),
        "gpu_nodes": _gpus(snap, now),
        "quotas": _quotas(snap),
        "recent": _recent(records),
    }
    if images is not None:
        out["images"] = images
    return out


def _changing(snap: dict[str, Any]) -> str:
    """The snapshot without the ticking clocks: the stream sends only when this changes
    (the page advances waiting and running times itself between events)."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()
                    if k not in ("now_s", "waiting_s", "running_s", "idle_s")}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    return json.dumps(strip(snap), sort_keys=True)


def _live(request: Request) -> dict[str, Any]:
    """The one place that reads the server's state (the service object of server.py)."""
    return _live_app(request.app)


def _live_app(app: Any) -> dict[str, Any]:
    service = app.state.service
    executor = service.executor
    return snapshot(executor.snapshot(), executor.runtime.records, executor.clock.now(),
                    service.counts, image_status_of(executor.backend))


class Broadcast:
    """One snapshot per change, shared by every event stream of the server.

    Each stream used to rebuild the whole snapshot 4 times a second: 1,000 streams held
    the loop at 100% CPU. Now one poller (running only while a stream is open) builds it
    every POLL_S, and only when its content changed does it encode it, once, for all
    streams to send. ``built`` and ``sent`` count both (a test reads them)."""

    def __init__(self, build: Callable[[], dict[str, Any]], closing: asyncio.Event) -> None:
        self.build = build
        self.closing = closing
        self.event = b""
        self.built = self.sent = 0
        #: token -> its open streams (weak: a stream cancelled before it started, whose
        #: ``finally`` never runs, still leaves when it is collected)
        self.streams: dict[str, weakref.WeakSet] = {}
        self._key: str | None = None
        self._changed = asyncio.Event()
        self._poller: asyncio.Task | None = None

    def full(self, token: str) -> bool:
        """Whether ``token`` holds MAX_STREAMS open streams already."""
        return len(self.streams.get(token, ())) >= MAX_STREAMS

    def join(self, token: str, stream: Any) -> None:
        self.streams.setdefault(token, weakref.WeakSet()).add(stream)
        if self._poller is None or self._poller.done():
            self._refresh()  # a new stream starts with the current snapshot
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def leave(self, token: str, stream: Any) -> None:
        self.streams.get(token, weakref.WeakSet()).discard(stream)

    def open_streams(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def _refresh(self) -> None:
        snap = self.build()
        self.built += 1
        key = _changing(snap)
        if key != self._key:
            self._key = key
            self.event = f"event: snapshot\ndata: {json.dumps(snap)}\n\n".encode()
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def _poll(self) -> None:
        while self.open_streams() and not self.closing.is_set():
            await asyncio.sleep(POLL_S)
            self._refresh()
        self._changed.set()  # wake the streams, so they see the server closing

    async def next(self, sent: bytes | None) -> bytes | None:
        """The current event if it differs from ``sent``; else waits for a change (None
        after KEEPALIVE_S without one: time for a keep-alive comment)."""
        if self.event is not sent:
            return self.event
        try:
            await asyncio.wait_for(self._changed.wait(), KEEPALIVE_S)
        except TimeoutError:
            return None
        return self.event


def _static(name: str, media_type: str) -> Response:
    return Response((STATIC / name).read_bytes(), media_type=media_type,
                    headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})


def status_router(auth: Callable[..., None]) -> APIRouter:
    """The page and its two data endpoints; ``auth`` is the API's bearer-token dependency."""
    router = APIRouter()
    hub: Broadcast | None = None  # the app's one Broadcast, made by its first event stream

    def broadcast(request: Request) -> Broadcast:
        nonlocal hub
        if hub is None:
            app = request.app
            hub = Broadcast(lambda: _live_app(app), app.state.service.closing)
        return hub

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> Response:
        return _static("status.html", "text/html; charset=utf-8")

    @router.get("/status.js", include_in_schema=False)
    async def script() -> Response:
        return _static("status.js", "text/javascript; charset=utf-8")

    @router.get("/status.css", include_in_schema=False)
    async def style() -> Response:
        return _static("status.css", "text/css; charset=utf-8")

    @router.get("/v1/status", dependencies=[Depends(auth)])
    async def status_json(request: Request) -> dict[str, Any]:
        """What the status page shows: cores per node and who holds them, queues per pool
        with waiting times, GPU chunks and resident services, quota usage, recent actions;
        ``streams``: the event streams open and the snapshots built and sent for them."""
        streams = {"open": hub.open_streams() if hub else 0, "built": hub.built if hub else 0,
                   "sent": hub.sent if hub else 0}
        return {**_live(request), "streams": streams}

    @router.get("/v1/status/events", dependencies=[Depends(auth)],
                response_class=StreamingResponse,
                responses={200: {"content": {"text/event-stream": {}},
                                 "description": "`event: snapshot` lines"}})
    async def status_events(request: Request) -> Response:
        """Server-sent events: ``event: snapshot`` with the /v1/status document, sent when
        anything but the clocks changed (and a comment every 15 s to keep proxies open)."""

        hub = broadcast(request)
        token = request.headers.get("authorization", "")
        if hub.full(token):
            return Response(json.dumps({"detail": f"at most {MAX_STREAMS} status streams per "
                                        "token: close one first"}), status_code=429,
                            media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            sent: bytes | None = None
            try:
                while not hub.closing.is_set():  # ends with the server (SIGTERM)
                    event = await hub.next(sent)
                    if hub.closing.is_set():
                        return
                    if event is None:
                        yield b": keep-alive\n\n"
                    elif event is not sent:
                        sent = event
                        hub.sent += 1
                        yield event
            finally:  # also when the client goes (Starlette cancels the stream)
                hub.leave(token, stream)

        stream = events()
        hub.join(token, stream)
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return router
