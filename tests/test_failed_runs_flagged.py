"""Issue 46 #6: a run whose actions failed is never passed off as a win. `tangram simulate`
warns above its summary (failed actions, a quota allocated past its capacity) and
`tangram compare` repeats the warning for that run, whichever column it sits in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tangram(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=900)


def test_a_run_with_failed_actions_is_flagged_by_simulate_and_compare(tmp_path: Path):
    trace = tmp_path / "ds.parquet"
    assert tangram("trace", "generate", "--workload", "deepsearch", "--trajectories", "512",
                   "--seed", "1", "--out", str(trace)).returncode == 0
    # the no-quota baseline sends every call: the search API answers 429 past its quota
    base = tangram("simulate", "--trace", str(trace), "--policy", "baseline", "--out",
                   str(tmp_path / "baseline"))
    assert base.returncode == 0, base.stderr
    flat = " ".join(base.stderr.split())
    assert "actions FAILED" in flat and "over-allocated: quota:search" in flat, flat
    ours = tangram("simulate", "--trace", str(trace), "--out", str(tmp_path / "tangram"))
    assert ours.returncode == 0 and "FAILED" not in ours.stderr, ours.stderr
    cmp = tangram("compare", str(tmp_path / "tangram"), str(tmp_path / "baseline"))
    assert cmp.returncode == 0, cmp.stderr
    flat = " ".join(cmp.stderr.split())
    assert "baseline: " in flat and "actions FAILED" in flat and "tangram:" not in flat, flat
