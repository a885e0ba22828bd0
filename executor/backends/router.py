"""Which backend carries out a dispatch: the one rule (``route``) and the router that applies it
on one machine (``RouterBackend``). The Ray backend and its GPU wrapper apply the same rule
across nodes (executor/backends/ray/backend.py, executor/backends/gpu/ray_worker.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from executor.backends.forward import optional
from executor.backends.http.backend import HttpBackend
from tangram.model import Dispatch, Outcome
from tangram.protocol import NodeWatching, Sink, Traits

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
    environment backend (process or docker).

    It has an optional method (tangram.protocol's capabilities) exactly when the backend
    that carries it out has: the GPU backend's ``prerestore``, the environment backend's
    others (``move``, ``evict``, ``shed``, ``fork``, the files API, images), and ``watch``
    when either watches (executor/backends/forward.py)."""

    def __init__(self, env_backend, http: HttpBackend | None = None, gpu=None) -> None:
        self.env = env_backend
        self.http = http or HttpBackend()
        self.gpu = gpu  # GPU actions (a lease with GPUs): executor.backends.gpu.backend.GpuBackend
        self.name = env_backend.name
        self._where: dict[str, object] = {}
        # batches and GPU actions are the GPU backend's (the env backend declares none)
        self.traits: Traits = gpu.traits if gpu is not None else Traits()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or "env" not in self.__dict__:  # (during __init__, copies)
            raise AttributeError(name)
        if name == "watch":
            watchers = [b for b in (self.env, self.gpu) if isinstance(b, NodeWatching)]
            if watchers:
                def watch(sink: Sink) -> None:
                    """Nodes joining or leaving (env), GPU workers lost (gpu): to ``sink``."""
                    for w in watchers:
                        w.watch(sink)
                return watch
            raise AttributeError(name)
        return optional(name, self.gpu if name == "prerestore" else self.env)

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
