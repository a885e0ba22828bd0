"""HTTP: files in and out of a trajectory's sandbox (patches, tests, artefacts).

    PUT /v1/trajectories/{id}/files/{path}   body = the file's bytes
    GET /v1/trajectories/{id}/files/{path}   -> the file's bytes

``path`` is relative to the sandbox's working directory (where commands run);
see executor/files.py for how it is confined. The server registers this router
behind its bearer-token check; only the trajectory's own token reaches its files.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import IO, Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from executor.files import MAX_FILE_BYTES, FileError, clean_path
from tangram.protocol import FileHolding

#: an upload stays in memory up to this size, then goes to a temporary file
SPOOL_BYTES = 1 << 20

router = APIRouter(prefix="/v1/trajectories/{tid}/files", tags=["files"])


def _backend(request: Request, tid: str) -> Any:
    service = request.app.state.service
    executor = service.executor
    # another token's trajectory is answered as an unknown one (executor/server/tokens.py)
    if not executor.has_trajectory(tid) or not service.owns(tid, request.state.owner):
        raise HTTPException(404, f"unknown trajectory {tid!r}")
    backend = executor.backend
    if not isinstance(backend, FileHolding):
        raise HTTPException(501, f"the {backend.name} backend has no file API")
    return backend


def _parts(path: str) -> tuple[str, ...]:
    try:
        return clean_path(path)
    except FileError as e:
        raise HTTPException(e.status, str(e)) from None


async def _body(request: Request) -> IO[bytes]:
    """The request body spooled to a temporary file (memory up to SPOOL_BYTES, then
    disk: a dozen concurrent 64 MiB uploads do not hold 768 MiB in the server), refused
    (413) as soon as it passes the limit. The caller closes it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_FILE_BYTES:
        raise HTTPException(413, f"file of {declared} bytes: over the {MAX_FILE_BYTES}-byte limit")
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
    try:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise HTTPException(413, f"file over the {MAX_FILE_BYTES}-byte limit")
            spool.write(chunk)  # page cache: microseconds per chunk, fine on the loop
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool


_BYTES = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@router.put("/{path:path}", openapi_extra={"requestBody": {"required": True, "content": _BYTES}})
async def put_file(tid: str, path: str, request: Request) -> dict[str, Any]:
    """Write the request body to ``path`` in the trajectory's sandbox (parents created)."""
    backend = _backend(request, tid)
    parts = _parts(path)
    body = await _body(request)
    try:
        size = await asyncio.to_thread(backend.put_file, tid, parts, body)
    except FileError as e:
        raise HTTPException(e.status, str(e)) from None
    finally:
        body.close()
    return {"trajectory": tid, "path": "/".join(parts), "size": size}


@router.get("/{path:path}", response_class=Response,
            responses={200: {"content": _BYTES}})
async def get_file(tid: str, path: str, request: Request) -> Response:
    """The bytes of the regular file ``path`` in the trajectory's sandbox."""
    backend = _backend(request, tid)
    parts = _parts(path)
    try:
        data = await asyncio.to_thread(backend.get_file, tid, parts, MAX_FILE_BYTES)
    except FileError as e:
        raise HTTPException(e.status, str(e)) from None
    return Response(data, media_type="application/octet-stream")
