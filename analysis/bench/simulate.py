"""`tangram bench simulate`: the wall time of one paper-scale AI-coding RL step on the
paper's CPU cluster, generated and simulated end to end on one core: the trace's
generation, the whole simulation, and the core's share of it per action."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

import numpy as np

from analysis.bench import QUIET, Opt, Progress
from analysis.bench.scheduler import pin_one_core


def simulate_bench(trajectories_n: int = 2048, seed: int = 0,
                   progress: Progress = QUIET) -> dict:
    """One paper-scale AI-coding RL step on the paper's CPU cluster, timed end to end."""
    from sim.cluster import load_cluster
    from sim.driver import SimConfig, simulate
    from traces.generate import generate
    from traces.schema import validate

    core_id = pin_one_core()
    progress.phase("generating the trace")
    t0 = time.perf_counter()
    df = validate(generate("coding", trajectories_n, seed))
    gen_s = time.perf_counter() - t0
    progress.phase("simulating")  # (then actions done / total, every 500)
    result = simulate(df, load_cluster("paper"), SimConfig(policy="tangram", seed=seed),
                      progress=progress)
    n = len(result.records)
    core_s = result.timing.core_s
    return {
        "scenario": f"coding-{trajectories_n}x~30-paper-cluster",
        "actions": n,
        "generate_s": round(gen_s, 2),
        "sim_wall_s": round(result.wall_s, 2),
        "core_s": round(core_s, 2),
        "sim_us_per_action_excl_scheduler": round((result.wall_s - core_s) / n * 1e6, 1),
        "core_us_per_action": round(core_s / n * 1e6, 1),
        "act_mean_s": round(float(np.mean([r.act_s for r in result.records])), 3),
        "pinned_core": core_id,
    }


def command(trajectories: Annotated[int, Opt("Trajectories in the AI-coding batch.")] = 2048,
            seed: int = 0, progress: Progress = QUIET) -> Iterator[dict]:
    yield simulate_bench(trajectories, seed, progress)
