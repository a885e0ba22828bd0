"""Figures (matplotlib, PNG + SVG): one idea per figure, labelled with units."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

COLORS = {"tangram": "#1b6ca8", "tangram-paper": "#7fb3d5", "k8s": "#d1495b",
          "static": "#edae49", "serverless": "#66a182",
          "baseline": "#8d6a9f", "fixed-dop:1": "#bbbbbb", "fixed-dop:4": "#999999",
          "fixed-dop:8": "#666666", "fixed-dop:16": "#333333"}


def save(fig: plt.Figure, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{name}.{ext}"
        fig.savefig(path, dpi=130, bbox_inches="tight")
        paths.append(path)
    plt.close(fig)
    return paths


def bars(df: pd.DataFrame, group: str, series: str, value: str, title: str, ylabel: str,
         out: Path, name: str, annotate: str | None = None, log: bool = False) -> Path:
    groups = list(dict.fromkeys(df[group]))
    names = list(dict.fromkeys(df[series]))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(5, 1.9 * len(groups)), 3.8))
    for k, s in enumerate(names):
        sub = df[df[series] == s].set_index(group)
        xs = np.arange(len(groups)) + k * width - 0.4 + width / 2
        ys = [sub[value].get(g, np.nan) for g in groups]
        rects = ax.bar(xs, ys, width, label=s, color=COLORS.get(s))
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
    return save(fig, out, name)[0]


def lines(df: pd.DataFrame, x: str, series: str, value: str, title: str, xlabel: str,
          ylabel: str, out: Path, name: str, log: bool = True) -> Path:
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
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
    return save(fig, out, name)[0]


def act_cdf(frames: Sequence[tuple[str, pd.DataFrame]], out: Path, name: str = "act_cdf") -> Path:
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for label, df in frames:
        v = np.sort(df["act_s"].to_numpy())
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s)")
    ax.set_ylabel("fraction of actions")
    ax.set_title("ACT distribution", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return save(fig, out, name)[0]


def utilisation(runs: Sequence[tuple[str, pd.DataFrame]], resource: str, capacity: float,
                out: Path, name: str) -> Path:
    fig, ax = plt.subplots(figsize=(5.2, 3.2))
    for label, u in runs:
        if resource in u:
            ax.step(u["t_s"], u[resource] / capacity * 100, where="post", label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{resource} allocated (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{resource} allocation over time", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return save(fig, out, name)[0]
