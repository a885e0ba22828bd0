"""The simulated effect of forking a prepared sandbox: a coding batch in GRPO
groups, every rollout preparing its own sandbox against one preparation per group
forked into the others, on the same trace, cluster and policy (`tangram bench fork-sim`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Annotated, Any

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.runs import simulate
from sim.cluster import load_cluster
from tangram.fork import FORK
from traces.generate import generate
from traces.groups import SETUP


def fork_sim_rows(trajectories: int = 1024, group: int = 8, cluster: str = "paper",
                  cpu_nodes: tuple[int | None, ...] = (None, 1), policy: str = "tangram",
                  seed: int = 0, fork_s: float | None = None,
                  progress: Progress = QUIET) -> Iterator[dict[str, Any]]:
    """One row per (CPU nodes, with or without fork): env time per trajectory (the paper's
    env-interaction headline: ACT of every non-reward action, setup and fork included),
    step time, mean ACT, when rollouts' first agent action started (copies wait for their
    group's fork), and the core-seconds spent preparing sandboxes. ``cpu_nodes``: the
    cluster's first N CPU nodes (None: all of them; fewer: the same batch oversubscribed).
    ``fork_s``: seconds per copy (None: the cluster file's measured ``extra.fork_s``)."""
    spec = load_cluster(cluster)
    if fork_s is not None:
        spec = replace(spec, extra={**spec.extra, "fork_s": fork_s})
    df = generate("coding", trajectories, seed, group_size=group)
    total, done = 2 * len(cpu_nodes), 0
    for nodes in cpu_nodes:
        sized = spec if nodes is None else replace(spec, cpu_nodes=spec.cpu_nodes[:nodes])
        for fork in (False, True):
            progress(done, total)
            k = len(sized.cpu_nodes)
            progress.phase(f"{k} CPU node{'s' * (k != 1)}, "
                           + ("with fork" if fork else "without fork"))
            run = simulate(df, sized, policy, seed=seed, fork=fork)
            done += 1
            progress(done, total)
            a = run.actions
            prep = a["kind"].isin([SETUP, FORK])
            agent = a[~prep]
            first = agent.groupby("trajectory")["start_s"].min()
            env = run.summary["per_category"].get("env", {})
            yield {"bench": "fork-sim", "cluster": cluster, "cpu_nodes": len(sized.cpu_nodes),
                   "cpu_cores": sum(n.cores for n in sized.cpu_nodes), "policy": policy,
                   "trajectories": trajectories, "group": group, "fork": fork,
                   "fork_s_per_copy": float(sized.extra.get("fork_s", 0.0)),
                   "env_s_per_trajectory": env.get("per_trajectory_s"),
                   "step_time_s": run.summary.get("step_time_s"),
                   "act_mean_s": run.summary.get("act_mean_s"),
                   "first_agent_action_start_mean_s": float(first.mean()),
                   "prepare_core_s": float((a.loc[prep, "exec_s"]
                                            * a.loc[prep, "units"].clip(lower=1)).sum()),
                   "setups": int((a["kind"] == SETUP).sum()), "forks": int((a["kind"] == FORK).sum())}


def command(
    trajectories: Annotated[int, Opt("Coding trajectories.", min=1)] = 1024,
    group: Annotated[int, Opt("Rollouts per GRPO group.", min=2, max=65)] = 8,
    cluster: Annotated[str, Opt("Cluster YAML or built-in name.")] = "paper",
    fork_s: Annotated[float | None, Opt(
        "Seconds per copy (default: the cluster file's measured extra.fork_s).", min=0)] = None,
    seed: int = 0,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """On the whole cluster and on one CPU node (oversubscribed): env time per trajectory,
    step time, mean ACT, first agent action, core-seconds of preparation."""
    try:
        yield from fork_sim_rows(trajectories, group, cluster, seed=seed, fork_s=fork_s,
                                 progress=progress)
    except ValueError as e:
        raise BenchError(str(e)) from None
