"""The SimPy driver: the same core and runtime as the live executor, on a virtual clock.

One SimPy process per trajectory (think, submit, wait, think, ...). The
backend's "execution" is the action's modelled duration on the units it was
granted, using the trace's true ``t1_s`` and elasticity (the scheduler may only
know them when the row is profiled), plus modelled overheads: environment start
at a trajectory's first CPU action (a container under Tangram, a pod under
k8s), GPU restore, setup, and for per-trajectory API calls the provider's 429s
with exponential backoff.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import simpy

from analysis.outputs import records_frame, summarise
from sim.baselines import api_retries, make_core
from tangram.cluster import ClusterSpec
from tangram.core import Tangram
from tangram.managers.quota import QuotaManager
from tangram.model import QUOTA_PREFIX, Dispatch, Elasticity, Outcome
from tangram.runtime import Runtime
from traces.schema import TrajectorySpec, trajectories


class SimTimer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimClock:
    """The Clock protocol on a SimPy environment."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env

    def now(self) -> float:
        return self.env.now

    def call_later(self, delay: float, fn: Callable[[], None]) -> SimTimer:
        timer = SimTimer()

        def fire(_event: Any) -> None:
            if not timer.cancelled:
                fn()

        self.env.timeout(max(delay, 0.0)).callbacks.append(fire)
        return timer


@dataclass(frozen=True, slots=True)
class StartupModel:
    """Environment start at a trajectory's first CPU action: lognormal(median, sigma)."""

    name: str
    median_s: float
    sigma: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.lognormal(math.log(self.median_s), self.sigma)) if self.median_s else 0.0


#: docker create + start of a local image, no pull: ~0.5 s
CONTAINER_START = StartupModel("container", 0.5, 0.3)
#: Kubernetes pod start without image pull: ~2 s typical, p99 SLO 5 s
POD_START = StartupModel("pod", 2.0, math.log(5.0 / 2.0) / 2.326)


class SimBackend:
    """Models the execution of a dispatched action in virtual time."""

    def __init__(self, clock: SimClock, rng: np.random.Generator, startup: StartupModel,
                 provider: QuotaManager | None, backoff_s: float = 0.5,
                 backoff_cap_s: float = 8.0) -> None:
        self.clock = clock
        self.rng = rng
        self.startup = startup
        self.provider = provider
        self.backoff_s = backoff_s
        self.backoff_cap_s = backoff_cap_s
        self._started_envs: set[str] = set()
        self._cancelled: set[str] = set()
        self.retries = 0

    def cancel(self, action_id: str) -> None:
        self._cancelled.add(action_id)

    def true_duration(self, d: Dispatch) -> float:
        p = d.action.payload or {}
        t1 = float(p.get("t1_s", d.action.t1_s or 0.0))
        pf = p.get("parallel_fraction")
        units = d.units if d.action.elastic else 1
        if pf is None or units <= 1:
            return t1
        return t1 / (Elasticity.amdahl(pf).efficiency(units) * units)

    def start(self, d: Dispatch, on_done: Callable[[Outcome], None]) -> None:
        payload = d.action.payload or {}
        overhead = d.lease.restore_s + float(payload.get("setup_s", 0.0))
        if d.action.min("cpu") > 0 and d.action.trajectory not in self._started_envs:
            self._started_envs.add(d.action.trajectory)
            overhead += self.startup.sample(self.rng)
        quotas = {k: v.min for k, v in d.action.cost.items() if k.startswith(QUOTA_PREFIX)}
        if self.provider is not None and quotas:
            self._attempt(d, on_done, quotas, overhead, 0)
            return
        self._run(d, on_done, overhead, 0)

    def _run(self, d: Dispatch, on_done: Callable[[Outcome], None], overhead: float,
             retries: int, release: Callable[[], None] | None = None) -> None:
        exec_s = self.true_duration(d)
        timeout = float((d.action.payload or {}).get("timeout_s", 0.0))
        status = "ok"
        if timeout and exec_s > timeout:
            exec_s, status = timeout, "timeout"

        def done() -> None:
            if release:
                release()
            if d.action.id in self._cancelled:
                self._cancelled.discard(d.action.id)
                on_done(Outcome(d.action.id, "cancelled", None, overhead_s=overhead))
                return
            on_done(Outcome(d.action.id, status, 0 if status == "ok" else None,
                            overhead_s=overhead, extra={"retries": retries}))

        self.clock.call_later(overhead + exec_s, done)

    def _attempt(self, d: Dispatch, on_done: Callable[[Outcome], None],
                 quotas: dict[str, float], overhead: float, attempt: int) -> None:
        """Per-trajectory API call: the provider enforces its quota with 429s."""
        assert self.provider is not None
        now = self.clock.now()
        token = f"{d.action.id}/{attempt}"
        lease = self.provider.reserve(token, quotas, now)
        if lease is not None:
            self._run(d, on_done, overhead, attempt, release=lambda: self.provider.release(lease))
            return
        self.retries += 1
        wait = min(self.backoff_s * 2 ** attempt, self.backoff_cap_s) * (0.5 + self.rng.random())
        self.clock.call_later(0.05 + wait,  # the 429 answer itself takes a round trip
                              lambda: self._attempt(d, on_done, quotas, overhead, attempt + 1))


@dataclass(slots=True)
class SimConfig:
    policy: str = "tangram"
    seed: int = 0
    steps: int = 1
    train_s: float = 0.0
    asynchronous: bool = False
    depth: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    #: virtual seconds between utilisation samples
    sample_s: float = 1.0


@dataclass(slots=True)
class SimResult:
    frame: pd.DataFrame
    summary: dict[str, Any]
    utilisation: pd.DataFrame
    core: Tangram
    wall_s: float


def check_trace(core: Tangram, specs: list[TrajectorySpec]) -> list[str]:
    """Every action that can never run on this cluster, before the run starts."""
    problems: list[str] = []
    for spec in specs:
        core.open_trajectory(spec.id, spec.task, spec.mem_gb)
        for step in spec.steps:
            try:
                core.validate(step.action)
            except (ValueError, KeyError) as e:
                msg = e.args[0] if e.args else str(e)
                problems.append(f"trajectory {spec.id!r}, action {step.action.id!r}: {msg}")
                if len(problems) >= 200:
                    return problems
        core.close_trajectory(spec.id, 0.0)
    return problems


def simulate(df: pd.DataFrame, cluster: ClusterSpec, config: SimConfig,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run a validated trace (traces.schema.load) through one policy."""
    wall0 = time.perf_counter()
    options = dict(config.options)
    options.setdefault("services", sorted({s for s in df["service"].unique() if s}))
    core = make_core(config.policy, cluster, options, depth=config.depth)
    steps_specs = [list(trajectories(df, prefix=f"s{k}/" if config.steps > 1 else ""))
                   for k in range(config.steps)]
    problems = check_trace(make_core(config.policy, cluster, options), steps_specs[0])
    if problems:
        raise ValueError("trace does not fit the cluster:\n  " + "\n  ".join(problems))
    env = simpy.Environment()
    clock = SimClock(env)
    rng = np.random.default_rng(config.seed)
    provider = QuotaManager(cluster.quotas) if api_retries(config.policy) else None
    startup = POD_START if config.policy in ("k8s", "baseline") else CONTAINER_START
    if "pod_start_s" in options and startup is POD_START:
        startup = StartupModel("pod", float(options["pod_start_s"]), POD_START.sigma)
    backend = SimBackend(clock, rng, startup, provider)
    runtime = Runtime(core, clock, backend)
    total = sum(len(s.steps) for specs in steps_specs for s in specs)
    done = [0]
    step_log: list[dict[str, float]] = []
    samples: list[dict[str, float]] = []

    def trajectory(spec: TrajectorySpec):
        runtime.open_trajectory(spec.id, spec.task, spec.mem_gb)
        for step in spec.steps:
            if step.think_s:
                yield env.timeout(step.think_s)
            ev = env.event()
            runtime.submit(step.action, lambda rec, out, ev=ev: ev.succeed())
            yield ev
            done[0] += 1
            if progress and done[0] % 500 == 0:
                progress(done[0], total)
        runtime.close_trajectory(spec.id)

    def rollout(specs: list[TrajectorySpec]):
        yield simpy.AllOf(env, [env.process(trajectory(s)) for s in specs])

    running = [True]

    def sampler():
        while running[0]:
            samples.append({"t_s": env.now, **core.usage()})
            yield env.timeout(config.sample_s)

    def rl_loop():
        for k, specs in enumerate(steps_specs):
            t0 = env.now
            yield env.process(rollout(specs))
            rollout_s = env.now - t0
            if config.asynchronous:  # training overlaps the next rollout
                step_s = max(rollout_s, config.train_s)
            else:
                yield env.timeout(config.train_s)
                step_s = env.now - t0
            step_log.append({"step": k, "rollout_s": rollout_s, "step_s": step_s})
        running[0] = False
        samples.append({"t_s": env.now, **core.usage()})

    env.process(sampler())
    env.run(until=env.process(rl_loop()))
    if progress:
        progress(total, total)
    frame = records_frame(runtime.records)
    util = pd.DataFrame(samples)
    wall = time.perf_counter() - wall0
    summary = summarise(
        frame, policy=config.policy, capacity=core.capacity(), utilisation=util, steps=step_log,
        extra={"api_retries": backend.retries, "gpu_restores": core.gpu.restores,
               "gpu_restore_hits": core.gpu.hits, "seed": config.seed,
               "core_s": runtime.core_s,
               "scheduler_pass_mean_us": core.pass_s / core.passes * 1e6 if core.passes
               else 0.0},
    )
    return SimResult(frame, summary, util, core, wall)
