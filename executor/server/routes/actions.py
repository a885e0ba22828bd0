"""Trajectories and their actions: open, close, submit, wait, stream."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.responses import JSONResponse, StreamingResponse

from executor.server.routes.deps import owner, service
from executor.server.schemas import (
    ID_MAX,
    ID_PATTERN,
    MAX_TIMEOUT_S,
    ActionIn,
    ActionOut,
    BatchIn,
    BatchOut,
    ErrorOut,
    TrajectoriesOut,
    TrajectoryIn,
    TrajectoryOut,
)
from executor.server.service import Refused, Service

ERRORS = {code: {"model": ErrorOut, "description": text} for code, text in (
    (401, "Missing or wrong bearer token"), (403, "Destination not allowed"),
    (404, "Unknown trajectory or action"), (409, "Conflict with what exists"),
    (413, "Body larger than 1 MiB"), (502, "The trajectory's image could not be pulled"),
    (503, "Shutting down"))}
router = APIRouter(prefix="/v1", responses=ERRORS)
Svc = Annotated[Service, Depends(service)]
#: the name of the request's token: what it opens is its, and it reaches nothing else
Owner = Annotated[str, Depends(owner)]
TrajectoryId = Annotated[str, Path(pattern=ID_PATTERN, max_length=ID_MAX,
                                                     description="Trajectory id.")]
ActionId = Annotated[str, Path(pattern=ID_PATTERN, max_length=ID_MAX, description="Action id.")]
Wait = Annotated[float, Query(ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
                              description="Block up to this many seconds for the action's end "
                              "(or the server's shutdown).")]


@router.post("/trajectories", status_code=201)
async def open_trajectory(body: TrajectoryIn, s: Svc, who: Owner) -> dict[str, Any]:
    """Open a trajectory; with ``fork_of``, ``count`` copies of an open one's sandbox
    (answered once the copies are made: ``ids``, ``method``, ``fork_s``; the fork is an
    action of the source, ``action``, looked up and cancelled as any)."""
    if body.fork_of is not None:
        return await s.fork_trajectories(body, owner=who)
    return await s.open_pulling(body, owner=who)


@router.get("/trajectories", response_model=TrajectoriesOut)
async def list_trajectories(s: Svc, who: Owner) -> Any:
    """The request's token's open trajectories: state, node, actions in flight, idle time,
    memory."""
    return TrajectoriesOut(trajectories=s.trajectories(owner=who))


@router.get("/trajectories/{tid}", response_model=TrajectoryOut)
async def get_trajectory(tid: TrajectoryId, s: Svc, who: Owner) -> Any:
    """One open trajectory (404 once it is closed)."""
    view = s.trajectory_view(tid) if s.owns(tid, who) else None
    if view is None:
        raise Refused(404, f"unknown trajectory {tid!r}")
    return view


@router.delete("/trajectories/{tid}")
async def close_trajectory(tid: TrajectoryId, s: Svc, who: Owner) -> dict[str, str | int]:
    """Close it; what it has queued or running is cancelled first (``cancelled``: how many;
    a fork of it among them)."""
    return await s.close_trajectory(tid, owner=who)


@router.post("/actions:batch", status_code=202, response_model=BatchOut)
async def submit_batch(body: BatchIn, s: Svc, who: Owner) -> Any:
    """Queue many actions (of any trajectories): every one is checked before any is
    accepted; a refusal names the item (``actions[3].action.cpu``)."""
    done = await s.submit_batch([(item.trajectory, item.action) for item in body.actions],
                                owner=who)
    return BatchOut(actions=[view for view, _ in done])


@router.post("/trajectories/{tid}/actions", status_code=202, response_model=ActionOut,
             responses={200: {"model": ActionOut, "description": "Already submitted (same body)"}})
async def submit(tid: TrajectoryId, body: ActionIn, s: Svc, who: Owner,
                 wait: Wait = 0.0) -> Any:
    """Queue an action; with ``wait`` > 0, answer when it ends (one round trip per action)."""
    view, created = await s.submit(tid, body, who)
    if wait > 0 and view.status in ("queued", "running"):
        view = await s.wait(body.id, wait, who)
    return view if created else JSONResponse(view.model_dump(), status_code=200)


@router.delete("/actions/{aid}", response_model=ActionOut)
async def cancel_action(aid: ActionId, s: Svc, who: Owner) -> Any:
    """Cancel a queued or running action (a fork too); answers once it ended (``cancelled``,
    its cores back). One that had already ended is answered as it ended."""
    return await s.cancel(aid, owner=who)


@router.get("/actions/{aid}", response_model=ActionOut)
async def get_action(aid: ActionId, s: Svc, who: Owner, wait: Wait = 0.0) -> Any:
    """The action's state; with ``wait`` > 0, block until it ends (or the server stops)."""
    return await s.wait(aid, wait, who)


@router.get("/actions/{aid}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`event: status` lines, each with an ActionOut"}})
async def stream(aid: ActionId, s: Svc, who: Owner) -> StreamingResponse:
    """Server-sent events: the current state, then the result when it ends."""
    return StreamingResponse(await s.events(aid, owner=who), media_type="text/event-stream")
