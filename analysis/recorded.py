"""A recording (`--record`, executor/record.py) against its replay: what the run measured
and what `tangram simulate` predicts on the cluster the run had.

    from analysis.recorded import replay_error
    replay_error("runs/step.jsonl")   # {"recorded": ..., "simulated": ..., "error_pct": ...}
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

#: the figures compared: a recording's name -> the simulation summary's
FIGURES = {"mean_act_s": "act_mean_s", "p99_act_s": "act_p99_s", "step_s": "step_time_s"}


def observed(rows: pd.DataFrame) -> dict[str, float]:
    """What the recorded run measured, from a recording's rows (``traces.schema.read_raw``):
    actions, mean and p99 ACT (queue + execution) and the step time (from the first
    trajectory's open to the last action's end), and the share of ACT spent queueing."""
    ran = rows[rows["status"] != "cancelled"] if "status" in rows else rows
    submit, start, end = (ran[c].astype(float).to_numpy() for c in ("submit_s", "start_s",
                                                                     "end_s"))
    act = end - submit
    if not len(act):
        return {"actions": 0, "mean_act_s": math.nan, "p99_act_s": math.nan,
                "step_s": math.nan, "queue_share": math.nan}
    return {"actions": int(len(act)), "mean_act_s": float(act.mean()),
            "p99_act_s": float(np.percentile(act, 99)), "step_s": float(end.max()),
            "queue_share": float((start - submit).sum() / act.sum()) if act.sum() else 0.0}


def replay_error(recording: str | Path, policy: str = "tangram",
                 cluster: str | Path | None = None) -> dict[str, Any]:
    """The recording's figures, its simulation's on ``cluster`` (default: the one beside it,
    ``<stem>-cluster.yaml``) under ``policy``, and the error of each in percent."""
    from analysis.runs import simulate
    from traces.schema import read_raw

    recording = Path(recording)
    rows, _ = read_raw(recording)
    if "submit_s" not in rows:
        raise ValueError(f"{recording}: not a recording (no submit_s column): make one with "
                         "--record")
    got = observed(rows)
    beside = recording.with_name(f"{recording.stem}-cluster.yaml")
    run = simulate(recording, str(cluster or beside), policy)
    sim = {k: float(run.summary[v]) for k, v in FIGURES.items()}
    return {"recording": str(recording), "actions": got["actions"],
            "queue_share": got["queue_share"], "recorded": {k: got[k] for k in FIGURES},
            "simulated": sim,
            "error_pct": {k: 100.0 * (sim[k] - got[k]) / got[k] if got[k] else math.nan
                          for k in FIGURES}}
