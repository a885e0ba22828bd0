"""Which backend carries out a dispatch: the one rule (``route``) and the router that applies it
on one machine (``RouterBackend``). The Ray backend and its GPU wrapper apply the same rule
across nodes (executor/backends/ray/backend.py, executor/backends/gpu/ray_worker.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import BinaryIO, Literal

from executor.backends.http.backend import HttpBackend
from tangram.model import Dispatch, Outcome
from tangram.protocol import NONE, Capabilities, Moved, PreRestore, Shed, Sink

Route = Literal["gpu", "http", "env"]


def route(d: Dispatch, has_gpu: bool) -> Route:
    """A lease with GPUs goes to the GPU backend (when there is one), an API call (a payload
    with ``request``) to the HTTP backend, everything else to the environment backend
    (process or docker) that holds the trajectory's sandbox."""
    if d.lease.gpus and has_gpu:
        return "gpu"
    return "http" if (d.action.payload or {}).get("request") else "env"


class RouterBackend:
    """Sends API calls (payload with ``request``) to the HTTP backend, GPU actions (a
    lease with GPUs) to the GPU backend when there is one, and every command to the
    environment backend (process or docker)."""

    def __init__(self, env_backend, http: HttpBackend | None = None, gpu=None) -> None:
        self.env = env_backend
        self.http = http or HttpBackend()
        self.gpu = gpu  # GPU actions (a lease with GPUs): executor.backends.gpu.backend.GpuBackend
        self.name = env_backend.name
        self._where: dict[str, object] = {}
        # what the environment backend can do, and GPU actions when a GPU backend is given
        self.capabilities: Capabilities = env_backend.capabilities | (
            gpu.capabilities if gpu is not None else NONE)

    def open_trajectory_image(self, trajectory: str, mem_gb: float | None, image: str) -> None:
        self.env.open_trajectory_image(trajectory, mem_gb, image)

    def watch(self, sink: Sink) -> None:
        """Nodes joining or leaving (env), GPU workers lost (gpu): to ``sink``."""
        for backend in (self.env, self.gpu):
            if backend is not None and backend.capabilities.watches_nodes:
                backend.watch(sink)

    def evict(self, trajectory: str) -> bool:
        """Capabilities.evicts (the env backend's): free an idle trajectory's memory."""
        return self.env.evict(trajectory)

    def shed(self, effect: Shed) -> str | None:
        """Capabilities.sheds (the env backend's): kill the largest sandbox of a node short
        of memory."""
        return self.env.shed(effect)

    def put_file(self, trajectory: str, parts: tuple[str, ...], data: bytes | BinaryIO) -> int:
        return self.env.put_file(trajectory, parts, data)

    def get_file(self, trajectory: str, parts: tuple[str, ...], limit: int) -> bytes:
        return self.env.get_file(trajectory, parts, limit)

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        where = route(d, self.gpu is not None)
        backend = self.gpu if where == "gpu" else self.http if where == "http" else self.env
        for a in d.actions:  # a batch dispatch: each member ends (and is cancelled) alone
            self._where[a.id] = backend

        def done(outcome: Outcome) -> None:
            self._where.pop(outcome.action_id, None)
            on_done(outcome)

        try:
            backend.start(d, done)
        except Exception as e:  # noqa: BLE001 - e.g. a backend already shut down
            for a in d.actions:
                done(Outcome(a.id, "failed", None,
                             error=f"{backend.name}: cannot start: {type(e).__name__}: {e}"))

    def prerestore(self, effect: PreRestore) -> None:
        """A GPU variant loaded ahead of demand: the GPU backend's (only it pre-restores)."""
        if self.gpu is not None:
            self.gpu.prerestore(effect)

    def move(self, effect: Moved) -> None:
        """A light-lane action moved off the lane (Capabilities.moves: the env backend's,
        which ran it)."""
        if self.env.capabilities.moves:
            self.env.move(effect)

    def cancel(self, action_id: str) -> None:
        backend = self._where.get(action_id)
        if backend is not None:
            backend.cancel(action_id)  # type: ignore[attr-defined]

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        self.env.open_trajectory(trajectory, mem_gb)

    def close_trajectory(self, trajectory: str) -> None:
        self.env.close_trajectory(trajectory)

    def shutdown(self) -> None:
        self.http.shutdown()
        self.env.shutdown()
        if self.gpu is not None:
            self.gpu.shutdown()
