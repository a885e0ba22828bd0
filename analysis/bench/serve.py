"""`tangram bench serve` and `tangram bench serve-scale`: load on a real `tangram serve`
subprocess, client and server on this machine: the server's CPU per action (from /proc),
throughput, first-action latency and RSS over the run; at the paper's scale, sampled
over time."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, Opt, Progress
from analysis.bench.serving import stop, wait_healthy


def _proc_stat(pid: int) -> tuple[float, float, float]:
    """(CPU seconds, its reaped children's CPU seconds, RSS MiB) of a process and its
    threads. The children's is what starting the actions cost in them (the commands are
    ``true``): the exec chain before the command, and the command's own exec."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    children = (int(fields[13]) + int(fields[14])) / tick
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return cpu, children, rss


async def _trajectories(url: str, token: str, ids: list[int], actions: int,
                        on_action: Callable[[], None]) -> tuple[list, list, list, list]:
    """Trajectories ``t<i>`` at once, each ``actions`` trivial commands one after another:
    (first-action latencies, later ones, errors, the first actions' time in the server's
    core: queued + executing, as each result reports it)."""
    from tangram_sdk.client import TangramClient

    first: list[float] = []
    later: list[float] = []
    errors: list[str] = []
    first_core: list[float] = []
    async with TangramClient(url, token, timeout_s=600) as tg:
        async def one(i: int) -> None:
            try:
                tid = await tg.open_trajectory(f"t{i}")
                for k in range(actions):
                    a = time.perf_counter()
                    res = await tg.run(tid, action_id=f"t{i}-{k}", argv=["true"])
                    (first if k == 0 else later).append(time.perf_counter() - a)
                    if k == 0:
                        first_core.append((res.get("queue_s") or 0.0) + (res.get("exec_s") or 0.0))
                    if res["status"] != "ok":
                        errors.append(res["status"] + ": " + res["error"][:100])
                    on_action()
                await tg.close_trajectory(tid)
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(f"{type(e).__name__}: {e}"[:200])

        await asyncio.gather(*(one(i) for i in ids))
    return first, later, errors, first_core


def _client_process(url: str, token: str, ids: list[int], actions: int, done, go,
                    results) -> None:
    """One client process of a multi-client run: ready, then its trajectories."""
    def count() -> None:
        with done.get_lock():
            done.value += 1

    results.put(("ready", None))
    go.wait()
    c0 = time.process_time()
    out = asyncio.run(_trajectories(url, token, ids, actions, count))
    results.put(("done", (*out, time.process_time() - c0)))


async def _next(results, procs: list) -> tuple:
    """The next message of the client processes (RuntimeError if one died silently)."""
    import queue

    while True:
        try:
            return await asyncio.to_thread(results.get, True, 1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a bench client process died (exit codes {dead})") from None


def serve_bench(backend: str = "process", trajectories: int = 64, actions: int = 5,
                warm: int = 0, samples: int = 10, every_s: float | None = None,
                on_sample: Callable[[dict], None] | None = None, clients: int = 1,
                progress: Progress = QUIET) -> dict:
    """Load on a real `tangram serve` subprocess, client and server on this machine.

    ``trajectories`` run concurrently, each opening, running ``actions`` trivial
    commands (``true``) one after another and closing. Reported: the server's CPU
    time per action (from /proc, so the client's own cost is excluded), throughput,
    the latency of each trajectory's first action (container start for docker,
    unless the warm pool has one ready) and of later ones, the server's RSS over
    the run (``samples`` points), and any client-side connection error.

    ``every_s``: also sample over time, every that many seconds, the actions done,
    the throughput and the server's CPU per action in the interval, and its RSS
    (``timeline``; each sample is passed to ``on_sample`` as it is taken), so a long
    run shows whether throughput holds and memory stays flat. The client's own CPU
    time is reported too: client and server share this machine's cores.

    ``clients``: the trajectories spread over that many client processes (as over an RL
    job's rollout workers; one asyncio client driving thousands of connections spends
    more CPU on its connection pool than the server spends on the actions).
    """
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "bench-" + os.urandom(8).hex()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "cli", "serve", "--port", str(port), "--backend", backend,
               "--state-dir", tmp, "--warm-pool", str(warm)]
        log = Path(tmp) / "server.log"
        proc = subprocess.Popen(cmd, env={**os.environ, "TANGRAM_TOKEN": token},
                                stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                cwd=Path(__file__).parents[2])
        try:
            return asyncio.run(_drive(proc, f"http://127.0.0.1:{port}", token, backend,
                                      trajectories, actions, warm, samples, log,
                                      every_s, on_sample, clients, progress))
        finally:
            stop(proc)


async def _warm_pool_full(workdir: Path, warm: int, proc, within_s: float = 120.0) -> None:
    """Wait until the docker server's warm pool holds ``warm`` running sandboxes (its
    containers: the owner label of executor/backends/registry.make_backend, no trajectory yet)."""
    import hashlib

    import docker

    owner = hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16]
    client = docker.from_env()
    labels = [f"tangram.owner={owner}", "tangram.trajectory="]
    deadline = time.time() + within_s
    while len(client.containers.list(sparse=True, filters={"label": labels})) < warm:
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the server's warm pool did not fill to {warm} sandboxes "
                               f"within {within_s:g} s")
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # the last one's agent listening and its cgroup set
    client.close()


async def _drive(proc, url: str, token: str, backend: str, trajectories: int,
                 actions: int, warm: int, samples: int, log: Path,
                 every_s: float | None = None,
                 on_sample: Callable[[dict], None] | None = None, clients: int = 1,
                 progress: Progress = QUIET) -> dict:
    """The measured run: the server warmed up, the clients ready, the clock started, the
    trajectories driven (sampled meanwhile), the figures reported."""
    import multiprocessing

    pid = proc.pid
    progress.phase(f"starting a {backend} server")
    await asyncio.to_thread(wait_healthy, url, proc, log, 60.0)
    progress.phase("warming it up")
    await _warm_up(url, token)
    if warm:  # the pool full before timing (what a long-running server sees)
        progress.phase(f"filling its warm pool ({warm} sandboxes)")
        await _warm_pool_full(log.parent / "work", warm, proc)
    total = trajectories * actions
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Value("q", 0)  # actions done, over every client
    results = ctx.Queue()
    go = ctx.Event()
    procs = await _start_clients(ctx, url, token, trajectories, actions, clients, done, go,
                                 results)
    sampler = _Sampler(pid, done, max(total // samples, 1), on_sample)
    ticking = asyncio.ensure_future(sampler.every(every_s)) if every_s else None
    progress.phase(f"{trajectories} trajectories x {actions} actions")
    watching = asyncio.ensure_future(_watch(done, total, progress))
    try:
        if procs:
            go.set()
            first, later, errors, core, client_cpu = await _gather(results, procs)
        else:
            first, later, errors, core = await _trajectories(
                url, token, list(range(trajectories)), actions, sampler.count)
            client_cpu = 0.0
    finally:
        watching.cancel()
        if ticking is not None:
            ticking.cancel()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    if ticking is not None:
        sampler.take()  # the end of the run (also: a run shorter than one interval)
    wall = time.perf_counter() - sampler.t0
    client_cpu += time.process_time() - sampler.client0
    progress(done.value, total)
    run = {"bench": "serve", "backend": backend, "trajectories": trajectories,
           "actions_per_trajectory": actions, "actions": total, "warm_pool": warm,
           "clients": clients}
    return _report(run, sampler, wall, client_cpu, first, later, core, errors, bool(every_s))


async def _watch(done, total: int, progress: Progress) -> None:
    """The actions done so far (over every client), told to ``progress`` once a second."""
    while True:
        progress(done.value, total)
        await asyncio.sleep(1.0)


async def _warm_up(url: str, token: str) -> None:
    """Imports and first-call paths out of the measurement (before the warm pool fills:
    the sandbox it takes is replaced before the clock starts)."""
    from tangram_sdk.client import TangramClient

    async with TangramClient(url, token, timeout_s=600) as tg:
        tid = await tg.open_trajectory("warmup")
        await tg.run(tid, argv=["true"])
        await tg.close_trajectory(tid)


async def _start_clients(ctx, url: str, token: str, trajectories: int, actions: int,
                         clients: int, done, go, results) -> list:
    """``clients`` client processes (none for one: the trajectories are driven here),
    started and ready before the clock starts; they begin at ``go``."""
    if clients <= 1:
        return []
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(url, token, list(range(c, trajectories, clients)), actions,
                               done, go, results)) for c in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        await _next(results, procs)
    return procs


async def _gather(results, procs: list) -> tuple[list, list, list, list, float]:
    """The client processes' latencies (first actions, later ones, the core's part of the
    first), errors and CPU seconds, all of them together."""
    first, later, errors, core = [], [], [], []
    client_cpu = 0.0
    for _ in procs:
        _, (f1, l1, e1, k1, c1) = await _next(results, procs)
        first += f1
        later += l1
        errors += e1
        core += k1
        client_cpu += c1
    return first, later, errors, core, client_cpu


class _Sampler:
    """The server process's CPU and RSS while the run goes: its start (made at the start of
    the clock), a row per interval (``timeline``), and an RSS figure every ``step``
    actions done."""

    def __init__(self, pid: int, done, step: int,
                 on_sample: Callable[[dict], None] | None) -> None:
        self.pid, self.done, self.step, self.on_sample = pid, done, step, on_sample
        self.cpu0, self.kids0, rss0 = _proc_stat(pid)
        self.rss = [round(rss0, 1)]
        self.timeline: list[dict] = []
        self.t0 = time.perf_counter()
        self.client0 = time.process_time()
        #: time, actions done, server and children CPU of the last sample
        self.last = [self.t0, 0, self.cpu0, self.kids0]

    def take(self) -> None:
        done, last = self.done, self.last
        now, (cpu, kids, rss_now) = time.perf_counter(), _proc_stat(self.pid)
        n = done.value - last[1]
        row = {"t_s": round(now - self.t0, 2), "actions_done": done.value,
               "actions_per_s": round(n / max(now - last[0], 1e-9), 1),
               "server_cpu_ms_per_action": round((cpu - last[2]) * 1e3 / n, 3) if n else None,
               "children_cpu_ms_per_action": round((kids - last[3]) * 1e3 / n, 3) if n
               else None,
               "server_rss_mb": round(rss_now, 1),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        self.timeline.append(row)
        if self.on_sample is not None:
            self.on_sample(row)
        last[:] = [now, done.value, cpu, kids]

    async def every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.take()

    def count(self) -> None:
        """One action done (by a trajectory driven in this process)."""
        self.done.value += 1
        if self.done.value % self.step == 0:
            self.rss.append(round(_proc_stat(self.pid)[2], 1))


def _report(run: dict, sampler: _Sampler, wall: float, client_cpu: float, first: list,
            later: list, core: list, errors: list, timeline: bool) -> dict:
    """The run's figures: throughput, the server's CPU and RSS, latency percentiles."""
    total = run["actions"]
    cpu1, kids1, rss1 = _proc_stat(sampler.pid)
    f, lt, fc = (np.asarray(x or [0.0]) for x in (first, later, core))
    extra: dict = {}
    if timeline:
        rows = sampler.timeline
        extra = {"timeline": rows,
                 # flat RSS: what the server grew by from the first sample to the last
                 "server_rss_growth_mb": round(rss1 - rows[0]["server_rss_mb"], 1)
                 if rows else None}
    clients = run.pop("clients")
    return {**run,
            "wall_s": round(wall, 2), "actions_per_s": round(total / wall, 1),
            "server_cpu_ms_per_action": round((cpu1 - sampler.cpu0) * 1e3 / total, 3),
            # (0 on docker: the commands run in containers, not as the server's children)
            "children_cpu_ms_per_action": round((kids1 - sampler.kids0) * 1e3 / total, 3),
            "first_action_p50_ms": round(float(np.percentile(f, 50)) * 1e3, 1),
            "first_action_p99_ms": round(float(np.percentile(f, 99)) * 1e3, 1),
            "first_action_p99_over_p50": round(float(np.percentile(f, 99)
                                                     / max(np.percentile(f, 50), 1e-9)), 2),
            # of the first actions' latency, what the server's core saw (queued + running);
            # the rest is HTTP, the event loops and the client
            "first_action_core_p50_ms": round(float(np.percentile(fc, 50)) * 1e3, 1),
            "first_action_core_p99_ms": round(float(np.percentile(fc, 99)) * 1e3, 1),
            "later_action_p50_ms": round(float(np.percentile(lt, 50)) * 1e3, 1),
            "server_rss_mb": sampler.rss + [round(rss1, 1)], "errors": len(errors),
            "first_errors": errors[:3], "cpus": os.cpu_count(),
            "clients": clients, "client_cpu_ms_per_action": round(client_cpu * 1e3 / total, 3),
            "load_avg_1m": round(os.getloadavg()[0], 2), **extra}


def command(
    backend: Annotated[str, Opt("process or docker.")] = "process",
    trajectories: Annotated[int, Opt("Concurrent trajectories.", min=1)] = 64,
    actions: Annotated[int, Opt("Trivial actions per trajectory.", min=1)] = 5,
    warm_pool: Annotated[int, Opt("docker: the server's --warm-pool.", min=0)] = 0,
    progress: Progress = QUIET,
) -> Iterator[dict]:
    """For a soak: many actions, e.g. --trajectories 200 --actions 100 (20,000 actions)."""
    yield serve_bench(backend, trajectories, actions, warm_pool, progress=progress)


def scale_command(
    trajectories: Annotated[int, Opt("Concurrent trajectories.", min=1)] = 2048,
    actions: Annotated[int, Opt("Trivial actions per trajectory.", min=1)] = 30,
    every: Annotated[float, Opt("Seconds between samples.", min=0.5)] = 10.0,
    clients: Annotated[int, Opt(
        "Client processes the trajectories are spread over (as rollout workers; one "
        "asyncio client cannot drive thousands of connections).", min=1)] = 8,
    progress: Progress = QUIET,
) -> Iterator[dict]:
    """By default 2,048 trajectories x 30 trivial actions (`true`) at once. Prints a JSON
    line every --every seconds (actions done, actions/s and server CPU per action in the
    interval, server RSS), then the run's summary (`tangram bench serve`'s figures, the
    timeline, and how much the server's RSS grew from the first sample to the end). Takes
    minutes: the actions run on this machine's cores."""
    import json

    def show(row: dict) -> None:  # a sample, printed as it is taken (the run blocks)
        print(json.dumps({"sample": True, **row}), flush=True)

    yield serve_bench("process", trajectories, actions, every_s=every, on_sample=show,
                      clients=clients, progress=progress)
