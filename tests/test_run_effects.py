"""`tangram run` as a user runs it, on a workload where a light command overstays the lane
(issue 46 #1: since the lane change every such run crashed on the move, then hung).

The trace declares ``sleep 3`` light (profiled, t1 0.01 s): it takes the light lane, overstays
``lane_hold_s`` and is moved off it (the core's ``Moved``: the process backend re-pins
it; docker leaves it where it runs). Each backend's run must finish with exit 0, every
action ok, and the move counted in summary.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent


def overstaying_trace(path: Path) -> Path:
    cores = len(os.sched_getaffinity(0))  # `tangram run` schedules this machine's cores
    rows = [
        # a test run holding every core for 6 s, and a light command that stays light
        dict(trajectory="b", seq=0, kind="test_run", think_s=0.0, t1_s=6.0,
             cpu_cores=str(cores), command="sleep 6"),
        dict(trajectory="b", seq=1, kind="shell", think_s=0.1, t1_s=0.01, cpu_cores="1",
             command="echo done"),
        # declared light, runs 3 s while no core is free: on the lane, then moved off it
        dict(trajectory="a", seq=0, kind="shell", think_s=0.5, t1_s=0.01, cpu_cores="1",
             command="sleep 3", profiled=True),
        dict(trajectory="a", seq=1, kind="shell", think_s=0.2, t1_s=0.01, cpu_cores="1",
             command="true"),
    ]
    pd.DataFrame([{"task": "t", "mem_gb": 0.25, **r} for r in rows]).to_csv(path, index=False)
    return path


@pytest.mark.parametrize("backend", ["process", "docker"])
def test_run_finishes_when_a_light_command_overstays_the_lane(tmp_path: Path, backend: str):
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "run", "--trace",
         str(overstaying_trace(tmp_path / "t.csv")), "--backend", backend, "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    # the move carried out, not raised into the loop (before: AttributeError, 'OutputLog'
    # object has no attribute 'move', logged and the run went on without it or hung)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 0 and summary["actions"] == 4, summary
    assert summary["lane_moves"] >= 1, summary  # the move happened, and was carried out
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(r["status"] for r in rows) == ["ok"] * 4, rows
    # off a terminal, the progress comes as lines (issue 46 #6)
    assert "running t.csv on " + backend in res.stderr
