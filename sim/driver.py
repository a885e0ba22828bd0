"""The SimPy driver: the same core and runtime as the live executor, on a virtual clock.

One SimPy process per trajectory (think, submit, wait, think, ...). Execution is
modelled by :class:`sim.modelled.ModelledBackend` from each action's ground truth
(keyed by action id); the scheduler sees only what the trace declares.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import simpy

from sim.clock import SimClock
from sim.images import ImageCaches, pull_settings
from sim.modelled import CONTAINER_START, MAX_ATTEMPTS, POD_START, ModelledBackend, StartupModel
from tangram.cluster import ClusterSpec
from tangram.core import Tangram
from tangram.fork import FORK
from tangram.gpu.batching import MeasuredGpu
from tangram.model import Action
from tangram.policies import Policy, make_policy
from tangram.runtime import RecordSink, RunResult, Runtime
from traces.groups import GroupPlay, plays
from traces.player import play, refuse_misfits
from traces.schema import Step, TrajectorySpec, Truth, trajectories


@dataclass(slots=True)
class SimConfig:
    policy: str = "tangram"
    seed: int = 0
    steps: int = 1
    train_s: float = 0.0
    asynchronous: bool = False
    #: policy parameters (tangram.policies.PARAMS), e.g. {"depth": 3, "pod_cores": 8}
    options: dict[str, Any] = field(default_factory=dict)
    #: pod start time of pod policies (None: the default model)
    pod_start_s: float | None = None
    #: pod creations the control plane admits per second (None: the default model, 50/s)
    pod_rate_per_s: float | None = None
    #: a trajectory's environment is released when the trajectory ends ("trajectory") or
    #: when the whole rollout ends ("rollout": frameworks that tear a step's pods down together)
    env_hold: str = "trajectory"
    #: allocate-on-execution cost per CPU action (s), e.g. measured by `tangram bench executor`
    aoe_s: float = 0.0
    #: attempts of a provider-admitted API call before it fails (None: until it succeeds)
    api_attempts: int | None = MAX_ATTEMPTS
    #: virtual seconds between utilisation samples
    sample_s: float = 1.0
    #: GRPO groups of the trace (its ``group`` column) prepare their sandbox once and fork
    #: it into the other rollouts (traces/groups.py), at cluster.yaml's ``extra.fork_s``
    #: per copy; otherwise every rollout prepares its own
    fork: bool = False


def policy_of(config: SimConfig) -> Policy:
    return make_policy(config.policy, config.options)


def startup_of(policy: Policy, config: SimConfig,
               cluster: ClusterSpec | None = None) -> StartupModel:
    pods = policy.cpu.starts_pods
    if pods and (config.pod_start_s is not None or config.pod_rate_per_s is not None):
        return replace(POD_START,
                       median_s=POD_START.median_s if config.pod_start_s is None
                       else config.pod_start_s,
                       rate_per_s=POD_START.rate_per_s if config.pod_rate_per_s is None
                       else config.pod_rate_per_s)
    measured = (cluster.extra if cluster is not None else {}).get("env_start_s")
    if measured is not None:
        # the cluster file of a live run says what starting an environment cost there
        # (0 for the process backend's working directories, pods included)
        return StartupModel("measured", float(measured), 0.0)
    return POD_START if pods else CONTAINER_START


def fork_s_of(cluster: ClusterSpec) -> float:
    """Seconds one sandbox copy takes (cluster.yaml ``extra.fork_s``, measured by
    `tangram bench fork` on the backend the cluster runs)."""
    value = cluster.extra.get("fork_s")
    if value is None:
        raise ValueError("fork: the cluster file has no extra.fork_s (seconds per sandbox "
                         "copy; measure it with `tangram bench fork`)")
    if not float(value) >= 0:
        raise ValueError(f"extra.fork_s: must be >= 0, got {value!r}")
    return float(value)


def image_caches(clock: SimClock, cluster: ClusterSpec, policy: Policy,
                 steps_specs: list[list[TrajectorySpec]]
                 ) -> tuple[ImageCaches | None, dict[str, str]]:
    """The nodes' image caches (sim/images.py) and each trajectory's image, when the trace
    names images (None and {} otherwise: nothing of it is modelled). The images every node
    holds at the start are the policy's (``images.held_at_start``: all of them for the
    pre-pulled ideal, which also has no disk budget)."""
    image_of = {s.id: s.image for specs in steps_specs for s in specs if s.image}
    if not image_of:
        return None, {}
    sizes = {s.image: s.image_gb for specs in steps_specs for s in specs if s.image}
    mbps, pulls, overhead_s = pull_settings(cluster)
    held = policy.images.held_at_start(sizes)
    budgets = {n.name: None if held else n.image_cache_gb for n in cluster.cpu_nodes}
    return ImageCaches(clock, sizes, budgets, mbps, pulls, held, overhead_s), image_of


def busy_of(core: Tangram) -> Callable[[str], float]:
    """Fraction of a node's cores held exclusively (what a light-lane action shares)."""
    return core.busy_fraction


class SimDoor:
    """The trajectory player's door (traces/player.py) on the SimPy clock."""

    def __init__(self, env: simpy.Environment, runtime: Runtime, policy: Policy,
                 backend: ModelledBackend, close_at_end: bool) -> None:
        self.env, self.runtime, self.policy, self.backend = env, runtime, policy, backend
        #: env_hold "trajectory": a trajectory closes when it ends (else with its rollout)
        self.close_at_end = close_at_end

    def open(self, spec: TrajectorySpec) -> None:
        self.runtime.open_trajectory(spec.id, spec.task, spec.mem_gb, spec.image,
                                     spec.image_gb)
        # an environment requested at open starts now if its node is known (else once
        # bound, at its first action)
        node_of = self.runtime.core.node_of
        self.policy.env.opened(spec.id, lambda t: self.backend.open_env(t, node_of(t)))

    def sleep(self, seconds: float) -> simpy.Event:
        return self.env.timeout(seconds)

    def run(self, action: Action) -> simpy.Event:
        ev = self.env.event()
        self.runtime.submit(action, lambda rec, out: ev.succeed((rec, out)))
        return ev

    def close(self, trajectory: str) -> None:
        if self.close_at_end:
            self.runtime.close_trajectory(trajectory)
            self.backend.closed(trajectory)


def simulate(df: pd.DataFrame, cluster: ClusterSpec, config: SimConfig,
             progress: Callable[[int, int], None] | None = None,
             records: RecordSink | None = None) -> RunResult:
    """Run a validated trace (traces.schema.load) through one policy. ``records``: where
    finished actions' records go as the run goes (e.g. a file written in row groups, so
    that a large run does not hold them all); None: kept in the result's ``records``."""
    wall0 = time.perf_counter()
    policy = policy_of(config)
    # Only the services the trace calls: static deployments are sized for what the
    # workload uses (a service nobody calls would take GPUs from the others).
    used = {s for s in df["service"].unique() if s}
    cluster = replace(cluster, services=tuple(s for s in cluster.services if s.name in used))
    core = Tangram(cluster, policy)
    fork_s = fork_s_of(cluster) if config.fork else None
    steps_plays = [plays(trajectories(df, prefix=f"s{k}/" if config.steps > 1 else ""), fork_s)
                   for k in range(config.steps)]
    steps_specs = [[s for p in ps for s in (p.leader, *p.copies)] for ps in steps_plays]
    refuse_misfits(cluster, policy, steps_specs[0])
    env = simpy.Environment()
    clock = SimClock(env)
    # each action's truth from when its step is built (the player's prepare) until it ended:
    # a trace's steps are built as the run reaches them (traces.schema.Steps), not held
    truth: dict[str, Truth] = {}
    provider = policy.api.provider(cluster.quotas)
    caches, image_of = image_caches(clock, cluster, policy, steps_specs)
    backend = ModelledBackend(clock, np.random.default_rng(config.seed), truth,
                              startup_of(policy, config, cluster), provider,
                              busy=busy_of(core), aoe_s=config.aoe_s,
                              measured=MeasuredGpu.from_extra(cluster.extra, cluster.restore_gbps),
                              max_attempts=config.api_attempts, images=caches,
                              image_of=image_of)
    # the core's seconds by this thread's CPU clock: a simulation is one thread, and its
    # decision times should not grow with the machine's load (live runs use wall clock)
    runtime = Runtime(core, clock, backend, stopwatch=time.thread_time, records=records)
    total = sum(len(s.steps) for specs in steps_specs for s in specs)
    done = [0]
    step_log: list[dict[str, float]] = []
    samples: list[dict[str, float]] = []

    if config.env_hold not in ("trajectory", "rollout"):
        raise ValueError(f"env_hold: 'trajectory' or 'rollout', got {config.env_hold!r}")

    def prepare(step: Step) -> Action:
        if step.truth is not None:
            truth[step.action.id] = step.truth
        return step.action

    def ended(action: Action, result: Any) -> None:
        truth.pop(action.id, None)
        done[0] += 1
        if progress and done[0] % 500 == 0:
            progress(done[0], total)

    door = SimDoor(env, runtime, policy, backend, config.env_hold == "trajectory")

    def copy_of(forked: simpy.Event, spec: TrajectorySpec):
        yield forked  # its sandbox exists once the leader's fork ended
        yield from play(spec, door, prepare, ended)

    def group(p: GroupPlay) -> list[simpy.Process]:
        if not p.copies:
            return [env.process(play(p.leader, door, prepare, ended))]
        forked = env.event()

        def leader_ended(action: Action, result: Any) -> None:
            ended(action, result)
            if action.kind == FORK:
                forked.succeed()

        return [env.process(play(p.leader, door, prepare, leader_ended)),
                *(env.process(copy_of(forked, c)) for c in p.copies)]

    def rollout(specs: list[TrajectorySpec], groups: list[GroupPlay]):
        yield simpy.AllOf(env, [proc for p in groups for proc in group(p)])
        if config.env_hold == "rollout":
            for s in specs:
                runtime.close_trajectory(s.id)
                backend.closed(s.id)

    running = [True]

    def sampler():
        while running[0]:
            snap = core.snapshot(detail=False)
            samples.append({"t_s": env.now, **snap.usage})
            # nothing else will ever happen: trajectories wait for what is never released
            # (e.g. pods held to the rollout's end on a cluster too small for the batch)
            if env.peek() == simpy.core.Infinity and not snap.running_count:
                waiting = snap.unbound + snap.queued
                raise ValueError(
                    f"deadlock at t={env.now:.1f}s: {waiting} environment(s)/action(s) wait "
                    "for resources that nothing running will release (under env_hold="
                    f"'{config.env_hold}', the batch's environments must fit the cluster)")
            yield env.timeout(config.sample_s)

    def rl_loop():
        for k, specs in enumerate(steps_specs):
            t0 = env.now
            yield env.process(rollout(specs, steps_plays[k]))
            rollout_s = env.now - t0
            if config.asynchronous:  # training overlaps the next rollout
                step_s = max(rollout_s, config.train_s)
            else:
                yield env.timeout(config.train_s)
                step_s = env.now - t0
            step_log.append({"step": k, "rollout_s": rollout_s, "step_s": step_s})
        running[0] = False
        samples.append({"t_s": env.now, **core.snapshot(detail=False).usage})

    env.process(sampler())
    env.run(until=env.process(rl_loop()))
    if progress:
        progress(total, total)
    final = core.snapshot(detail=False)
    counters = {"api_retries": backend.retries, "api_429s": backend.rejections,
                "api_failed": backend.gave_up, "gpu_restores": final.counters["gpu_restores"],
                "gpu_restore_hits": final.counters["gpu_restore_hits"],
                "scheduler_passes": final.counters["scheduler_passes"], "seed": config.seed}
    if caches is not None:
        counters.update(caches.counters())
    kept = runtime.records if records is None else []
    return RunResult(policy.label, kept, step_log, dict(final.capacity), counters,
                     runtime.timing, samples, time.perf_counter() - wall0, final,
                     streamed=0 if records is None else len(records))
