"""The figure of `tangram compare`: runs side by side (a live run against its
simulation, one policy against another). The numbers are
:func:`analysis.runs.compare` (one row per run) and :func:`analysis.runs.change`
(% against the first run); :func:`table` turns them the way the CLI prints them
(one row per metric, one column per run, then ``% NAME`` columns)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis import figures
from analysis.runs import STATS, Run, change, compare, metrics


def table(runs: Sequence[Run]) -> pd.DataFrame:
    """Metrics (rows) of each run (columns), then the % difference of every run after
    the first from the first (``% NAME``; counts and shares are read as they are)."""
    wide = compare(runs)
    pct = change(wide)
    keep = [m for m, _, _ in STATS] + ["makespan_s", "units_mean", "failed", "actions",
                                       "same_units"]
    out = wide[[c for c in keep if c in wide]].T.astype(float)
    for name in list(wide.index)[1:]:
        out[f"% {name}"] = pct.loc[name].reindex(out.index).astype(float)
    out.index.name = "metric"
    return out.reset_index()


def figure(runs: Sequence[Run], out: Path, name: str = "compare") -> Path:
    """Mean/p50/p99 of ACT, queueing and execution per run (bars), and the ACT CDFs."""
    import matplotlib.pyplot as plt

    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = [m for m, _, _ in STATS]
    width = 0.8 / max(len(runs), 1)
    palette = figures.colors([r.name for r in runs])
    for k, run in enumerate(runs):
        vals = metrics(run.actions)
        xs = np.arange(len(rows)) + k * width - 0.4 + width / 2
        ax.bar(xs, [vals[r] for r in rows], width, label=run.name, color=palette[run.name])
    ax.set_xticks(np.arange(len(rows)), [r.removesuffix("_s").replace("_", "\n") for r in rows],
                  fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title("ACT, queueing, execution per run", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    figures.act_cdf(runs, ax=cdf)
    return figures.save(fig, out, name)[0]
