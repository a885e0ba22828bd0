"""Regenerate notebooks/data/sim_vs_live/ (the runs sim_vs_live.ipynb reads) with the
project's own commands:

    .venv/bin/python notebooks/data/make_sim_vs_live.py

1. `tangram trace generate --workload coding --trajectories 6` (seed 0), then made short
   enough to replay in about a minute: think times x0.05, test runs' T1 x0.1; each row's
   command sleeps for the trace's modelled time on the cores it is granted
   (T1 * ((1 - p) + p / m) for an elastic row on m cores, T1 otherwise), so the live run
   exercises the scheduler and the executor, not a real test suite;
2. `tangram run --backend process` of that trace (this machine's cores);
3. `tangram simulate` of the same trace on the cluster the live run recorded.

The runs' `work/` directories are removed; what stays is a few hundred KB.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

from traces.schema import write

HERE = Path(__file__).parent / "sim_vs_live"
TANGRAM = [sys.executable, str(Path(__file__).resolve().parents[2] / "cli.py")]
THINK_SCALE, TEST_SCALE = 0.05, 0.1

# a sleeper that follows Amdahl's law on the cores it was pinned to
SLEEPER = ("python3 -c 'import os, time; m = len(os.sched_getaffinity(0)); "
           "time.sleep({t1:.4f} * ((1 - {p:.4f}) + {p:.4f} / m))'")


def command(row: pd.Series) -> str:
    if row["elastic"] and not math.isnan(row["parallel_fraction"]):
        return SLEEPER.format(t1=row["t1_s"], p=row["parallel_fraction"])
    return f"sleep {row['t1_s']:.4f}"


def tangram(*args: str) -> None:
    print("+ tangram", " ".join(args), flush=True)
    subprocess.run([*TANGRAM, *args], check=True)


def cluster_file(resolved: dict) -> dict:
    """The resolved cluster of config.json as a cluster YAML (one group per named node:
    node ``local`` becomes ``local0``)."""
    out = dict(resolved)
    for group in ("cpu_nodes", "gpu_nodes"):
        out[group] = [{"count": 1, "prefix": n.pop("name"), **n}
                      for n in (dict(node) for node in resolved[group])]
    return out


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    HERE.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "coding.parquet"
        tangram("trace", "generate", "--workload", "coding", "--trajectories", "6",
                "--seed", "0", "--out", str(raw))
        df = pd.read_parquet(raw)
    df["think_s"] = (df["think_s"] * THINK_SCALE).round(4)
    tests = df["kind"].isin(["test_run", "reward_test"])
    df.loc[tests, "t1_s"] = (df.loc[tests, "t1_s"] * TEST_SCALE).round(4)
    df["command"] = df.apply(command, axis=1)
    trace = HERE / "trace.parquet"
    write(df, trace)
    tangram("trace", "validate", str(trace))

    tangram("run", "--trace", str(trace), "--backend", "process", "--out", str(HERE / "live"),
            "--quiet")
    shutil.rmtree(HERE / "live" / "work", ignore_errors=True)
    cluster = json.loads((HERE / "live" / "config.json").read_text())["cluster"]
    (HERE / "cluster.yaml").write_text(yaml.safe_dump(cluster_file(cluster), sort_keys=False))
    tangram("simulate", "--trace", str(trace), "--cluster", str(HERE / "cluster.yaml"),
            "--out", str(HERE / "sim"), "--quiet")
    size = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"wrote {HERE} ({size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
