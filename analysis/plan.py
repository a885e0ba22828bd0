"""`tangram plan`: the smallest cluster that meets a target on a trace, per policy.

The trace is a recording (`tangram serve --record`) or any trace; the cluster the run had
(``<stem>-cluster.yaml``) gives the shape of a node (memory per core, NUMA domains, GPUs
per GPU node, services, quotas), and the search changes how many nodes there are and how
many cores each has:

* **Resamplings.** Each of ``resamples`` (>= 5) draws ``trajectories`` of the trace's
  trajectories with replacement (a bootstrap; ``trajectories`` larger than the trace plans
  for a larger batch). Each resampling is searched on its own, so the answer is an
  interval: the smallest size over the resamplings, their median and largest.
* **Sizes by bisection.** For each policy, node shape (cores per node) and resampling, the
  number of CPU nodes is found by bisection (from an estimate scaled from the recorded
  cluster, doubled until the target is met, then halved down to the boundary); with GPU
  rows, then the number of GPU nodes the same way at that CPU size. Bisection assumes the
  metric does not grow with capacity; tests/test_plan.py checks it agrees with a sweep of
  every size on a generated trace.
* **In parallel.** Every search asks for its next simulation each round, and the round's
  simulations run on a process pool; a simulation is never run twice.

The frontier is every simulated size of the chosen shape: capacity (cores) against the
target's metric, one line per policy (median over resamplings, and their range).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from tangram.cluster import ClusterSpec, GpuNodeSpec

#: target metric -> (what a run's metrics call it, what it means)
METRICS: dict[str, tuple[str, str]] = {
    "step": ("step_s", "step time: the batch's first open to its last action's end"),
    "p99": ("p99_act_s", "99th percentile of action completion time (queue + execution)"),
    "mean_act": ("mean_act_s", "mean action completion time (queue + execution)"),
}
UNITS_S = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
#: the fewest resamplings an interval is given over
MIN_RESAMPLES = 5

_TARGET = re.compile(r"^\s*([a-z_0-9]+)\s*<=\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


class PlanError(ValueError):
    """A plan cannot be made as asked (the message names the option and what is accepted)."""


@dataclass(frozen=True)
class Target:
    metric: str  # a key of METRICS
    bound_s: float

    def met(self, metrics: dict[str, float]) -> bool:
        value = metrics.get(METRICS[self.metric][0])
        return value is not None and not math.isnan(value) and value <= self.bound_s

    def value(self, metrics: dict[str, float]) -> float:
        return float(metrics.get(METRICS[self.metric][0], math.nan))

    def __str__(self) -> str:
        return f"{self.metric}<={self.bound_s:g}s"


def parse_target(text: str) -> Target:
    """``step<=300s``, ``p99<=20s``, ``mean_act<=5s`` (a unit of s, m or h; none: s)."""
    accepted = ("accepted: step<=SECONDS, p99<=SECONDS or mean_act<=SECONDS, with an "
                "optional unit s, m or h (e.g. step<=300s, p99<=2m, mean_act<=5)")
    m = _TARGET.match(text.lower())
    if m is None:
        raise PlanError(f"--target: {text!r} is not a target; {accepted}")
    metric, number, unit = m.groups()
    if metric not in METRICS:
        raise PlanError(f"--target: unknown metric {metric!r} in {text!r}; {accepted}")
    if unit not in UNITS_S:
        raise PlanError(f"--target: unknown unit {unit!r} in {text!r}; {accepted}")
    bound = float(number) * UNITS_S[unit]
    if not (bound > 0 and math.isfinite(bound)):  # (1e400 reads as inf: met by nothing)
        raise PlanError(f"--target: the bound must be > 0 s and finite, got {text!r}; "
                        f"{accepted}")
    return Target(metric, bound)


# -- clusters ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Size:
    """A cluster of ``nodes`` CPU nodes of ``cores`` each and ``gpu_nodes`` GPU nodes."""

    cores: int
    nodes: int
    gpu_nodes: int = 0

    @property
    def total_cores(self) -> int:
        return self.cores * self.nodes


def sized(base: ClusterSpec, size: Size) -> ClusterSpec:
    """``base`` with ``size``'s nodes: a CPU node keeps the first recorded node's memory
    per core and its NUMA domains (one where they do not divide the cores), and the rest
    of it as it is (its image cache); a GPU node is the first recorded one."""
    if not base.cpu_nodes:
        raise PlanError("cluster: has no CPU node to take the shape of a node from")
    node = base.cpu_nodes[0]
    numa = node.numa if size.cores % node.numa == 0 else 1
    mem = node.mem_gb / node.cores * size.cores
    cpu = tuple(replace(node, name=f"cpu-{k}", cores=size.cores, numa=numa, mem_gb=mem)
                for k in range(size.nodes))
    gpu: tuple[GpuNodeSpec, ...] = ()
    if size.gpu_nodes:
        g = base.gpu_nodes[0]
        gpu = tuple(replace(g, name=f"gpu-{k}") for k in range(size.gpu_nodes))
    return replace(base, cpu_nodes=cpu, gpu_nodes=gpu)


# -- traces --------------------------------------------------------------------------------
def resample(rows: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    """``n`` trajectories of validated ``rows`` drawn with replacement (seeded), each under
    a name of its own (``r<k>-<trajectory>``) and in no GRPO group."""
    traj = rows["trajectory"].to_numpy()
    starts = np.flatnonzero(np.r_[True, traj[1:] != traj[:-1]])
    ends = np.r_[starts[1:], len(traj)]
    pick = np.random.default_rng(seed).integers(0, len(starts), size=n)
    lengths = ends[pick] - starts[pick]
    offsets = np.repeat(starts[pick] - np.r_[0, np.cumsum(lengths)[:-1]], lengths)
    index = np.arange(int(lengths.sum())) + offsets
    out = rows.iloc[index].reset_index(drop=True)
    k = np.repeat(np.arange(n), lengths)
    out["trajectory"] = [f"r{i}-{t}" for i, t in zip(k, out["trajectory"], strict=True)]
    out["group"] = ""
    return out


def metrics_of(records: Sequence[Any], steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean and p99 ACT of the actions that ran, and the step time, of a run's records."""
    act = np.array([r.end_s - r.submit_s for r in records if r.status != "cancelled"])
    if not len(act):
        return {"mean_act_s": math.nan, "p99_act_s": math.nan, "step_s": math.nan}
    return {"mean_act_s": float(act.mean()), "p99_act_s": float(np.percentile(act, 99)),
            "step_s": float(steps[0]["step_s"]) if steps else math.nan}


# -- one simulation (in a worker) ----------------------------------------------------------
@dataclass(frozen=True)
class Job:
    policy: str
    size: Size
    resample: int


@dataclass
class _Worker:
    rows: pd.DataFrame
    base: ClusterSpec
    trajectories: int
    seed: int
    traces: dict[int, pd.DataFrame] = field(default_factory=dict)


_WORKER: _Worker | None = None


def _init(rows: pd.DataFrame, base: ClusterSpec, trajectories: int, seed: int) -> None:
    global _WORKER
    _WORKER = _Worker(rows, base, trajectories, seed)


def _simulate(job: Job) -> dict[str, Any]:
    """The metrics of ``job`` (``error``: the cluster cannot run the trace at all, e.g. a
    node smaller than an action's minimum; a size that meets nothing)."""
    from sim.driver import SimConfig, simulate

    w = _WORKER
    assert w is not None, "_init first"
    trace = w.traces.get(job.resample)
    if trace is None:
        trace = w.traces[job.resample] = resample(w.rows, w.trajectories,
                                                  w.seed * 1_000_003 + job.resample)
    t0 = time.process_time()
    try:
        result = simulate(trace, sized(w.base, job.size), SimConfig(policy=job.policy))
    except ValueError as e:  # refused (a misfit) or deadlocked: this size cannot run it
        return {"error": str(e).splitlines()[0][:300], "cpu_s": time.process_time() - t0}
    return {**metrics_of(result.records, result.steps), "cpu_s": time.process_time() - t0}


class Simulator:
    """Runs jobs, each once, on a process pool (``jobs`` > 1) or inline."""

    def __init__(self, rows: pd.DataFrame, base: ClusterSpec, trajectories: int, seed: int,
                 jobs: int) -> None:
        self.cache: dict[Job, dict[str, Any]] = {}
        self.pool = None
        if jobs > 1:
            self.pool = ProcessPoolExecutor(jobs, initializer=_init,
                                            initargs=(rows, base, trajectories, seed))
        else:
            _init(rows, base, trajectories, seed)

    def run(self, jobs: Iterable[Job]) -> None:
        todo = list(dict.fromkeys(j for j in jobs if j not in self.cache))
        if not todo:
            return
        done = self.pool.map(_simulate, todo) if self.pool is not None else map(_simulate, todo)
        self.cache.update(zip(todo, done, strict=True))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


# -- the search ----------------------------------------------------------------------------
@dataclass
class Bisection:
    """The smallest count in ``[1, cap]`` whose run meets the target, assuming that a count
    that meets it, meets it at every larger one: ``fail`` the largest count seen failing,
    ``meet`` the smallest seen meeting. From ``start`` it gallops (steps of 1, 2, 4, ...
    down from a count that met, up from one that failed) until the boundary is bracketed,
    then halves the bracket: a start near the answer (another resampling's) costs about
    two simulations, a far one about twice the bits of the distance."""

    start: int
    cap: int
    fail: int = 0
    meet: int | None = None
    step: int = 1

    def next(self) -> int | None:
        """The count to simulate next (None: found, or not met within ``cap``)."""
        if self.meet is None and self.fail == 0:
            return min(max(self.start, 1), self.cap)
        if self.meet is None:  # up from a failure
            return None if self.fail >= self.cap else min(self.fail + self.step, self.cap)
        if self.meet - self.fail <= 1:
            return None
        if self.fail == 0 and self.meet - self.step > 0:  # down from a count that met
            return self.meet - self.step
        return (self.fail + self.meet) // 2

    def seen(self, count: int, met: bool) -> None:
        # (the start itself is no step: the first step from it is 1)
        galloping = (self.meet is None) != (self.fail == 0)
        if met:
            self.meet = count if self.meet is None else min(self.meet, count)
        else:
            self.fail = max(self.fail, count)
        if galloping and (self.meet is None or self.fail == 0):
            self.step *= 2
        if self.meet is not None and self.fail == 0 and self.meet <= self.step:
            self.step = self.meet  # (the next galloping step would pass 0: halve instead)


@dataclass
class Search:
    """One (policy, cores per node, resampling): CPU nodes, then GPU nodes."""

    policy: str
    cores: int
    resample: int
    cpu: Bisection
    #: GPU nodes while the CPU nodes are searched (plenty), and where the GPU search starts
    gpu_cap: int
    gpu_start: int
    gpu: Bisection | None = None
    #: CPU nodes found (while the GPU search runs)
    nodes: int | None = None
    #: asks for simulations (a later resampling waits for the first one's answer)
    started: bool = True

    def job(self) -> Job | None:
        if self.gpu is None:
            n = self.cpu.next()
            if n is not None:
                return Job(self.policy, Size(self.cores, n, self.gpu_cap), self.resample)
            if self.cpu.meet is None or not self.gpu_cap:
                return None
            self.nodes = self.cpu.meet
            self.gpu = Bisection(min(self.gpu_start, self.gpu_cap), self.gpu_cap)
            self.gpu.seen(self.gpu_cap, True)  # (the CPU search met it with these)
        g = self.gpu.next()
        return None if g is None else Job(self.policy, Size(self.cores, self.nodes or 0, g),
                                          self.resample)

    def seen(self, job: Job, met: bool) -> None:
        if self.gpu is None:
            self.cpu.seen(job.size.nodes, met)
        else:
            self.gpu.seen(job.size.gpu_nodes, met)

    def found(self) -> Size | None:
        if self.cpu.meet is None:
            return None
        gpus = self.gpu.meet if self.gpu is not None and self.gpu.meet is not None else self.gpu_cap
        return Size(self.cores, self.cpu.meet, gpus)


@dataclass(frozen=True)
class PlanConfig:
    target: Target
    policies: tuple[str, ...]
    cores_per_node: tuple[int, ...]
    trajectories: int
    resamples: int = MIN_RESAMPLES
    max_nodes: int = 256
    seed: int = 0
    jobs: int = 1


def default_cores(base: ClusterSpec) -> tuple[int, ...]:
    """The recorded node's cores, half and twice as many."""
    c = base.cpu_nodes[0].cores
    return tuple(sorted({max(c // 2, 1), c, 2 * c}))


def plan(rows: pd.DataFrame, base: ClusterSpec, config: PlanConfig,
         progress: Callable[[int, int], None] | None = None,
         say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Search as the module says; the answer per policy, the frontier and every run."""
    from traces.schema import validate

    if config.resamples < MIN_RESAMPLES:
        raise PlanError(f"--resamples: at least {MIN_RESAMPLES} (an interval over fewer "
                        f"says little), got {config.resamples}")
    if not base.cpu_nodes:
        raise PlanError("cluster: has no CPU node to take the shape of a node from")
    if config.seed < 0:
        raise PlanError(f"--seed: must be >= 0, got {config.seed}")
    if not config.cores_per_node:
        raise PlanError("--cores-per-node: name at least one core count")
    for c in config.cores_per_node:
        if c < 1:
            raise PlanError(f"--cores-per-node: {c} is not a core count (>= 1)")
    # (a policy or shape named twice is searched once: its searches were doubled, and
    # their answers read back by resampling index found a resampling that never ran)
    config = replace(config, policies=tuple(dict.fromkeys(config.policies)),
                     cores_per_node=tuple(dict.fromkeys(config.cores_per_node)))
    rows = validate(rows)
    recorded = int(rows["trajectory"].nunique())
    wall0 = time.perf_counter()
    # where each search starts: the recorded cores, scaled by the batch, in nodes of c
    scale = config.trajectories / recorded
    recorded_cores = sum(n.cores for n in base.cpu_nodes)
    uses_gpus = bool((rows["gpus"] != "").any())
    gpu_start = max(math.ceil(len(base.gpu_nodes) * scale), 1) if uses_gpus else 0
    if uses_gpus and not base.gpu_nodes:
        raise PlanError("cluster: the trace has GPU rows and the cluster no GPU node")
    # the first resampling's searches start from the recorded cores scaled to the batch;
    # the others wait for its answer and start there (resamplings differ by little)
    gpu_cap = min(GPU_HEADROOM * gpu_start, 8 * config.max_nodes)
    first = {(p, c): Search(p, c, 0, Bisection(
                 min(max(math.ceil(recorded_cores * scale / c), 1), config.max_nodes),
                 config.max_nodes), gpu_cap, gpu_start)
             for p in config.policies for c in config.cores_per_node}
    rest = [Search(p, c, r, Bisection(1, config.max_nodes), gpu_cap, gpu_start,
                   started=False)
            for p in config.policies for c in config.cores_per_node
            for r in range(1, config.resamples)]
    searches = [*first.values(), *rest]
    sim = Simulator(rows, base, config.trajectories, config.seed, config.jobs)
    rounds = 0
    try:
        while True:
            for s in rest:  # started once the first resampling's search of its kind ended
                lead = first[s.policy, s.cores]
                if not s.started and lead.job() is None:
                    s.started = True
                    s.cpu.start = lead.cpu.meet or config.max_nodes
                    found = lead.found()
                    s.gpu_start = found.gpu_nodes if found is not None else gpu_start
            asked = [(s, s.job()) for s in searches if s.started]
            asked = [(s, j) for s, j in asked if j is not None]
            if progress is not None:
                progress(sum(s.started and s.job() is None for s in searches), len(searches))
            if not asked and all(s.started for s in searches):
                break
            rounds += 1
            if say is not None:
                say(f"round {rounds}: {len(set(j for _, j in asked) - set(sim.cache))} "
                    f"simulations ({len(sim.cache)} so far)")
            sim.run(j for _, j in asked)
            for s, j in asked:
                s.seen(j, "error" not in sim.cache[j] and config.target.met(sim.cache[j]))
        errors = [m["error"] for m in sim.cache.values() if "error" in m]
        if sim.cache and len(errors) == len(sim.cache):
            # no size ran at all: the trace or the cluster is wrong, not the sizes (a trace
            # naming images on a cluster without their pull figures, say)
            raise PlanError(f"no simulation could run (of {len(errors)}): {errors[0]}")
        chosen = _choose(config, searches)
        grid = {p: _grid(config, searches, p, cores, gpu_cap)
                for p, (cores, _) in chosen.items()}
        if say is not None:
            say(f"the frontier: {len({j for jobs in grid.values() for j in jobs} - set(sim.cache))}"
                " simulations")
        sim.run(j for jobs in grid.values() for j in jobs)
    finally:
        sim.close()
    per_node = base.gpu_nodes[0].gpus if base.gpu_nodes else 0
    return _answer(config, chosen, grid, sim.cache, rounds, time.perf_counter() - wall0,
                   recorded, per_node)


def _stats(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max())}


def _choose(config: PlanConfig, searches: list[Search]
            ) -> dict[str, tuple[int, list[Size] | None]]:
    """Per policy: the node shape whose sizes (one per resampling) have the fewest cores
    (median; of as many, the fewest and larger nodes), and those sizes (None: some
    resampling met the target with no shape)."""
    out: dict[str, tuple[int, list[Size] | None]] = {}
    for p in config.policies:
        shapes: list[tuple[float, int, list[Size] | None]] = []
        for c in config.cores_per_node:
            found = [s.found() for s in searches if s.policy == p and s.cores == c]
            sizes = [f for f in found if f is not None]
            if len(sizes) < len(found):
                shapes.append((math.inf, c, None))
            else:
                shapes.append((float(np.median([f.total_cores for f in sizes])), c, sizes))
        _, cores, sizes = min(shapes, key=lambda x: (x[0], -x[1]))
        out[p] = (cores, sizes)
    return out


#: points of a policy's frontier (node counts, geometric from 1)
FRONTIER_POINTS = 6
#: GPU nodes while CPU nodes are searched: this many times the recorded count scaled to the
#: batch (then the GPU search comes down from the scaled count)
GPU_HEADROOM = 4


def _grid(config: PlanConfig, searches: list[Search], policy: str, cores: int,
          gpu_cap: int) -> list[Job]:
    """The frontier's simulations of ``policy`` in nodes of ``cores``, each resampling: CPU
    node counts from 1 to twice the largest found (or every count its searches tried);
    with GPU rows (``gpu_cap`` > 0), GPU node counts from 1 to ``gpu_cap`` at the most CPU
    nodes any resampling needed (so that CPU does not bind)."""
    mine = [s for s in searches if s.policy == policy and s.cores == cores]
    tried = [s.cpu.meet or s.cpu.fail for s in mine]
    hi = min(max(2 * max(tried, default=1), 2), config.max_nodes)
    if gpu_cap:
        nodes = max(tried, default=1)
        counts = sorted({int(n) for n in np.geomspace(1, gpu_cap, FRONTIER_POINTS).round()})
        return [Job(policy, Size(cores, nodes, g), r) for g in counts
                for r in range(config.resamples)]
    counts = sorted({int(n) for n in np.geomspace(1, hi, FRONTIER_POINTS).round()})
    return [Job(policy, Size(cores, n, 0), r) for n in counts
            for r in range(config.resamples)]


def _answer(config: PlanConfig, chosen: dict[str, tuple[int, list[Size] | None]],
            grid: dict[str, list[Job]], cache: dict[Job, dict[str, Any]], rounds: int,
            wall_s: float, recorded: int, gpus_per_node: int) -> dict[str, Any]:
    target = config.target
    policies: dict[str, Any] = {}
    frontier: dict[str, list[dict[str, Any]]] = {}
    for p in config.policies:
        cores, sizes = chosen[p]
        if sizes is None:
            policies[p] = {"met": False, "why": _unmet(config, p, cache)}
        else:
            at = [target.value(cache[Job(p, f, r)]) for r, f in enumerate(sizes)]
            policies[p] = {
                "met": True, "cores_per_node": cores,
                "nodes": _stats([f.nodes for f in sizes]),
                "cores": _stats([f.total_cores for f in sizes]),
                "gpu_nodes": _stats([f.gpu_nodes for f in sizes]),
                "gpus": _stats([f.gpu_nodes * gpus_per_node for f in sizes]),
                target.metric + "_s": _stats(at),
                "per_resample": [{"nodes": f.nodes, "gpu_nodes": f.gpu_nodes,
                                  "value_s": v} for f, v in zip(sizes, at, strict=True)],
            }
        frontier[p] = _frontier(grid[p], target, cache, gpus_per_node)
    runs = [{"policy": j.policy, "cores_per_node": j.size.cores, "nodes": j.size.nodes,
             "gpu_nodes": j.size.gpu_nodes, "resample": j.resample, **m}
            for j, m in cache.items()]
    return {"target": str(target), "metric": target.metric,
            "metric_meaning": METRICS[target.metric][1],
            "trajectories": config.trajectories, "recorded_trajectories": recorded,
            "resamples": config.resamples, "cores_per_node": list(config.cores_per_node),
            "max_nodes": config.max_nodes, "policies": policies, "frontier": frontier,
            # what the frontier varies: GPUs for a trace with GPU rows, else CPU cores
            "frontier_x": "gpus" if any(j.size.gpu_nodes for js in grid.values() for j in js)
            else "cores",
            "simulations": len(cache), "rounds": rounds, "wall_s": wall_s,
            "simulation_cpu_s": float(sum(m.get("cpu_s", 0.0) for m in cache.values())),
            "runs": runs}


def _unmet(config: PlanConfig, policy: str, cache: dict[Job, dict[str, Any]]) -> str:
    """Why ``policy`` has no answer: the closest any of its simulations came (more nodes
    past a size where nothing queues do not shorten what the trace's own chain of
    actions takes), or the error every one of them met."""
    target = config.target
    mine = [(j, m) for j, m in cache.items() if j.policy == policy]
    ran = [(target.value(m), j.size) for j, m in mine
           if "error" not in m and not math.isnan(target.value(m))]
    if not ran:
        errors = [m["error"] for _, m in mine if "error" in m]
        return "no simulation could run" + (f": {errors[0]}" if errors else "")
    value, size = min(ran, key=lambda vs: (vs[0], vs[1].total_cores))
    return (f"not met by any shape within {config.max_nodes} nodes (closest: "
            f"{target.metric} {value:.1f} s at {size.nodes} x {size.cores} cores)")


def _frontier(jobs: list[Job], target: Target, cache: dict[Job, dict[str, Any]],
              gpus_per_node: int) -> list[dict[str, Any]]:
    """Capacity against the metric at each size of ``jobs`` over its resamplings (sizes
    where some resampling could not run at all: left out)."""
    by: dict[Size, list[float]] = {}
    failed: set[Size] = set()
    for j in jobs:
        m = cache[j]
        if "error" in m:
            failed.add(j.size)
        else:
            by.setdefault(j.size, []).append(target.value(m))
    return [{"cores": size.total_cores, "nodes": size.nodes, "gpu_nodes": size.gpu_nodes,
             "gpus": size.gpu_nodes * gpus_per_node, "runs": len(v), **_stats(v)}
            for size, v in sorted(by.items(), key=lambda kv: (kv[0].nodes, kv[0].gpu_nodes))
            if size not in failed]


def draw(answer: dict[str, Any], out_png: os.PathLike[str] | str) -> None:
    """The frontier: capacity (cores) against the target's metric, one line per policy
    (median over resamplings, the shaded band their range), the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.figures import colors

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    palette = colors(list(answer["frontier"]))
    for policy, points in answer["frontier"].items():
        if not points:
            continue
        x = [p[answer["frontier_x"]] for p in points]
        ax.plot(x, [p["median"] for p in points], marker="o", label=policy, color=palette[policy])
        ax.fill_between(x, [p["min"] for p in points], [p["max"] for p in points],
                        color=palette[policy], alpha=0.15)
    bound = float(answer["target"].split("<=")[1].rstrip("s"))
    ax.axhline(bound, color="#444444", linestyle="--", linewidth=1,
               label=f"target {answer['target']}")
    ax.set_xlabel("capacity (GPUs)" if answer["frontier_x"] == "gpus" else "capacity (CPU cores)")
    ax.set_ylabel(f"{answer['metric']} (s)")
    ax.set_yscale("log")
    ax.set_title(f"{answer['trajectories']} trajectories, {answer['resamples']} resamplings",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    fig.savefig(out_png, dpi=130, bbox_inches="tight")
    plt.close(fig)
