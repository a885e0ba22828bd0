"""Runs side by side (`tangram compare`): a live run against its simulation, one
policy against another.

``compare(runs)`` returns one row per metric and one column per run, then a
``% NAME`` column per run after the first with its difference from the first
(the reference). Metrics come from each run's actions.parquet, so a simulated
and a live run are measured by the same code. ``same_units`` is the share of
the actions both runs executed (matched by action id) that were granted the
same number of units — the check that a simulation made the live run's
decisions, not just its averages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.outputs import failed_mask, load_run

#: (metric, column of actions.parquet, statistic)
STATS: tuple[tuple[str, str, str], ...] = tuple(
    (f"{col.removesuffix('_s')}_{stat}_s", col, stat)
    for col in ("act_s", "queue_s", "exec_s") for stat in ("mean", "p50", "p99"))


def _label_runs(runs: Sequence[str | Path] | Mapping[str, str | Path]) -> dict[str, Path]:
    if isinstance(runs, Mapping):
        return {str(k): Path(v) for k, v in runs.items()}
    paths = [Path(r) for r in runs]
    names = [p.name or str(p) for p in paths]
    if len(set(names)) < len(names):  # same leaf names: use the whole paths
        names = [str(p) for p in paths]
    return dict(zip(names, paths, strict=True))


def metrics(actions: pd.DataFrame) -> dict[str, float]:
    """The compared figures of one run's actions frame."""
    out: dict[str, float] = {}
    for name, col, stat in STATS:
        s = actions[col] if len(actions) else pd.Series(dtype=float)
        out[name] = float("nan") if s.empty else float(
            s.mean() if stat == "mean" else s.quantile(0.5 if stat == "p50" else 0.99))
    if len(actions):
        # as summary.json: from the first submission (or t=0) to the last end
        out["makespan_s"] = float(actions["end_s"].max() - min(actions["submit_s"].min(), 0.0))
        out["units_mean"] = float(actions["units"].mean())
        out["failed"] = float(failed_mask(actions).sum())
    else:
        out.update(makespan_s=float("nan"), units_mean=float("nan"), failed=0.0)
    out["actions"] = float(len(actions))
    return out


def same_units(a: pd.DataFrame, b: pd.DataFrame) -> float:
    """Share of the actions both ran (by action id) granted the same units."""
    if not len(a) or not len(b):
        return float("nan")
    joined = a[["action_id", "units"]].merge(b[["action_id", "units"]], on="action_id")
    if joined.empty:
        return float("nan")
    return float((joined["units_x"] == joined["units_y"]).mean())


def compare(runs: Sequence[str | Path] | Mapping[str, str | Path]) -> pd.DataFrame:
    """Metrics of each run side by side, with % differences from the first run.

    ``runs``: run directories, or {label: directory}. Raises FileNotFoundError
    for a directory that is not a run.
    """
    labelled = _label_runs(runs)
    if len(labelled) < 1:
        raise ValueError("compare: no runs given")
    frames = {name: load_run(path)[1] for name, path in labelled.items()}
    names = list(frames)
    ref = names[0]
    table = pd.DataFrame({name: metrics(df) for name, df in frames.items()})
    table.loc["same_units"] = [1.0] + [same_units(frames[ref], frames[n]) for n in names[1:]]
    for name in names[1:]:
        base = table[ref].replace(0.0, np.nan)
        pct = 100.0 * (table[name] - table[ref]) / base
        pct[["actions", "failed", "same_units"]] = np.nan  # counts and shares: read as is
        table[f"% {name}"] = pct
    table.index.name = "metric"
    return table.reset_index()


def figure(runs: Sequence[str | Path] | Mapping[str, str | Path], out: Path,
           name: str = "compare") -> Path:
    """Mean/p50/p99 of ACT, queueing and execution per run (bars), and the ACT CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from analysis.figures import save

    labelled = _label_runs(runs)
    frames = {n: load_run(p)[1] for n, p in labelled.items()}
    fig, (ax, cdf) = plt.subplots(1, 2, figsize=(10, 3.8))
    rows = [m for m, _, _ in STATS]
    width = 0.8 / len(frames)
    for k, (label, df) in enumerate(frames.items()):
        vals = metrics(df)
        xs = np.arange(len(rows)) + k * width - 0.4 + width / 2
        ax.bar(xs, [vals[r] for r in rows], width, label=label)
        v = np.sort(df["act_s"].to_numpy()) if len(df) else np.array([])
        if len(v):
            cdf.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xticks(np.arange(len(rows)), [r.removesuffix("_s").replace("_", "\n") for r in rows],
                  fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title("ACT, queueing, execution per run", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    cdf.set_xscale("log")
    cdf.set_xlabel("action completion time (s)")
    cdf.set_ylabel("fraction of actions")
    cdf.set_title("ACT distribution", fontsize=10)
    cdf.legend(fontsize=8, frameon=False)
    cdf.grid(alpha=0.3)
    return save(fig, out, name)[0]
