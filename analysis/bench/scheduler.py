"""`tangram bench scheduler` (a benchmark, not a timed test): queues 2,048 actions at
once and drives the core in virtual time until every one has run, timing every core call
(each one scheduling pass plus its bookkeeping) by wall clock and by this thread's CPU
time; per dispatch beside a plain FIFO dispatcher's on the same actions, and a
closed-loop run with learning beside a bare SimPy model (floor.py). Where the time goes,
profile by profile: docs/evidence/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, Opt, Progress
from sim.clock import SimClock
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterSpec, CpuNodeSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand, Elasticity
from tangram.runtime import Runtime


def pin_one_core() -> int | None:
    """Run on one core, as the targets are stated for one core; and freeze the objects
    imports created so the cyclic GC stops rescanning them (what `serve` and
    `simulate` do too)."""
    gc.collect()
    gc.freeze()
    try:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return core
    except (AttributeError, OSError):
        return None


def cpu_scenario(n: int, rng: np.random.Generator) -> tuple[ClusterSpec, list[Action]]:
    cluster = ClusterSpec(cpu_nodes=(CpuNodeSpec("cpu0", 256, 2, 2400.0),))
    actions = []
    for i in range(n):
        if rng.random() < 0.2:
            hi = int(rng.integers(1, 33))
            actions.append(Action(
                f"a{i}", "coding", f"j{i}", "test_run", {"cpu": Demand.range(1, hi)},
                elastic="cpu", t1_s=float(rng.uniform(5, 120)),
                elasticity=Elasticity.amdahl(float(rng.uniform(0.8, 0.98)))))
        else:
            actions.append(Action(f"a{i}", "coding", f"j{i}", "shell", {"cpu": Demand.fixed(1)},
                                  t1_s=float(10 ** rng.uniform(-3, np.log10(2)))))
    return cluster, actions


def gpu_scenario(n: int, rng: np.random.Generator) -> tuple[ClusterSpec, list[Action]]:
    services = tuple(ServiceSpec(f"svc{k}", float(rng.choice([16, 30, 60, 120]))) for k in range(12))
    cluster = ClusterSpec(gpu_nodes=tuple(GpuNodeSpec(f"gpu{k}", 8, 141.0) for k in range(5)),
                          services=services, restore_gbps=25.0)
    actions = []
    for i in range(n):
        svc = services[int(rng.integers(0, 12))]
        choices = [c for c in (1, 2, 4, 8) if svc.size_gb / c <= 141.0 * 0.8]
        actions.append(Action(
            f"a{i}", "mopd", f"j{i}", "teacher_logprob", {"gpu": Demand.discrete(choices)},
            elastic="gpu", t1_s=float(rng.uniform(0.5, 20)),
            elasticity=Elasticity.amdahl(float(rng.uniform(0.7, 0.95))), service=svc.name))
    return cluster, actions


def run_scheduler_scenario(name: str, cluster: ClusterSpec, actions: list[Action],
                           stopwatch=time.perf_counter) -> dict:
    """Queue every action at t=0 in one batch (one pass over a 2,048-deep queue: the
    burst), then run in virtual time (SimClock + the modelled backend) until all have
    run, each finish followed by its trajectory's close (one action per trajectory).
    Every core call is timed by the runtime's stopwatch (wall clock by default;
    ``time.thread_time`` counts only this thread's CPU, not time the OS gave to other
    processes on a shared machine)."""
    core = Tangram(cluster)
    clock = SimClock()
    runtime = Runtime(core, clock, ModelledBackend(clock, np.random.default_rng(0)),
                      stopwatch=stopwatch)
    for a in actions:
        runtime.open_trajectory(a.trajectory, a.task, mem_gb=1.0)
    # keep every call's seconds and dispatch count from the burst on (the opens before it
    # are timed calls too since the core's one door, but not scheduling passes: counted,
    # they made the first open "the burst" and diluted the figures)
    runtime.timing.calls = []
    runtime.submit_many(actions, lambda rec, out: runtime.close_trajectory(rec.trajectory))
    clock.run()
    calls = runtime.timing.calls
    assert len(runtime.records) == len(actions)
    burst_s, burst = calls[0]
    arr = np.asarray([c[0] for c in calls]) * 1e6
    dispatched = sum(c[1] for c in calls)
    return {
        "scenario": name,
        "actions": len(actions),
        "dispatched": dispatched,
        "calls": len(calls),
        "burst_dispatched": burst,
        "burst_pass_us": round(burst_s * 1e6, 1),
        "burst_dispatch_per_s": round(burst / burst_s, 1),
        "pass_p50_us": round(float(np.percentile(arr, 50)), 1),
        "pass_p99_us": round(float(np.percentile(arr, 99)), 1),
        "pass_max_us": round(float(arr.max()), 1),
        "dispatch_per_s": round(dispatched / (arr.sum() / 1e6), 1),
        # what the schedule was (the GPU scenario: restores under the EOE rules)
        "act_mean_s": round(float(np.mean([r.act_s for r in runtime.records])), 3),
        "gpu_restores": core.snapshot(detail=False).counters["gpu_restores"],
        "batched_actions": sum(1 for r in runtime.records if r.batch_of),
    }


def fifo_cpu_s(cluster: ClusterSpec, actions: list[Action]) -> float:
    """This thread's CPU seconds for a plain FIFO dispatcher to run ``actions`` on the same
    virtual clock: one queue, each action its minimum units of its key resource when they
    are free, in order, for its declared duration; no placement, no elasticity, no records.
    The floor that ``tangram bench scheduler``'s per-dispatch CPU is divided by (absolute
    figures move up to 3x between machines; a ratio measured in the same process does not)."""
    clock = SimClock()
    free = {"cpu": float(sum(n.cores for n in cluster.cpu_nodes)),
            "gpu": float(sum(g.gpus for g in cluster.gpu_nodes))}
    queue = deque(actions)

    def key(a: Action) -> tuple[str, float]:
        return ("gpu", a.min("gpu")) if a.min("gpu") > 0 else ("cpu", a.min("cpu"))

    def start_ready() -> None:
        while queue:
            res, units = key(queue[0])
            if free[res] < units:
                return
            a = queue.popleft()
            free[res] -= units
            clock.call_later(a.t1_s or 0.0, lambda res=res, units=units: finish(res, units))

    def finish(res: str, units: float) -> None:
        free[res] += units
        start_ready()

    t0 = time.thread_time()
    start_ready()
    clock.run()
    return time.thread_time() - t0


def scheduler_bench(n: int = 2048, seed: int = 0, progress: Progress = QUIET) -> Iterator[dict]:
    core = pin_one_core()
    scenarios = (("cpu-node-256c", cpu_scenario), ("gpu-5x8-12svc", gpu_scenario))
    total = len(scenarios) + 1  # and the closed loop
    for i, (name, build) in enumerate(scenarios):
        progress(i, total)
        progress.phase(f"{name}, {n} actions")
        cluster, actions = build(n, np.random.default_rng(seed))
        out = run_scheduler_scenario(name, cluster, actions)
        # the same run timed by CPU time of this thread (the schedule is identical)
        cpu = run_scheduler_scenario(name, cluster, actions, stopwatch=time.thread_time)
        out["cpu_time_dispatch_per_s"] = cpu["dispatch_per_s"]
        out["cpu_time_pass_p99_us"] = cpu["pass_p99_us"]
        out["cpu_time_burst_pass_us"] = cpu["burst_pass_us"]
        # per dispatch, CPU time: the core's, and a plain FIFO dispatcher's on the same
        # actions and clock, in this process a moment apart (the ratio holds across machines)
        per = 1e6 / cpu["dispatch_per_s"]
        fifo = 1e6 * fifo_cpu_s(cluster, actions) / len(actions)
        out["cpu_us_per_dispatch"] = round(per, 2)
        out["fifo_cpu_us_per_dispatch"] = round(fifo, 2)
        out["ratio_to_fifo"] = round(per / fifo, 2)
        out["load_avg_1m"] = round(os.getloadavg()[0], 2)
        out["pinned_core"] = core
        progress(i + 1, total)
        yield out
    progress.phase("closed loop with learning")
    row = closed_loop_scenario(seed)
    progress(total, total)
    yield row


def closed_loop_scenario(seed: int = 0, trajectories_n: int = 256) -> dict:
    """Many actions per trajectory with learning on: a generated AI-coding batch (about 30
    actions a trajectory; the unprofiled ones' durations learnt as they finish) simulated
    closed-loop on the paper cluster. The core's CPU per dispatch (its thread's CPU clock)
    beside the bare SimPy model of the same trace and loop (analysis/bench/floor.py's floor)."""
    from analysis.bench.floor import floor_model
    from sim.cluster import load_cluster
    from sim.driver import SimConfig, simulate
    from traces.generate import generate
    from traces.schema import trajectories, validate

    df = validate(generate("coding", trajectories_n, seed))
    cluster = load_cluster("paper")
    result = simulate(df, cluster, SimConfig(seed=seed))
    n = len(result.records)
    capacity = {"cpu": float(sum(nd.cores for nd in cluster.cpu_nodes)),
                "gpu": float(sum(g.gpus for g in cluster.gpu_nodes))}
    specs = list(trajectories(df))
    t0 = time.thread_time()
    floor_model(specs, capacity)
    floor_us = 1e6 * (time.thread_time() - t0) / n
    core_us = 1e6 * result.timing.core_s / n
    return {"scenario": f"coding-{trajectories_n}x~30-closed-loop-learning", "actions": n,
            "cpu_us_per_dispatch": round(core_us, 2),
            "floor_cpu_us_per_action": round(floor_us, 2),
            "ratio_to_floor": round(core_us / floor_us, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def command(actions: Annotated[int, Opt("Queued actions per scenario.")] = 2048,
            seed: int = 0, progress: Progress = QUIET) -> Iterator[dict]:
    """Every figure twice: wall clock and this thread's CPU time; per dispatch beside a
    plain FIFO dispatcher's, and a closed-loop run with learning beside a bare SimPy model."""
    yield from scheduler_bench(actions, seed, progress)
