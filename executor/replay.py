"""`tangram run`: replay a trace for real; the result is analysed like a simulation's.

Every replayed action does real work. A row that names a ``command`` runs it;
a CPU row that names none runs ``tangram burn`` (executor/burn.py), which
burns the row's ``t1_s`` CPU seconds with its parallel fraction, so the action
takes as long on its granted cores as the simulator models it, and an elastic
grant of k cores really speeds it up (``-n k``). A row without CPU (an API
call the trace only times) waits its ``t1_s``: a network call's latency is
waiting, not work.

A command that exits non-zero is a failed action (``failed`` and the
``exit_codes`` histogram of summary.json); the tail of every action's output
(stdout and stderr, interleaved) goes to ``outputs.jsonl`` in the run
directory.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from executor.driver import LiveBackend, LiveExecutor
from executor.local import local_cluster
from tangram.cluster import ClusterSpec, QuotaSpec
from tangram.core import Tangram
from tangram.model import Action, Dispatch, Outcome, quota_resource
from tangram.policies import Policy
from tangram.runtime import RunResult
from traces.fit import check_fits
from traces.schema import Step, TrajectorySpec, trajectories
from traces.select import head, scale_think

#: characters of each action's output kept in outputs.jsonl
OUTPUT_TAIL = 2000


def make_backend(name: str, workdir: Path, env: Mapping[str, str] | None = None) -> LiveBackend:
    from executor.http_api import RouterBackend

    if name == "process":
        from executor.process import ProcessBackend

        return RouterBackend(ProcessBackend(workdir, env=env))
    if name == "docker":
        import hashlib

        from executor.docker_backend import DockerBackend

        owner = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
        return RouterBackend(DockerBackend(owner=owner))
    raise ValueError(f"backend: unknown backend {name!r} (process or docker)")


def replay_cluster(df: pd.DataFrame, quotas: tuple[QuotaSpec, ...]) -> ClusterSpec:
    """This machine, plus every quota the trace uses (defaults: 16 concurrent calls)."""
    keys = {quota_resource(k) for k in df["quota_key"] if k}
    given = {q.key for q in quotas}
    extra = tuple(QuotaSpec(k, "concurrency", 16) for k in sorted(keys - given))
    mem = float(df.groupby("trajectory")["mem_gb"].max().sum()) or None
    return local_cluster(quotas + extra, mem_gb=None if mem is None else max(mem, 1.0) * 1.01)


def work_argv(step: Step) -> list[str] | None:
    """What a row without a command runs (None: it has a command of its own)."""
    if (step.action.payload or {}).get("command"):
        return None
    truth = step.truth
    t1 = truth.t1_s if truth is not None else (step.action.t1_s or 0.0)
    if step.action.min("cpu") <= 0:
        return ["sleep", f"{t1:.4f}"]
    p = truth.parallel_fraction if truth is not None else None
    p = 0.0 if p is None or math.isnan(p) else p
    # the running interpreter, so the worker is found whether or not a venv is active
    return [sys.executable, "-m", "executor.burn", "--t1", f"{t1:.4f}", "-p", f"{p:.4f}"]


def with_work(step: Step) -> Action:
    argv = work_argv(step)
    if argv is None:
        return step.action
    payload = {k: v for k, v in (step.action.payload or {}).items() if k != "command"}
    return replace(step.action, payload={**payload, "argv": argv})


class OutputLog:
    """Wraps a live backend: a non-zero exit becomes a failed outcome, and each
    action's output tail is kept for outputs.jsonl."""

    def __init__(self, inner: LiveBackend) -> None:
        self.inner = inner
        self.rows: list[dict[str, Any]] = []

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        def done(out: Outcome) -> None:
            if out.status == "ok" and out.exit_code not in (0, None):
                out = replace(out, status="failed", error=f"exit code {out.exit_code}")
            self.rows.append({"action_id": d.action.id, "status": out.status,
                              "exit_code": out.exit_code, "error": out.error,
                              "argv": list((out.extra or {}).get("argv") or []),
                              "output_tail": (out.output or "")[-OUTPUT_TAIL:]})
            on_done(out)

        self.inner.start(d, done)

    def cancel(self, action_id: str) -> None:
        self.inner.cancel(action_id)

    def open_trajectory(self, trajectory: str, mem_gb: float | None) -> None:
        self.inner.open_trajectory(trajectory, mem_gb)

    def close_trajectory(self, trajectory: str) -> None:
        self.inner.close_trajectory(trajectory)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")


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
    # the same selection and scaling `tangram simulate --limit --think-scale` applies
    df = scale_think(head(df, limit), think_scale)
    specs: list[TrajectorySpec] = list(trajectories(df))
    cluster = replay_cluster(df, quotas)
    if backend == "process":
        # a trajectory's environment is a directory: nothing to start (the simulator
        # reads this from the cluster file run writes; docker's start is measured live)
        cluster = replace(cluster, extra={**cluster.extra, "env_start_s": 0.0})
    # refuse the whole run before starting if any action cannot run here
    check_fits(Tangram(cluster, policy), specs)
    # commands like `python -m pytest` and `tangram burn` resolve to this installation
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    log = OutputLog(make_backend(backend, out / "work", env))
    executor = LiveExecutor(Tangram(cluster, policy), log)
    total = sum(len(s.steps) for s in specs)
    done = 0
    wall0 = time.perf_counter()

    async def one(spec: TrajectorySpec) -> None:
        nonlocal done
        executor.open_trajectory(spec.id, spec.task, spec.mem_gb)
        try:
            for step in spec.steps:
                if step.think_s > 0:
                    await asyncio.sleep(step.think_s)
                await executor.run(with_work(step))
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
        log.write(out / "outputs.jsonl")
    rollout = executor.clock.now() - t0
    core = executor.core
    result = RunResult(policy.label, executor.runtime.records,
                       [{"step": 0, "rollout_s": rollout, "step_s": rollout}], core.capacity(),
                       {"backend": backend, "live": True, "think_scale": think_scale,
                        "gpu_restores": core.gpu.restores, "scheduler_passes": core.passes},
                       executor.runtime.timing, None, time.perf_counter() - wall0, core)
    config = {"backend": backend, "cluster": cluster.to_yaml(), "limit": limit,
              "think_scale": think_scale, "policy": policy.params()}
    return result, config
