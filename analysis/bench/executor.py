"""Per-action overhead of the live backends (``tangram bench executor``)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, BenchError, Opt, Progress
from executor.backends.registry import make_backend
from executor.driver import LiveExecutor
from executor.node.local import local_cluster
from tangram.core import Tangram
from tangram.model import Action, Demand


def executor_bench(backend: str, n: int = 60, long_n: int = 5, long_s: float = 1.0,
                   progress: Progress = QUIET) -> dict:
    """Per-action overhead of a live backend, measured around real commands.

    The command prints the wall clock at its first and last instruction, so
    ``start overhead = command start - submit`` and ``end overhead = result
    delivered - command end`` include the scheduler, the backend and (docker)
    the cgroup update and exec, but not the command's own work.
    """
    async def go() -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            ex = LiveExecutor(Tangram(local_cluster()), make_backend(backend, Path(tmp)))
            try:
                return {"backend": backend,
                        **await overheads(ex, n, long_n, long_s, progress)}
            finally:
                ex.shutdown()

    return asyncio.run(go())


async def overheads(ex: LiveExecutor, n: int, long_n: int = 5, long_s: float = 1.0,
                    progress: Progress = QUIET) -> dict:
    """Sequential short actions on one trajectory (see :func:`executor_bench`)."""
    ex.open_trajectory("bench", "bench", 0.25)
    starts, ends, updates, fractions, totals = [], [], [], [], []
    try:
        for i in range(n + long_n + 1):
            progress(i, n + long_n + 1)
            sleep = long_s if i > n else 0.0
            cmd = f"sh -c 'date +%s.%N; sleep {sleep}; date +%s.%N'"
            action = Action(f"b{i}", "bench", "bench", "shell", {"cpu": Demand.fixed(1)},
                            payload={"command": cmd})
            t_submit = time.time()
            rec, out = await ex.run(action)
            t_done = time.time()
            first, last = (float(x) for x in out.output.split())
            if i == 0:
                continue  # the first action creates the environment (container)
            if i <= n:
                starts.append((first - t_submit) * 1e3)
                ends.append((t_done - last) * 1e3)
                # clock-independent: valid when the command ran on another machine
                totals.append(((t_done - t_submit) - (last - first)) * 1e3)
                if "update_s" in out.extra:
                    updates.append(out.extra["update_s"] * 1e3)
            else:
                fractions.append(((first - t_submit) + (t_done - last)) / (last - first))
        progress(n + long_n + 1, n + long_n + 1)
    finally:
        ex.close_trajectory("bench")
    s, e, t = np.asarray(starts), np.asarray(ends), np.asarray(totals)
    res = {"actions": n,
           "submit_to_start_p50_ms": round(float(np.percentile(s, 50)), 2),
           "submit_to_start_p99_ms": round(float(np.percentile(s, 99)), 2),
           "end_to_result_p50_ms": round(float(np.percentile(e, 50)), 2),
           "end_to_result_p99_ms": round(float(np.percentile(e, 99)), 2),
           "overhead_p50_ms": round(float(np.percentile(t, 50)), 2),
           "overhead_p99_ms": round(float(np.percentile(t, 99)), 2),
           f"overhead_fraction_of_{long_s:g}s_actions": round(float(np.mean(fractions)), 4)}
    if updates:
        u = np.asarray(updates)
        res["cgroup_update_p50_ms"] = round(float(np.percentile(u, 50)), 2)
        res["cgroup_update_p99_ms"] = round(float(np.percentile(u, 99)), 2)
    return res


async def throughput(ex: LiveExecutor, n: int, trajectories: int) -> dict:
    """``n`` no-op actions (``true``) from ``trajectories`` closed-loop trajectories
    at once: completed actions per second, and how they spread over the nodes."""
    per = -(-n // trajectories)
    nodes: dict[str, int] = {}

    async def one(j: int) -> None:
        ex.open_trajectory(f"tp{j}", "bench", 0.05)
        try:
            for i in range(per):
                rec, out = await ex.run(Action(f"tp{j}-{i}", "bench", f"tp{j}", "shell",
                                               {"cpu": Demand.fixed(1)}, payload={"argv": ["true"]}))
                if out.status != "ok":
                    raise RuntimeError(f"bench action failed: {out.error}")
                nodes[rec.node or "-"] = nodes.get(rec.node or "-", 0) + 1
        finally:
            ex.close_trajectory(f"tp{j}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(j) for j in range(trajectories)))
    wall = time.perf_counter() - t0
    return {"actions": per * trajectories, "trajectories": trajectories,
            "actions_per_s": round(per * trajectories / wall, 1),
            "actions_per_node": dict(sorted(nodes.items()))}


def ray_executor_bench(ray: str, backend: str = "process", n: int = 60,
                       tp_actions: int = 300) -> list[dict]:
    """The same overheads and throughput on this machine's local executor and through
    Ray node agents (``ray`` as for ``--ray``). Rows: local, then ray."""
    from executor.backends.ray.backend import RayBackend
    from executor.backends.ray.cluster import connect

    async def measure(make) -> dict:
        ex, cores = make()
        try:
            row = await overheads(ex, n)
            tp = await throughput(ex, tp_actions, 2 * cores)
            return {**row, **{f"throughput_{k}": v for k, v in tp.items()}}
        finally:
            ex.shutdown()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        def local():
            cluster = local_cluster()
            ex = LiveExecutor(Tangram(cluster), make_backend(backend, Path(tmp)))
            return ex, sum(c.cores for c in cluster.cpu_nodes)

        rows.append({"via": "local", "backend": backend, "nodes": 1,
                     **asyncio.run(measure(local))})
    t0 = time.perf_counter()
    ray_backend = RayBackend(connect(ray), backend, owns_connection=True)
    start_s = time.perf_counter() - t0
    cluster = ray_backend.cluster()

    def via_ray():
        return (LiveExecutor(Tangram(cluster), ray_backend),
                sum(c.cores for c in cluster.cpu_nodes))

    rows.append({"via": "ray-agent", "ray": ray, "backend": backend,
                 "nodes": len(cluster.cpu_nodes), "ray_start_s": round(start_s, 2),
                 **asyncio.run(measure(via_ray))})
    return rows


def command(
    backend: Annotated[str, Opt("process, docker or all.")] = "all",
    actions: Annotated[int, Opt("Short actions timed per backend.", min=5)] = 60,
    ray: Annotated[str | None, Opt(
        "Run on a Ray cluster, as `tangram run --ray` (auto, HOST:PORT, ray://HOST:PORT or "
        "local:N; needs the ray extra). Compares local vs via agents.")] = None,
    progress: Progress = QUIET,
) -> Iterator[dict]:
    """With --ray: the same figures on this machine's executor and through Ray node agents
    (p50/p99), plus dispatch throughput across the nodes."""
    if ray is not None:
        from executor.backends.ray.cluster import RaySpec, RayUnavailable, require_ray

        try:
            RaySpec.parse(ray)
            require_ray()
            progress.phase(f"local, then via Ray ({ray})")
            yield from ray_executor_bench(ray, "process" if backend == "all" else backend,
                                          actions)
        except (ValueError, RayUnavailable, ConnectionError, RuntimeError) as e:
            raise BenchError(str(e)) from None
        return
    for name in (("process", "docker") if backend == "all" else (backend,)):
        progress.phase(f"the {name} backend")
        yield executor_bench(name, actions, progress=progress)
