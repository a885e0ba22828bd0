"""The environment backends by name (``--backend``): the one place ``tangram serve``, ``tangram
run`` and the Ray node agents build one from."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from executor.backends.docker.limits import SandboxLimits

#: the names ``--backend`` accepts
ENV_BACKENDS = ("process", "docker")


def env_backend(name: str, root: Path, *, cpu_map: list[int] | None = None,
                run_mark: str | None = None, owner: str | None = None,
                sandboxes: SandboxLimits = SandboxLimits(),
                env: Mapping[str, str] | None = None) -> Any:
    """The environment backend ``name``: ``root`` its working directories (process), ``cpu_map``
    the cores it may use (default: all this process may), ``run_mark`` the process backend's
    mark for its children, ``owner`` the docker containers' owner label (default: derived from
    ``root``, so one state directory owns one set of containers), ``sandboxes`` what each
    sandbox may use (the process backend: its memory limit, and its user ids as root),
    ``env`` extra environment for the process backend's commands."""
    if name == "process":
        from executor.backends.process.backend import ProcessBackend

        return ProcessBackend(root, cpu_map=cpu_map, env=env, run_mark=run_mark,
                              default_mem_gb=sandboxes.mem_gb, disk_gb=sandboxes.disk_gb,
                              uids=sandboxes.uids)
    if name == "docker":
        from executor.backends.docker.backend import DockerBackend

        owner = owner or hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:16]
        # what a stop removed, beside the journal: a restart on the same state directory
        # tells the trajectories it restores (DockerBackend.removed_file)
        return DockerBackend(cpu_map=cpu_map, owner=owner, removed_file=root / ".docker-removed",
                             **sandboxes.docker_kwargs())
    raise ValueError(f"backend: unknown backend {name!r} ({' or '.join(ENV_BACKENDS)})")


def make_backend(name: str, workdir: Path, gpu: Any = None,
                 sandboxes: SandboxLimits = SandboxLimits(),
                 env: Mapping[str, str] | None = None) -> Any:
    """The env backend ``name`` behind the router, which also sends API calls to the HTTP
    backend and GPU actions to ``gpu`` (an ``executor.backends.gpu.backend.GpuBackend``)."""
    from executor.backends.router import RouterBackend

    return RouterBackend(env_backend(name, workdir, sandboxes=sandboxes, env=env), gpu=gpu)
