"""Figures (matplotlib): one idea per figure, labelled with units.

Every function draws on an ``ax`` (a new figure when None) and returns it, so a notebook
shows it inline and the CLI / report save it with :func:`save`. The run-level figures take
:class:`analysis.runs.Run` values (``load_run`` / ``simulate``); :func:`standard` is what
`tangram plot` draws.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

# The CLI and the report draw off-screen; a notebook keeps its inline backend.
if "MPLBACKEND" not in os.environ and "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from analysis.runs import allocation, breakdown, per_kind  # noqa: E402

if TYPE_CHECKING:
    from analysis.runs import Run

COLORS = {"tangram": "#1b6ca8", "tangram-paper": "#7fb3d5", "k8s": "#d1495b",
          "static": "#edae49", "serverless": "#66a182",
          "baseline": "#8d6a9f", "fixed-dop:1": "#bbbbbb", "fixed-dop:4": "#999999",
          "fixed-dop:8": "#666666", "fixed-dop:16": "#333333"}


def _ax(ax: Axes | None, size: tuple[float, float] = (5.2, 3.6)) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=size)
    return ax


def save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    """Write ``fig`` as ``out/name.png`` and ``.svg`` and close it; the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{name}.{ext}"
        fig.savefig(path, dpi=130, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def bars(df: pd.DataFrame, group: str, series: str, value: str, *, title: str, ylabel: str,
         annotate: str | None = None, log: bool = False, ax: Axes | None = None) -> Axes:
    """Grouped bars: one group per ``group`` value, one bar per ``series`` value."""
    groups = list(dict.fromkeys(df[group]))
    names = list(dict.fromkeys(df[series]))
    width = 0.8 / max(len(names), 1)
    ax = _ax(ax, (max(5, 1.9 * len(groups)), 3.8))
    for k, s in enumerate(names):
        sub = df[df[series] == s].set_index(group)
        xs = np.arange(len(groups)) + k * width - 0.4 + width / 2
        ys = [sub[value].get(g, np.nan) for g in groups]
        rects = ax.bar(xs, ys, width, label=s, color=COLORS.get(str(s)))
        if annotate:
            labels = [f"{sub[annotate].get(g, np.nan):.0f}s" for g in groups]
            ax.bar_label(rects, labels=labels, fontsize=7, padding=2)
    ax.set_xticks(np.arange(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return ax


def lines(df: pd.DataFrame, x: str, series: str, value: str, *, title: str, xlabel: str,
          ylabel: str, log: bool = True, ax: Axes | None = None) -> Axes:
    """One line per ``series`` value of ``value`` against ``x``."""
    ax = _ax(ax)
    for s, sub in df.groupby(series, sort=False):
        sub = sub.sort_values(x)
        ax.plot(sub[x], sub[value], marker="o", label=s, color=COLORS.get(str(s)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return ax


def act_cdf(runs: Sequence[Run], ax: Axes | None = None) -> Axes:
    """Distribution of action completion times, one line per run (log x)."""
    ax = _ax(ax)
    for run in runs:
        v = np.sort(run.actions["act_s"].to_numpy())
        if len(v):
            ax.plot(np.maximum(v, 1e-4), np.arange(1, len(v) + 1) / len(v), label=run.name,
                    color=COLORS.get(run.name))
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title("ACT distribution", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return ax


def act_per_kind(runs: Sequence[Run], ax: Axes | None = None, log: bool = True) -> Axes:
    """Mean ACT of each action kind, one bar per run."""
    return bars(per_kind(runs), "kind", "run", "act_mean_s", title="mean ACT per action kind",
                ylabel="mean ACT (s)", log=log, ax=ax)


def time_breakdown(runs: Sequence[Run], ax: Axes | None = None) -> Axes:
    """Where an action's time goes, per run: mean seconds queued, restoring, executing."""
    df = breakdown(runs)
    ax = _ax(ax, (max(4.5, 1.2 * len(df) + 2), 3.4))
    bottom = np.zeros(len(df))
    for col, color in (("queue_s", "#d1495b"), ("restore_s", "#edae49"), ("execute_s", "#1b6ca8")):
        vals = df[col].fillna(0).to_numpy()
        if col == "restore_s" and not vals.any():
            continue
        ax.bar(df["run"], vals, bottom=bottom, label=col.removesuffix("_s"), color=color)
        bottom += vals
    ax.set_ylabel("mean seconds per action")
    ax.set_title("where the time goes", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelrotation=20)
    return ax


def utilisation(runs: Sequence[Run], resource: str = "cpu", ax: Axes | None = None) -> Axes:
    """Share of ``resource`` allocated over time, one step line per run."""
    ax = _ax(ax, (5.2, 3.2))
    for run in runs:
        a = allocation(run, resource)
        if len(a):
            ax.step(a["t_s"], a["allocated"] * 100, where="post", label=run.name,
                    color=COLORS.get(run.name))
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{resource} allocated (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{resource} allocation over time", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return ax


def standard(runs: Sequence[Run], out: Path) -> list[Path]:
    """The figures `tangram plot` draws for a set of runs, saved under ``out`` (PNG paths)."""
    paths = [save(act_cdf(runs).figure, out, "act_cdf")[0]]
    if any(len(r.actions) for r in runs):
        paths.append(save(act_per_kind(runs).figure, out, "act_per_kind")[0])
        paths.append(save(time_breakdown(runs).figure, out, "time_breakdown")[0])
    for resource in ("cpu", "gpu"):
        if any(len(allocation(r, resource)) for r in runs):
            paths.append(save(utilisation(runs, resource).figure, out,
                              f"{resource}_utilisation")[0])
    return paths
