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
