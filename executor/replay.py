"""`tangram run`: replay a trace for real; the result is analysed like a simulation's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from executor.driver import LiveBackend, LiveExecutor
from executor.local import local_cluster
from tangram.cluster import ClusterSpec, QuotaSpec
from tangram.core import Tangram
from tangram.model import quota_resource
from tangram.policies import Policy
from tangram.runtime import RunResult
from traces.fit import check_fits
from traces.schema import TrajectorySpec, trajectories


def make_backend(name: str, workdir: Path, mem_gb: float = 2.0, pids: int = 512,
                 warm: int = 0) -> LiveBackend:
    """A backend by name; ``mem_gb``/``pids``/``warm``: the docker sandboxes' default
    memory limit, process limit and warm pool size."""
    from executor.http_api import RouterBackend

    if name == "process":
        from executor.process import ProcessBackend

        return RouterBackend(ProcessBackend(workdir))
    if name == "docker":
        import hashlib

        from executor.docker_backend import DockerBackend

        owner = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
        return RouterBackend(DockerBackend(owner=owner, default_mem_gb=mem_gb, pids_limit=pids,
                                           warm=warm))
    raise ValueError(f"backend: unknown backend {name!r} (process or docker)")


def replay_cluster(df: pd.DataFrame, quotas: tuple[QuotaSpec, ...]) -> ClusterSpec:
    """This machine, plus every quota the trace uses (defaults: 16 concurrent calls)."""
    keys = {quota_resource(k) for k in df["quota_key"] if k}
    given = {q.key for q in quotas}
    extra = tuple(QuotaSpec(k, "concurrency", 16) for k in sorted(keys - given))
    mem = float(df.groupby("trajectory")["mem_gb"].max().sum()) or None
    return local_cluster(quotas + extra, mem_gb=None if mem is None else max(mem, 1.0) * 1.01)


async def replay(df: pd.DataFrame, backend: str, out: Path, *, limit: int | None = None,
                 think_scale: float = 1.0, quotas: tuple[QuotaSpec, ...] = (),
                 policy: Policy | None = None,
                 progress: Callable[[int, int], None] | None = None
                 ) -> tuple[RunResult, dict[str, Any]]:
    """Run the trace's actions for real under ``policy``; (result, resolved config)."""
    policy = policy or Policy()
    gpu_rows = df.index[df["gpus"] != ""]
    if len(gpu_rows):
        raise ValueError(f"{len(gpu_rows)} action(s) need GPUs (first: row {gpu_rows[0] + 1}, "
                         f"kind {df['kind'][gpu_rows[0]]!r}); the live executor runs CPU and API "
                         "actions only so far; study GPU workloads with `tangram simulate`")
    specs: list[TrajectorySpec] = list(trajectories(df))[: limit or None]
    if limit:
        df = df[df["trajectory"].isin({s.id for s in specs})]
    cluster = replay_cluster(df, quotas)
    # refuse the whole run before starting if any action cannot run here
    check_fits(Tangram(cluster, policy), specs)
    executor = LiveExecutor(Tangram(cluster, policy), make_backend(backend, out / "work"))
    total = sum(len(s.steps) for s in specs)
    done = 0
    wall0 = time.perf_counter()

    async def one(spec: TrajectorySpec) -> None:
        nonlocal done
        executor.open_trajectory(spec.id, spec.task, spec.mem_gb)
        try:
            for step in spec.steps:
                if step.think_s * think_scale > 0:
                    await asyncio.sleep(step.think_s * think_scale)
                await executor.run(step.action)
                done += 1
                if progress:
                    progress(done, total)
        finally:
            executor.close_trajectory(spec.id)

    t0 = executor.clock.now()
    try:
        await asyncio.gather(*(one(s) for s in specs))
    finally:
        executor.shutdown()
    rollout = executor.clock.now() - t0
    core = executor.core
    result = RunResult(policy.label, executor.runtime.records,
                       [{"step": 0, "rollout_s": rollout, "step_s": rollout}], core.capacity(),
                       {"backend": backend, "live": True, "think_scale": think_scale,
                        "gpu_restores": core.gpu.restores, "scheduler_passes": core.passes},
                       executor.runtime.timing, None, time.perf_counter() - wall0, core)
    config = {"backend": backend, "cluster": cluster.to_dict(), "limit": limit,
              "think_scale": think_scale, "policy": policy.params()}
    return result, config
