"""The docker backend's warm pool: sandboxes created ahead of use, handed to a
trajectory's first action (with its own memory limit) and refilled."""

from __future__ import annotations

import asyncio
import time

import docker

from executor.docker_backend import DockerBackend
from executor.driver import LiveExecutor
from executor.local import local_cluster
from tangram.core import Tangram
from tangram.model import Action, Demand


def _containers(owner: str, trajectory: str | None = None) -> list:
    labels = [f"tangram.owner={owner}"]
    if trajectory is not None:
        labels.append(f"tangram.trajectory={trajectory}")
    return docker.from_env().containers.list(all=True, sparse=True, filters={"label": labels})


def _until(cond, within_s: float = 120.0) -> bool:
    deadline = time.time() + within_s
    while not cond() and time.time() < deadline:
        time.sleep(0.1)
    return cond()


def test_warm_sandboxes_are_used_resized_and_refilled(tmp_path):
    owner = f"warm-{tmp_path.name}"
    backend = DockerBackend(owner=owner, warm=2)
    try:
        assert _until(lambda: len(_containers(owner, "")) == 2)
        warm_ids = {c.id for c in _containers(owner, "")}

        async def go() -> str:
            ex = LiveExecutor(Tangram(local_cluster()), backend)
            ex.open_trajectory("a", "t", 0.25)
            t0 = time.perf_counter()
            _, out = await ex.run(Action("a1", "t", "a", "shell", {"cpu": Demand.fixed(1)},
                                         payload={"command": "cat /sys/fs/cgroup/memory/"
                                                  "memory.limit_in_bytes"}))
            assert out.status == "ok", out
            assert int(out.output) == 256 * 2**20  # the trajectory's limit, not the pool's
            assert out.extra["container"] in {i[:12] for i in warm_ids}  # taken warm
            return f"{(time.perf_counter() - t0) * 1e3:.0f} ms"

        asyncio.run(go())
        # the pool refills to its size; the used sandbox is the trajectory's now
        assert _until(lambda: len(_containers(owner)) == 3)
    finally:
        backend.shutdown()
    assert _containers(owner) == []
