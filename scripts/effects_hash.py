"""Hash of every effect the core returns in the scheduler benchmark's scenarios (issue 23):
a change meant only to make the core cheaper must leave every ``handle`` call's effects
as they were. Run on two versions and compare the lines.

    PYTHONPATH=. python scripts/effects_hash.py

A GPU plan's resident set is a frozenset, whose repr follows string hashing: the script
re-runs itself under PYTHONHASHSEED=0 unless it is set (compare runs under the same seed).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from analysis.bench.scheduler import cpu_scenario, gpu_scenario, run_scheduler_scenario
from tangram.core import Tangram


@contextmanager
def hashed(text: Callable[[float, Any, Any], str]) -> Iterator[list]:
    """While inside, every ``Tangram.handle`` call's ``text(now, command, effects)`` is
    hashed, per core: yields a list that holds, on leaving, [the sha256, the number of
    calls] of the core called most (the run's; a throwaway core, e.g. the trace's fit
    check of traces/fit.py, is left out: what it is asked is not a schedule)."""
    per_core: dict[int, list] = {}
    handle = Tangram.handle

    def traced(core: Tangram, command, now: float):
        out = handle(core, command, now)
        state = per_core.setdefault(id(core), [hashlib.sha256(), 0])
        state[0].update(text(now, command, out).encode())
        state[1] += 1
        return out

    result: list = []
    Tangram.handle = traced  # type: ignore[method-assign]
    try:
        yield result
    finally:
        Tangram.handle = handle  # type: ignore[method-assign]
        result.extend(max(per_core.values(), key=lambda s: s[1]))


def _without_addresses(now: float, command, out) -> str:
    text = f"{now!r}|{type(command).__name__}|{out!r}"
    if " at 0x" in text:
        raise AssertionError(f"an address in an effect's repr: {text[:300]}")
    return text


def run(name: str, build, n: int, seed: int) -> str:
    cluster, actions = build(n, np.random.default_rng(seed))
    with hashed(_without_addresses) as state:
        r = run_scheduler_scenario(name, cluster, actions)
    h, calls = state
    return (f"{name} n={n} seed={seed} calls={calls} act_mean_s={r['act_mean_s']} "
            f"gpu_restores={r['gpu_restores']} batched={r['batched_actions']} "
            f"{h.hexdigest()[:16]}")


def run_sim(workload: str, policy: str, n: int, seed: int) -> str:
    """A generated trace through the simulator (closed-loop trajectories submitting one
    action at a time, quotas, the light lane, several nodes)."""
    from sim.cluster import load_cluster
    from sim.driver import SimConfig, simulate
    from traces.generate import generate
    from traces.schema import validate

    df = validate(generate(workload, n, seed))
    with hashed(lambda now, command, out: f"{now!r}|{command!r}|{out!r}") as state:
        result = simulate(df, load_cluster(None), SimConfig(policy=policy, seed=seed))
    h, calls = state
    act = float(np.mean([r.act_s for r in result.records]))
    resized = sum(r.resized.count(";") + 1 for r in result.records if r.resized)
    return (f"sim {workload} {policy} n={n} seed={seed} calls={calls} act={act:.6f} "
            f"resized={resized} {h.hexdigest()[:16]}")


def main(argv: list[str]) -> None:
    for name, build in (("cpu", cpu_scenario), ("gpu", gpu_scenario)):
        for n, seed in ((2048, 0), (2048, 1), (300, 0), (300, 7)):
            print(run(name, build, n, seed), flush=True)
    for workload, policy in (("mixed", "tangram"), ("coding", "tangram"), ("coding", "k8s"),
                             ("coding", "fixed-dop:2"), ("coding", "tangram-malleable"),
                             ("deepsearch", "tangram"), ("mopd", "static")):
        print(run_sim(workload, policy, 24, 3), flush=True)
    # resize-heavy (issue 49): a larger coding batch, where malleable grants grow and
    # shrink thousands of times
    print(run_sim("coding", "tangram-malleable", 128, 5), flush=True)


if __name__ == "__main__":
    if "PYTHONHASHSEED" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    main(sys.argv[1:])
