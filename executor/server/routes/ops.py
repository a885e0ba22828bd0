"""Health (no token) and Prometheus metrics."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from executor.server.routes.deps import service
from executor.server.service import Service

health_router = APIRouter()
router = APIRouter(responses={401: {"description": "Missing or wrong bearer token"}})
Svc = Annotated[Service, Depends(service)]


@health_router.get("/healthz")
async def healthz(s: Svc) -> dict[str, Any]:
    return s.health()


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(s: Svc) -> str:
    return s.metrics()
