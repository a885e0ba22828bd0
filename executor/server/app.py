"""`tangram serve`: the live executor behind an HTTP API (FastAPI).

Rollout workers open a trajectory, submit actions (idempotent by their
client-supplied id), wait for or stream each result, and close the trajectory.
Every request but ``/healthz`` needs ``Authorization: Bearer <token>``; a server may
have several tokens, and a trajectory is its opener's (executor/server/tokens.py).

The pieces: request bodies and their limits (``schemas.py``), the one service
object the handlers call (``service.py``), the routes (``routes/``) and the
journal (``journal.py``). Submitted actions are journalled in SQLite; after a
restart, an action that had not finished is reported *failed* to whoever asks
for it, never silently lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from executor.driver import LiveBackend, LiveExecutor, RunObserver
from executor.server.connections import HEADER_TIMEOUT_S, guarded
from executor.server.journal import Journal
from executor.server.limits import READ_TIMEOUT_S, BodyLimit
from executor.server.routes import actions, ops
from executor.server.routes.deps import bearer, check_token
from executor.server.routes.fast import FastActions
from executor.server.routes.files import router as files_router
from executor.server.routes.gpus import router as gpu_router
from executor.server.routes.openai import router as openai_router
from executor.server.schemas import MAX_BODY_BYTES
from executor.server.service import Refused, Service
from executor.server.status import status_router
from executor.server.tokens import Tokens
from tangram.core import Tangram

#: a step of the start-up, for whoever starts it to say (``tangram serve``: a line when it
#: begins and when it ends, tangram_cli/common.py phase): ``with phase("what it does"): ...``
Phase = Callable[[str], AbstractContextManager[object]]


def no_phase(_name: str) -> AbstractContextManager[object]:
    """A start-up step nobody is told of."""
    return nullcontext()


#: how long SIGTERM waits for open requests before cancelling them (then: lifespan shutdown)
GRACEFUL_S = 2.0
#: finished actions' records kept in memory for the status page (the journal has them all)
RECENT_RECORDS = 256
#: request paths whose bodies the file API limits itself (executor.files.MAX_FILE_BYTES)
FILES_PATH = r"^/v1/trajectories/[^/]+/files/"


def create_app(make_backend: Callable[[], LiveBackend], make_core: Callable[[], Tangram],
               token: str | Tokens, state_dir: Path,
               allow_urls: Mapping[str, tuple[str, ...]] | None = None,
               task_images: Mapping[str, str] | None = None,
               result_ttl_s: float = 60.0,
               memory_node: str | None = None,
               read_timeout_s: float = READ_TIMEOUT_S,
               phase: Phase | None = None,
               observer: Callable[[Tangram], RunObserver] | None = None) -> FastAPI:
    """``token``: the server's bearer tokens (a str: its one token, named ``default``).
    ``phase``: told of the steps of the start (``with phase("what it does"): ...``).
    ``observer``: made for the core when the server starts, told of what it runs
    (``--record``: executor/record.py)."""
    tokens = Tokens.single(token) if isinstance(token, str) else token

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        journal = Journal(state_dir / "journal.sqlite")
        for path in state_dir.glob("journal.sqlite*"):  # every trajectory's outputs: not
            path.chmod(0o600)  # for a root server's sandbox users (executor/backends/process/uids.py)
        core = make_core()
        executor = LiveExecutor(core, make_backend(), max_records=RECENT_RECORDS,
                                observer=observer(core) if observer is not None else None)
        with (phase or no_phase)("restoring the journal's open trajectories"):
            app.state.service = Service(executor, journal, allow_urls,
                                        result_ttl_s=result_ttl_s, task_images=task_images,
                                        memory_node=memory_node)
        try:
            yield
        finally:
            app.state.service.shutdown()
            journal.close()

    async def auth(request: Request,
                   cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        request.state.owner = check_token(cred, tokens)

    app = FastAPI(title="Tangram", version="0.1.0", lifespan=lifespan,
                  description="Action-level scheduling of the external resources of agentic RL.")
    app.include_router(ops.health_router)
    app.include_router(ops.router, dependencies=[Depends(auth)])
    app.include_router(actions.router, dependencies=[Depends(auth)])
    app.include_router(files_router, dependencies=[Depends(auth)])
    app.include_router(gpu_router, dependencies=[Depends(auth)])
    app.include_router(openai_router, dependencies=[Depends(auth)])  # teachers, reward models
    app.include_router(status_router(auth))  # the live status page at / (executor/server/status.py)
    app.add_exception_handler(Refused, _refused)
    app.add_exception_handler(ValueError, _value_error)
    # submit and wait, the per-action requests, off FastAPI's per-request path when
    # well-formed (executor/server/routes/fast.py); inside BodyLimit: added first, runs second
    app.add_middleware(FastActions, token=tokens, on_error=_error)
    # file uploads may be larger than any JSON body: the file API bounds them itself
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES, large_paths=FILES_PATH,
                       read_timeout_s=read_timeout_s)
    return app


async def _refused(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Refused)
    if exc.status == 422:
        return _unprocessable(exc.detail)
    return JSONResponse({"detail": exc.detail}, status_code=exc.status)


async def _error(request: Request | None, exc: Exception) -> JSONResponse:
    """What the handlers above answer for ``exc`` (a Refused or a ValueError)."""
    return await (_refused if isinstance(exc, Refused) else _value_error)(request, exc)


async def _value_error(_request: Request, exc: Exception) -> JSONResponse:
    return _unprocessable(str(exc))


def _unprocessable(message: str) -> JSONResponse:
    """A 422 in FastAPI's own validation shape, so every 422 reads the same; ``loc``
    names the field when the message starts with it (``"cpu: ..."``)."""
    field, sep, _ = message.partition(":")
    loc = ["body", *field.strip().split(".")] if sep and field.replace(".", "").replace(
        "_", "").replace("[", "").replace("]", "").replace("'", "").isalnum() else ["body"]
    return JSONResponse({"detail": [{"loc": loc, "msg": message, "type": "value_error"}]},
                        status_code=422)


class _Server(uvicorn.Server):
    """uvicorn, plus: SIGTERM wakes every long-poll at once (they would otherwise
    hold the graceful shutdown until they end)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.tangram_app = app

    def handle_exit(self, sig: int, frame: Any) -> None:
        service = getattr(self.tangram_app.state, "service", None)
        if service is not None:
            try:
                service.executor.loop.call_soon_threadsafe(service.begin_shutdown)
            except RuntimeError:  # the loop is already closed
                pass
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str, port: int, access_log: bool = False,
          header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """Run ``app`` until SIGINT/SIGTERM; exits within GRACEFUL_S plus the backend's cleanup.
    ``access_log``: a line per request (~5% of the server's CPU per trivial action);
    ``header_timeout_s``: how long a client may take over a request's headers."""
    # keep-alive longer than TangramClient's (30 s): the client always drops an idle
    # connection first, so it never sends on one the server is closing (a ReadError)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=75,
                            access_log=access_log)
    config.load()
    # a deadline for request headers and a cap on connections (executor/server/connections.py)
    config.http_protocol_class = guarded(config.http_protocol_class, header_timeout_s)
    _Server(config, app).run()
