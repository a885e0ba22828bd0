"""`tangram run`: replay a trace for real; the result is analysed like a simulation's.

Every replayed action does real work. A row that names a ``command`` runs it;
a CPU row that names none runs ``tangram burn`` (executor/bench/burn.py), which
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
import zlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from executor.backends.docker.limits import SandboxLimits
from executor.backends.forward import optional
from executor.backends.gpu.backend import GpuBackend
from executor.backends.gpu.config import GpuCluster
from executor.backends.gpu.measure import after_run, measure
from executor.backends.registry import make_backend
from executor.driver import LiveBackend, LiveExecutor
from executor.node.local import local_cluster
from executor.record import Recorder
from tangram.cluster import ClusterSpec, QuotaSpec
from tangram.core import Tangram
from tangram.model import Action, Dispatch, Outcome, quota_resource
from tangram.policies import Policy
from tangram.protocol import capabilities_of, traits_of
from tangram.runtime import Record, RunResult
from traces.player import drive, play, refuse_misfits
from traces.schema import Step, TrajectorySpec, trajectories
from traces.select import head, scale_think

#: characters of each action's output kept in outputs.jsonl
OUTPUT_TAIL = 2000


def replay_cluster(df: pd.DataFrame, quotas: tuple[QuotaSpec, ...]) -> ClusterSpec:
    """This machine, plus every quota the trace uses (defaults: 16 concurrent calls)."""
    keys = {quota_resource(k) for k in df["quota_key"] if k}
    given = {q.key for q in quotas}
    extra = tuple(QuotaSpec(k, "concurrency", 16) for k in sorted(keys - given))
    mem = float(df.groupby("trajectory")["mem_gb"].max().sum()) or None
    return local_cluster(quotas + extra, mem_gb=None if mem is None else max(mem, 1.0) * 1.01)


def work_argv(step: Step) -> list[str] | None:
    """What a row without a command runs (None: it has a command or a request of its own,
    or it is a GPU action, which GPU workers serve)."""
    payload = step.action.payload or {}
    if payload.get("command") or payload.get("request") or step.action.min("gpu") > 0:
        return None
    truth = step.truth
    t1 = truth.t1_s if truth is not None else (step.action.t1_s or 0.0)
    if step.action.min("cpu") <= 0:
        return ["sleep", f"{t1:.4f}"]
    p = truth.parallel_fraction if truth is not None else None
    p = 0.0 if p is None or math.isnan(p) else p
    # the running interpreter, so the worker is found whether or not a venv is active
    return [sys.executable, "-m", "executor.bench.burn", "--t1", f"{t1:.4f}", "-p", f"{p:.4f}"]


def with_work(step: Step) -> Action:
    argv = work_argv(step)
    if argv is None:
        return step.action
    payload = {k: v for k, v in (step.action.payload or {}).items() if k != "command"}
    return replace(step.action, payload={**payload, "argv": argv})


#: optional methods a replay does not use: a trace names no images, files or forks (a
#: fork would also bypass the output log's accounting)
NOT_REPLAYED = frozenset({"open_trajectory_image", "put_file", "get_file", "fork"})


class OutputLog:
    """Wraps a live backend: a non-zero exit becomes a failed outcome, and each
    action's output tail is kept for outputs.jsonl."""

    def __init__(self, inner: LiveBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.traits = traits_of(inner)
        self.rows: list[dict[str, Any]] = []
        self.running = 0  # started, not finished (the progress bar's "running")

    def __getattr__(self, name: str) -> Any:
        """The inner backend's optional methods (executor/backends/forward.py), but a
        replay's: it opens no images, serves no files and forks nothing."""
        if name.startswith("_") or "inner" not in self.__dict__ or name in NOT_REPLAYED:
            raise AttributeError(name)
        return optional(name, self.inner)

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        # a batch dispatch ends once per member (one Outcome each)
        self.running += len(d.actions)

        def done(out: Outcome) -> None:
            self.running -= 1
            if out.status == "ok" and out.exit_code not in (0, None):
                out = replace(out, status="failed", error=f"exit code {out.exit_code}")
            self.rows.append({"action_id": out.action_id, "status": out.status,
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


class LiveDoor:
    """The trajectory player's door (traces/player.py) on the asyncio clock."""

    def __init__(self, executor: LiveExecutor) -> None:
        self.executor = executor

    def open(self, spec: TrajectorySpec) -> None:
        self.executor.open_trajectory(spec.id, spec.task, spec.mem_gb)

    def sleep(self, seconds: float) -> Awaitable[None]:
        return asyncio.sleep(seconds)

    def run(self, action: Action) -> Awaitable[tuple[Record, Outcome]]:
        return self.executor.submit(action)

    def close(self, trajectory: str) -> None:
        self.executor.close_trajectory(trajectory)


async def replay(df: pd.DataFrame, backend: str, out: Path, *, limit: int | None = None,
                 think_scale: float = 1.0, quotas: tuple[QuotaSpec, ...] = (),
                 policy: Policy | None = None,
                 progress: Callable[..., None] | None = None,
                 live: LiveBackend | None = None, gpu: GpuCluster | None = None,
                 gpu_device: str = "cpu", gpu_tokens: int = 32,
                 record: Path | None = None, record_commands: bool = False,
                 sandboxes: SandboxLimits = SandboxLimits()
                 ) -> tuple[RunResult, dict[str, Any]]:
    """Run the trace's actions for real under ``policy``; (result, resolved config).
    ``record``: what ran is recorded there as a trace (executor/record.py), its commands
    hashed unless ``record_commands``.

    With ``live`` (a RayBackend) they run on its nodes (the cluster is their inventory)
    and this call shuts it down. GPU rows need ``gpu`` (nodes, services and their
    loaders): each becomes a request of ``gpu_tokens`` tokens to its service on a GPU
    worker; the records' ``restore_s`` are then the workers' measured restores (the core's
    modelled ones are in the counters). ``sandboxes``: what the docker backend's sandboxes
    and image pulls may use (`run --image-pulls --image-cache-gb`)."""
    try:
        return await _replay(df, backend, out, limit, think_scale, quotas, policy or Policy(),
                             progress, live, gpu, gpu_device, gpu_tokens, record,
                             record_commands, sandboxes)
    finally:
        if live is not None:
            live.shutdown()  # idempotent: a run that started has shut it down already


async def _replay(df: pd.DataFrame, backend: str, out: Path, limit: int | None,
                  think_scale: float, quotas: tuple[QuotaSpec, ...], policy: Policy,
                  progress: Callable[..., None] | None, live: LiveBackend | None,
                  gpu: GpuCluster | None, gpu_device: str, gpu_tokens: int,
                  record: Path | None = None, record_commands: bool = False,
                  sandboxes: SandboxLimits = SandboxLimits()
                  ) -> tuple[RunResult, dict[str, Any]]:
    gpu_rows = df.index[df["gpus"] != ""]
    if len(gpu_rows) and gpu is None:
        raise ValueError(f"{len(gpu_rows)} action(s) need GPUs (first: row {gpu_rows[0] + 1}, "
                         f"kind {df['kind'][gpu_rows[0]]!r}); replay them on GPU workers with "
                         "--gpu-device cpu (no GPU needed) or --gpu-device cuda")
    # the same selection and scaling `tangram simulate --limit --think-scale` applies
    df = scale_think(head(df, limit), think_scale)
    specs: list[TrajectorySpec] = list(trajectories(df))
    cluster = replay_cluster(df, quotas)
    if backend == "process" and live is None:
        # a trajectory's environment is a directory: nothing to start (the simulator
        # reads this from the cluster file run writes; docker's start is measured live)
        cluster = replace(cluster, extra={**cluster.extra, "env_start_s": 0.0})
    # GPU workers on the Ray nodes (executor/backends/gpu/ray_worker.py, RayWithGpus)
    ray_gpu = live.gpu if live is not None and capabilities_of(live).gpu else None  # type: ignore[attr-defined]
    if live is not None:  # the Ray nodes, with the quotas the trace needs
        if gpu is not None and ray_gpu is None:
            raise ValueError("--ray with --gpu-device: the Ray backend has no GPU workers")
        cluster = live.cluster(cluster.quotas)  # type: ignore[attr-defined]
    if gpu is not None:
        nodes = cluster.gpu_nodes if ray_gpu is not None else gpu.spec.gpu_nodes
        cluster = replace(cluster, gpu_nodes=nodes, services=gpu.spec.services,
                          restore_gbps=gpu.spec.restore_gbps)
    refuse_misfits(cluster, policy, specs)
    live_core = Tangram(cluster, policy)
    gpu_backend = None
    if gpu is not None:
        if ray_gpu is not None:
            gpu_backend = ray_gpu  # started with the Ray backend
        else:
            gpu_backend = GpuBackend(cluster, gpu.sources, gpu_device, gpu.physical)
            gpu_backend.start_workers()
    # commands like `python -m pytest` and `tangram burn` resolve to this installation
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    log = OutputLog(live or make_backend(backend, out / "work", gpu=gpu_backend, env=env,
                                         sandboxes=sandboxes))
    observer = None
    if record is not None:
        meta = {"by": "tangram run", "backend": backend, "policy": policy.label,
                "think_scale": think_scale, "limit": limit}
        try:
            observer = Recorder(record, cluster, live_core.learnt_speedup, record_commands,
                                meta)
        except BaseException:
            log.shutdown()  # (its sandboxes, warm containers and GPU workers: none left)
            raise
    executor = LiveExecutor(live_core, log, observer=observer)
    costs: dict[str, Any] = {}
    if gpu_backend is not None:  # staging is not part of any action's time
        try:
            await asyncio.to_thread(gpu_backend.wait_ready)
            # what the simulator needs to model these services (cluster.yaml's extra)
            costs = await asyncio.to_thread(measure, gpu_backend, gpu_tokens, cluster)
        except (RuntimeError, TimeoutError):
            executor.shutdown()
            raise
    vocab = min([dict(s.config).get("vocab_size", 32000) for s in (gpu.sources.values()
                 if gpu else ()) if s.kind == "random"] + [32000])
    total = sum(len(s.steps) for s in specs)
    done = submitted = 0

    def report() -> None:  # done of total; of the rest, queued and running (others think)
        if progress:
            running = min(log.running, submitted - done)
            progress(done, total, queued=submitted - done - running, running=running)

    wall0 = time.perf_counter()
    measured: dict[str, Mapping[str, Any]] = {}

    def prepare(step: Step) -> Action:  # called just before the action is submitted
        nonlocal submitted
        action = with_work(step)
        submitted += 1
        report()
        return with_request(action, vocab, gpu_tokens) if action.service else action

    def ended(action: Action, result: tuple[Record, Outcome]) -> None:
        nonlocal done
        if action.service:
            measured[action.id] = result[1].extra
        done += 1
        report()

    door = LiveDoor(executor)
    t0 = executor.clock.now()
    try:
        await until_failure(executor, asyncio.gather(
            *(drive(play(s, door, prepare, ended)) for s in specs)))
    finally:
        executor.shutdown()
        log.write(out / "outputs.jsonl")
    rollout = executor.clock.now() - t0
    final = executor.snapshot(detail=False)
    records = executor.runtime.records
    counters: dict[str, Any] = {"backend": backend, "live": True, "think_scale": think_scale,
                                "gpu_restores": final.counters["gpu_restores"],
                                "scheduler_passes": final.counters["scheduler_passes"],
                                "lane_moves": final.counters["lane_moves"],
                                "trajectories_reclaimed": final.counters["trajectories_reclaimed"]}
    if gpu_backend is not None:
        spans = {r.action_id: r.end_s - r.start_s for r in records}
        records, counters["gpu"] = measured_restores(records, measured, gpu_backend)
        cluster = replace(cluster, extra={**cluster.extra,
                                          "gpu_measured": after_run(costs, spans, measured)})
    result = RunResult(policy.label, records,
                       [{"step": 0, "rollout_s": rollout, "step_s": rollout}],
                       dict(final.capacity), counters, executor.runtime.timing, None,
                       time.perf_counter() - wall0, final)
    config = {"backend": backend, "ray": live is not None, "cluster": cluster.to_yaml(),
              "limit": limit,
              "think_scale": think_scale, "policy": policy.params()}
    if gpu is not None:
        config["gpu"] = {"device": gpu_device, "tokens": gpu_tokens,
                         "models": {n: {"loader": s.kind, "config": dict(s.config),
                                        "path": s.path, "seed": s.seed}
                                    for n, s in gpu.sources.items()}}
    return result, config


class RunFailed(RuntimeError):
    """An effect could not be carried out during a run (the message names it, and the
    action it was for): the run stops there instead of waiting for what never ends."""


async def until_failure(executor: LiveExecutor, players: asyncio.Future) -> None:
    """Await ``players``; the first effect that fails to be carried out stops them and
    raises RunFailed (its action ended failed with the error: nothing would hang on it,
    but a run whose effects fail measures nothing worth waiting for)."""
    failed = asyncio.ensure_future(executor.failed.wait())
    try:
        await asyncio.wait((players, failed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        failed.cancel()
    if not players.done():
        players.cancel()
        await asyncio.gather(players, return_exceptions=True)
        first = executor.failures[0]
        more = f" (and {len(executor.failures) - 1} more)" if len(executor.failures) > 1 else ""
        raise RunFailed(f"{first}{more}")
    players.result()


def with_request(action: Action, vocab: int, n_tokens: int) -> Action:
    """A trace's GPU row as a real request: a judge/reward kind asks for a score, any other
    kind (teacher) for log-probs of ``n_tokens`` tokens drawn from the action's id."""
    rng = np.random.default_rng(zlib.crc32(action.id.encode()))
    tokens = rng.integers(0, min(vocab, 32000), size=max(n_tokens, 2)).tolist()
    op = "score" if any(w in action.kind for w in ("judge", "reward")) else "logprobs"
    return replace(action, payload={**(action.payload or {}), "op": op, "tokens": [tokens]})


def measured_restores(records: list[Record], measured: Mapping[str, Mapping[str, Any]],
                      gpu: GpuBackend) -> tuple[list[Record], dict[str, Any]]:
    """GPU records with the restore time the worker measured instead of the core's model,
    and the two side by side (counts, seconds, bytes, evictions) for the summary."""
    modelled_n, modelled_s = 0, 0.0
    out = []
    for rec in records:
        extra = measured.get(rec.action_id)
        if extra is not None and rec.batch_of in ("", rec.action_id):  # a batch: once
            modelled_n += rec.restore_s > 0
            modelled_s += rec.restore_s
        if extra is not None:
            rec = replace(rec, restore_s=float(extra.get("restore_s", 0.0)))
        out.append(rec)
    snap = gpu.snapshot()
    seconds = sum(s["restore_seconds"] for s in snap["services"].values())
    nbytes = sum(s["restore_bytes"] for s in snap["services"].values())
    return out, {"device": gpu.device, "actions": len(measured),
                 "restores_measured": sum(s["restores"] for s in snap["services"].values()),
                 "restore_s_measured": seconds, "restore_bytes": nbytes,
                 "restore_gbps_measured": nbytes / 1e9 / seconds if seconds > 0 else None,
                 "restores_modelled": modelled_n, "restore_s_modelled": modelled_s,
                 "evictions": sum(s["evictions"] for s in snap["services"].values()),
                 "worker_crashes": snap["crashes"], "residency_mismatches": snap["mismatches"],
                 "per_service": snap["services"]}
