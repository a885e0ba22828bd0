"""Choosing part of a trace, the same way for `tangram simulate` and `tangram run`."""

from __future__ import annotations

import pandas as pd


def head(df: pd.DataFrame, limit: int | None) -> pd.DataFrame:
    """The first ``limit`` trajectories of a validated trace, in its order (None: all)."""
    if not limit:
        return df
    if limit < 1:
        raise ValueError(f"limit: must be >= 1, got {limit}")
    keep = pd.unique(df["trajectory"])[:limit]
    return df[df["trajectory"].isin(set(keep))].reset_index(drop=True)


def scale_think(df: pd.DataFrame, scale: float) -> pd.DataFrame:
    """Think times multiplied by ``scale`` (0: trajectories never think)."""
    if scale < 0:
        raise ValueError(f"think_scale: must be >= 0, got {scale}")
    if scale == 1.0:
        return df
    out = df.copy()
    out["think_s"] = out["think_s"] * scale
    return out


#: a row's work: its execution time on one unit, the start-up per extra unit and the fixed
#: setup; its timeout scales with them, so an action that timed out still times out
WORK_COLUMNS = ("t1_s", "unit_overhead_s", "setup_s", "timeout_s")


def fixed_work(df: pd.DataFrame) -> pd.Series:
    """Rows whose work cannot be scaled: they run a real ``command``, which does what it
    does however long the trace says it took."""
    return df["command"].astype(str).str.strip() != ""


def scale_work(df: pd.DataFrame, scale: float) -> pd.DataFrame:
    """Every row's work multiplied by ``scale`` (a quick look at a long trace: the burn of
    `tangram run` and the modelled duration of `tangram simulate` alike), except the rows
    of :func:`fixed_work`, which keep their figures so a simulation of the scaled trace
    still models what the live replay runs."""
    if not scale > 0:
        raise ValueError(f"work_scale: must be > 0, got {scale}")
    if scale == 1.0:
        return df
    out = df.copy()
    scaled = ~fixed_work(out)
    for col in WORK_COLUMNS:
        out.loc[scaled, col] = out.loc[scaled, col] * scale
    return out
