"""What every route needs: the service, the bearer-token check, and whose request it is."""

from __future__ import annotations

from fastapi import HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from executor.server.service import Service
from executor.server.tokens import Tokens

bearer = HTTPBearer(auto_error=False)


async def service(request: Request) -> Service:
    return request.app.state.service


def check_token(cred: HTTPAuthorizationCredentials | None, tokens: Tokens) -> str:
    """The name of the request's token (401 if it is none of the server's)."""
    # compare bytes: compare_digest refuses non-ASCII str, which must be a 401, not a 500
    given = cred.credentials.encode("utf-8", "surrogateescape") if cred else b""
    name = tokens.who(given) if cred is not None else None
    if name is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})
    return name


async def owner(request: Request) -> str:
    """The name of the token the request came with (set by the routers' token check, which
    runs first): the owner of what it opens, and the only one it may reach."""
    return request.state.owner
