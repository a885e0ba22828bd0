"""`tangram serve`: the live executor behind an HTTP API (FastAPI).

Rollout workers open a trajectory, submit actions (idempotent by their
client-supplied id), wait for or stream each result, and close the trajectory.
Every request but ``/healthz`` needs ``Authorization: Bearer <token>``.

Submitted actions are journalled in SQLite; after a restart, an action that
had not finished is reported *failed* ("server restarted") to whoever asks
for it, never silently lost.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, field_validator

from executor.driver import LiveBackend, LiveExecutor
from executor.files_api import router as files_router
from executor.gpu.actions import gpu_action
from executor.gpu.routes import metric_lines
from executor.gpu.routes import router as gpu_router
from executor.status import status_router
from tangram.core import Tangram
from tangram.model import Action, Demand, Elasticity, Outcome, quota_resource
from tangram.runtime import Record
from traces.schema import parse_set

RESTARTED = "the server restarted before this action finished; resubmit it"


class TrajectoryIn(BaseModel):
    id: str | None = Field(None, min_length=1, max_length=200,
                           description="Trajectory id (generated when omitted).")
    task: str = Field("default", min_length=1, max_length=200)
    mem_gb: float | None = Field(None, ge=0, description="Memory of its environment (GB).")


class ActionIn(BaseModel):
    id: str = Field(min_length=1, max_length=200,
                    description="Client-chosen id; resubmitting the same id is a no-op.")
    kind: str = Field("shell", min_length=1, max_length=100)
    argv: list[str] | None = Field(None, min_length=1, description="Command as argv (no shell).")
    command: str | None = Field(None, min_length=1, description="Command line, split with shlex.")
    shell: bool = Field(False, description="Run `command` as `sh -c <command>` inside the sandbox.")
    request: dict[str, Any] | None = Field(
        None, description="An outbound API call instead of a command: {method, url, json, ...}.")
    cpu: str = Field("1", description="Feasible core counts: '2', '1-8' or '1,2,4'.")
    elastic: bool = Field(False, description="Cores are the key elastic resource (pytest -n).")
    t1_s: float | None = Field(None, ge=0, description="Profiled duration on one core (s).")
    parallel_fraction: float | None = Field(None, ge=0, le=1, description="Amdahl fraction of E(m).")
    quota: dict[str, float] = Field(default_factory=dict, description="Quota key -> units.")
    timeout_s: float | None = Field(None, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    service: str | None = Field(None, min_length=1, max_length=200,
                                description="GPU service (model) to call: a GPU action.")
    gpus: str = Field("1", description="GPU action: feasible GPU counts, '1' or '1,2,4,8'.")
    inputs: dict[str, Any] | None = Field(
        None, description="GPU action: {op: 'logprobs' | 'score', tokens: [[ids]], yes_token}.")

    @field_validator("cpu", mode="before")
    @classmethod
    def _cpu(cls, v: Any) -> str:
        text = str(v)
        try:
            demand = parse_set(text)
        except ValueError as e:
            raise ValueError(f"not a feasible set: {e}") from None
        if demand is None or demand.min < 1:
            raise ValueError("needs at least one core")
        return text

    def to_action(self, trajectory: str, task: str) -> Action:
        if self.service is not None:
            return gpu_action(self, trajectory, task)
        if self.request is None and self.argv is None and self.command is None:
            raise ValueError("argv: give argv, command or request")
        cost: dict[str, Demand] = {}
        if self.request is None:
            cost["cpu"] = parse_set(self.cpu)  # type: ignore[assignment]
        for key, units in self.quota.items():
            cost[quota_resource(key)] = Demand.fixed(units)
        payload = {"argv": self.argv, "command": self.command, "shell": self.shell,
                   "request": self.request,
                   "timeout_s": self.timeout_s, "env": self.env}
        elasticity = (Elasticity.amdahl(self.parallel_fraction)
                      if self.parallel_fraction is not None else None)
        return Action(self.id, task, trajectory, self.kind, cost,
                      elastic="cpu" if self.elastic and self.request is None else None,
                      t1_s=self.t1_s, elasticity=elasticity, payload=payload)


class ActionOut(BaseModel):
    id: str
    trajectory: str
    status: str = Field(description="queued | running | ok | failed | timeout | cancelled")
    exit_code: int | None = None
    output: str = ""
    error: str = ""
    units: int | None = None
    cores: list[int] = Field(default_factory=list)
    gpus: list[int] = Field(default_factory=list)
    lane: bool = Field(False, description="Ran on the node's light lane (cores shared).")
    queue_s: float | None = None
    exec_s: float | None = None
    state_lost: bool = False
    retries: int = 0
    node: str | None = Field(None, description="The node it ran on (several with --ray).")
    argv: list[str] = Field(default_factory=list, description="What was executed (after -n).")


class Journal:
    """Submitted actions and their results, in SQLite (one writer: the loop thread)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS actions (id TEXT PRIMARY KEY, trajectory "
                        "TEXT, body TEXT, status TEXT, result TEXT)")

    def recover(self) -> int:
        """Mark what a previous process left unfinished as failed; how many."""
        result = json.dumps({"error": RESTARTED})
        cur = self.db.execute("UPDATE actions SET status='failed', result=? "
                              "WHERE status IN ('queued', 'running')", (result,))
        return cur.rowcount

    def submitted(self, aid: str, trajectory: str, body: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO actions VALUES (?, ?, ?, 'queued', NULL)",
                        (aid, trajectory, body))

    def finished(self, out: ActionOut) -> None:
        self.db.execute("UPDATE actions SET status=?, result=? WHERE id=?",
                        (out.status, out.model_dump_json(), out.id))

    def get(self, aid: str) -> ActionOut | None:
        row = self.db.execute("SELECT trajectory, status, result FROM actions WHERE id=?",
                              (aid,)).fetchone()
        if row is None:
            return None
        trajectory, st, result = row
        data = json.loads(result) if result else {}
        if "id" in data:
            return ActionOut(**data)
        return ActionOut(id=aid, trajectory=trajectory, status=st, error=data.get("error", ""))

    def close(self) -> None:
        self.db.close()


@dataclass
class Tracked:
    trajectory: str
    body: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: ActionOut | None = None


def result_of(rec: Record, out: Outcome) -> ActionOut:
    extra = dict(out.extra or {})
    return ActionOut(
        id=rec.action_id, trajectory=rec.trajectory, status=out.status, exit_code=out.exit_code,
        output=out.output, error=out.error, units=rec.units, lane=rec.lane,
        cores=[int(c) for c in extra.get("cores", [])], gpus=[int(g) for g in extra.get("gpus", [])],
        queue_s=rec.start_s - rec.submit_s, exec_s=rec.end_s - rec.start_s,
        state_lost=bool(extra.get("state_lost")), retries=int(extra.get("retries", 0)),
        argv=list(extra.get("argv", [])), node=rec.node)


class Service:
    """The state behind the API: executor, trajectories, tracked actions, journal."""

    def __init__(self, executor: LiveExecutor, journal: Journal) -> None:
        self.executor = executor
        self.journal = journal
        self.tracked: dict[str, Tracked] = {}
        self.counts: dict[str, int] = {}
        self.act_sum = 0.0
        self.started = time.time()

    def finish(self, aid: str, rec: Record, out: Outcome) -> None:
        res = result_of(rec, out)
        t = self.tracked.get(aid)
        if t is not None:
            t.result = res
            t.done.set()
        self.journal.finished(res)
        self.counts[res.status] = self.counts.get(res.status, 0) + 1
        self.act_sum += rec.end_s - rec.submit_s

    def view(self, aid: str) -> ActionOut | None:
        t = self.tracked.get(aid)
        if t is None:
            return self.journal.get(aid)
        if t.result is not None:
            return t.result
        core = self.executor.core
        st = "running" if aid in core.running else "queued"
        return ActionOut(id=aid, trajectory=t.trajectory, status=st)


def create_app(make_backend: Callable[[], LiveBackend], make_core: Callable[[], Tangram],
               token: str, state_dir: Path) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        journal = Journal(state_dir / "journal.sqlite")
        recovered = journal.recover()
        executor = LiveExecutor(make_core(), make_backend())
        app.state.service = Service(executor, journal)
        app.state.recovered = recovered
        try:
            yield
        finally:
            executor.shutdown()
            journal.close()

    app = FastAPI(title="Tangram", version="0.1.0", lifespan=lifespan,
                  description="Action-level scheduling of the external resources of agentic RL.")
    bearer = HTTPBearer(auto_error=False)

    def auth(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if cred is None or not secrets.compare_digest(cred.credentials, token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    def svc(request: Request) -> Service:
        return request.app.state.service

    app.include_router(files_router, dependencies=[Depends(auth)])
    app.include_router(gpu_router, dependencies=[Depends(auth)])

    @app.exception_handler(ValueError)
    async def value_error(_request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    app.include_router(status_router(auth))  # the live status page at / (executor/status.py)

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        s = svc(request)
        return {"status": "ok", "uptime_s": time.time() - s.started,
                "recovered_as_failed": request.app.state.recovered}

    @app.post("/v1/trajectories", status_code=201, dependencies=[Depends(auth)])
    async def open_trajectory(body: TrajectoryIn, request: Request) -> dict[str, str]:
        s = svc(request)
        tid = body.id or secrets.token_hex(8)
        if tid in s.executor.core.trajectories:
            raise HTTPException(409, f"trajectory {tid!r} is already open")
        s.executor.open_trajectory(tid, body.task, body.mem_gb)
        return {"id": tid, "task": body.task}

    @app.delete("/v1/trajectories/{tid}", dependencies=[Depends(auth)])
    async def close_trajectory(tid: str, request: Request) -> dict[str, str]:
        s = svc(request)
        if tid not in s.executor.core.trajectories:
            raise HTTPException(404, f"unknown trajectory {tid!r}")
        try:
            s.executor.close_trajectory(tid)
        except ValueError as e:
            raise HTTPException(409, str(e)) from None
        return {"id": tid, "status": "closed"}

    @app.post("/v1/trajectories/{tid}/actions", status_code=202, dependencies=[Depends(auth)],
              response_model=ActionOut)
    async def submit(tid: str, body: ActionIn, request: Request) -> Any:
        s = svc(request)
        known = s.tracked.get(body.id)
        if known is not None or s.journal.get(body.id) is not None:
            if known is not None and known.trajectory != tid:
                raise HTTPException(409, f"action id {body.id!r} belongs to another trajectory")
            return JSONResponse(s.view(body.id).model_dump(), status_code=200)  # idempotent
        state = s.executor.core.trajectories.get(tid)
        if state is None:
            raise HTTPException(404, f"unknown trajectory {tid!r}")
        action = body.to_action(tid, state.task)
        s.executor.core.validate(action)
        raw = body.model_dump_json()
        s.tracked[body.id] = Tracked(tid, raw)
        s.journal.submitted(body.id, tid, raw)
        s.executor.submit(action, lambda rec, out, aid=body.id: s.finish(aid, rec, out))
        return s.view(body.id)

    @app.get("/v1/actions/{aid}", dependencies=[Depends(auth)], response_model=ActionOut)
    async def get_action(aid: str, request: Request, wait: float = 0.0) -> Any:
        """The action's state; with ``wait`` > 0, block up to that many seconds for its end."""
        s = svc(request)
        t = s.tracked.get(aid)
        if t is not None and wait > 0 and t.result is None:
            try:
                await asyncio.wait_for(t.done.wait(), min(wait, 3600))
            except TimeoutError:
                pass
        view = s.view(aid)
        if view is None:
            raise HTTPException(404, f"unknown action {aid!r}")
        return view

    @app.get("/v1/actions/{aid}/events", dependencies=[Depends(auth)])
    async def stream(aid: str, request: Request) -> StreamingResponse:
        """Server-sent events: the current state, then the result when it ends."""
        s = svc(request)
        if s.view(aid) is None:
            raise HTTPException(404, f"unknown action {aid!r}")

        async def events() -> AsyncIterator[bytes]:
            last = None
            while True:
                view = s.view(aid)
                assert view is not None
                if view.status != last:
                    last = view.status
                    yield f"event: status\ndata: {view.model_dump_json()}\n\n".encode()
                if view.status not in ("queued", "running"):
                    return
                t = s.tracked.get(aid)
                if t is None:
                    return
                try:
                    await asyncio.wait_for(t.done.wait(), 0.5)
                except TimeoutError:
                    pass

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics", dependencies=[Depends(auth)], response_class=PlainTextResponse)
    async def metrics(request: Request) -> str:
        s = svc(request)
        core = s.executor.core
        use, cap = core.usage(), core.capacity()
        lines = ["# HELP tangram_actions_total Finished actions by status.",
                 "# TYPE tangram_actions_total counter"]
        for st, n in sorted(s.counts.items()):
            lines.append(f'tangram_actions_total{{status="{st}"}} {n}')
        done = sum(s.counts.values())
        lines += ["# HELP tangram_act_seconds Action completion time (queue + execution).",
                  "# TYPE tangram_act_seconds summary",
                  f"tangram_act_seconds_sum {s.act_sum:.6f}", f"tangram_act_seconds_count {done}",
                  "# HELP tangram_queued_actions Actions waiting for resources.",
                  "# TYPE tangram_queued_actions gauge",
                  f"tangram_queued_actions {len(core.queued)}",
                  "# HELP tangram_running_actions Actions executing.",
                  "# TYPE tangram_running_actions gauge",
                  f"tangram_running_actions {len(core.running)}",
                  "# HELP tangram_open_trajectories Open trajectories.",
                  "# TYPE tangram_open_trajectories gauge",
                  f"tangram_open_trajectories {len(core.trajectories)}",
                  "# HELP tangram_resource_in_use Units of each resource in use.",
                  "# TYPE tangram_resource_in_use gauge"]
        for res, v in sorted(use.items()):
            lines.append(f'tangram_resource_in_use{{resource="{res}"}} {v}')
        lines += ["# HELP tangram_resource_capacity Units of each resource.",
                  "# TYPE tangram_resource_capacity gauge"]
        for res, v in sorted(cap.items()):
            lines.append(f'tangram_resource_capacity{{resource="{res}"}} {v}')
        lines += metric_lines(s.executor.backend)
        return "\n".join(lines) + "\n"

    return app
