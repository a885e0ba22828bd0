"""What every route needs: the service, and the bearer-token check."""

from __future__ import annotations

import secrets

from fastapi import HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from executor.server.service import Service

bearer = HTTPBearer(auto_error=False)


async def service(request: Request) -> Service:
    return request.app.state.service


def check_token(cred: HTTPAuthorizationCredentials | None, token: str) -> None:
    # compare bytes: compare_digest refuses non-ASCII str, which must be a 401, not a 500
    given = cred.credentials.encode("utf-8", "surrogateescape") if cred else b""
    if cred is None or not secrets.compare_digest(given, token.encode()):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
