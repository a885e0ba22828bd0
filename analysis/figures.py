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
from typing import TYPE_CHECKING, Any

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


def colors(names: Sequence[str]) -> dict[str, str]:
    """A distinct colour per name: the policy's own colour when it has one, else the next
    unused colour of matplotlib's cycle (two runs never share a colour)."""
    out = {n: COLORS[n] for n in names if n in COLORS}
    spare = (c for c in plt.rcParams["axes.prop_cycle"].by_key()["color"] + list(COLORS.values())
             if c not in out.values())
    for n in names:
        if n not in out:
            out[n] = next(spare, "#444444")
    return out


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
    palette = colors([str(n) for n in names])
    # wide enough that the groups' labels (their longest line) do not run into each other
    longest = max((len(line) for g in groups for line in str(g).splitlines()), default=0)
    ax = _ax(ax, (max(5, 1.9 * len(groups), 0.085 * longest * len(groups) + 1), 3.8))
    for k, s in enumerate(names):
        sub = df[df[series] == s].set_index(group)
        xs = np.arange(len(groups)) + k * width - 0.4 + width / 2
        ys = [sub[value].get(g, np.nan) for g in groups]
        rects = ax.bar(xs, ys, width, label=s, color=palette[str(s)])
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
    palette = colors([str(s) for s in dict.fromkeys(df[series])])
    for s, sub in df.groupby(series, sort=False):
        sub = sub.sort_values(x)
        ax.plot(sub[x], sub[value], marker="o", label=s, color=palette[str(s)])
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
    palette = colors([r.name for r in runs])
    for run in runs:
        v = np.sort(run.actions["act_s"].to_numpy())
        if len(v):
            ax.plot(np.maximum(v, 1e-4), np.arange(1, len(v) + 1) / len(v), label=run.name,
                    color=palette[run.name])
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
    palette = colors([r.name for r in runs])
    for run in runs:
        a = allocation(run, resource)
        if len(a):
            ax.step(a["t_s"], a["allocated"] * 100, where="post", label=run.name,
                    color=palette[run.name])
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
    for resource in ("cpu", "gpu"):  # only resources some run allocated
        if any(allocation(r, resource)["allocated"].max() > 0 for r in runs
               if len(allocation(r, resource))):
            paths.append(save(utilisation(runs, resource).figure, out,
                              f"{resource}_utilisation")[0])
    return paths


def gpu_timeline(actions: pd.DataFrame, by: str = "service", ax: Axes | None = None) -> Axes:
    """What each GPU ran over time: one lane per GPU, a bar per action coloured by ``by``
    (e.g. ``service`` from :func:`analysis.runs.with_trace`), its restore in black."""
    gpu_rows = actions[actions["gpus"].astype(str) != ""]
    lanes = sorted({(str(r.node), int(g)) for r in gpu_rows.itertuples()
                    for g in str(r.gpus).split(",")})
    ax = _ax(ax, (8, max(2.0, 0.32 * len(lanes) + 1)))
    keys = list(dict.fromkeys(gpu_rows[by])) if by in gpu_rows else []
    cmap = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
    color = {k: cmap(i % cmap.N) for i, k in enumerate(keys)}
    y = {lane: i for i, lane in enumerate(lanes)}
    # one collection per (lane, colour): thousands of actions stay one draw call each
    bars_of: dict[tuple[int, Any], list[tuple[float, float]]] = {}
    for r in gpu_rows.itertuples():
        c = color.get(getattr(r, by, None), "#1b6ca8")
        for g in str(r.gpus).split(","):
            lane = y[(str(r.node), int(g))]
            if r.restore_s > 0:
                bars_of.setdefault((lane, "#111111"), []).append((r.start_s, r.restore_s))
            bars_of.setdefault((lane, c), []).append(
                (r.start_s + r.restore_s, r.end_s - r.start_s - r.restore_s))
    for (lane, c), spans in bars_of.items():
        ax.broken_barh(spans, (lane - 0.4, 0.8), color=c)
    ax.set_yticks(range(len(lanes)), [f"{n} gpu {g}" for n, g in lanes], fontsize=7)
    ax.set_xlabel("time (s)")
    ax.set_title("what each GPU ran (black: restoring a model)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[k]) for k in keys]
    if handles:
        ax.legend(handles, keys, fontsize=7, frameon=False, ncol=min(len(keys), 5),
                  loc="upper center", bbox_to_anchor=(0.5, -0.18))
    return ax
