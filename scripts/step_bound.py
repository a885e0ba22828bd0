"""How much better than the best tuned-once configuration can ANY policy be on step time?

Issue 30 asks for a step-time geometric mean >= 1.25x better than the best single
competitor configuration. Per cell of a regret matrix (docs/evidence/regret.json) this
computes a lower bound on any policy's step time: the longest trajectory's critical path
(its think times plus each action's true duration at its fastest feasible unit count,
nothing ever queued). No policy's step is shorter, so a configuration's step over this
bound caps the ratio any policy can show against it. Reads the trace's truth: an analysis
bound, never a decision.

    PYTHONPATH=. python scripts/step_bound.py [docs/evidence/regret.json]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import replace

import numpy as np

from analysis.regret import OWN, SCALES, cells, trace_of
from traces.schema import trajectories


def critical_path(df) -> float:
    """The longest trajectory's think time plus its actions at their fastest count."""
    longest = 0.0
    for spec in trajectories(df):
        t = 0.0
        for step in spec.steps:
            a, truth = step.action, step.truth
            res = "gpu" if a.min("gpu") > 0 else "cpu" if a.min("cpu") > 0 else None
            if truth is None:
                dur = a.t1_s or 0.0
            elif res is None:
                dur = truth.duration(1)
            else:
                dur = min(truth.duration(int(u)) for u in a.cost[res].choices if u >= 1)
            t += step.think_s + dur
        longest = max(longest, t)
    return longest


def geomean(xs: list[float]) -> float:
    return float(np.exp(np.mean(np.log(xs))))


def main(path: str) -> None:
    doc = json.load(open(path))
    # the file's own seeds (`tangram bench regret --seeds` writes others than the default)
    scale = replace(SCALES[doc["scale"]], seeds=tuple(sorted({r["seed"] for r in doc["cells"]})))
    rows = {(r["workload"], r["seed"], r["cluster"], r["rate"], r["profile_sigma"]): r
            for r in doc["cells"]}
    # per workload, per configuration: its step over the bound in every cell
    over: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    tangram: dict[str, list[float]] = defaultdict(list)
    for cell in cells(scale):
        row = rows.get((cell.workload, cell.seed, cell.cluster, cell.rate, cell.error))
        if row is None:
            continue
        bound = critical_path(trace_of(cell))
        tangram[cell.workload].append(row["tangram"]["step_time_s"] / bound)
        # (the baselines, as analysis.regret.best_baselines chooses among them)
        for label, run in row["runs"].items():
            if not label.startswith(OWN) and "error" not in run:
                over[cell.workload][label].append(run["step_time_s"] / bound)
    n = sum(len(v) for v in tangram.values())
    print(f"{n} cells; step time over the critical-path bound (geometric mean):")
    tuned: list[float] = []
    for w, per in over.items():
        full = {k: geomean(v) for k, v in per.items() if len(v) == len(tangram[w])}
        best = min(full, key=full.get)
        tuned += per[best]
        print(f"  {w}: tangram {geomean(tangram[w]):.4f}; best configuration {best} "
              f"{full[best]:.4f}")
    print(f"the best configuration per workload, over all cells: {geomean(tuned):.4f} = the "
          f"most any policy could be better than it (the issue asks 1.25)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/evidence/regret.json")
