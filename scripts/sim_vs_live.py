"""Benchmark: does the simulator predict a live GPU replay? Prints one JSON object.

    PYTHONPATH=. python scripts/sim_vs_live.py [--trajectories 64] [--think-scale 0]
        [--trace FILE] [--gpu-device cpu] [--policy tangram]

Generates a MOPD burst (``tangram trace generate --arrival burst``) unless ``--trace``
is given, replays it live (``tangram run``, GPU workers; the run measures its machine
into its cluster.yaml), simulates it on that cluster.yaml (``tangram simulate
--cluster``), and sets the two side by side: mean ACT of the GPU actions, restores,
batches, and their ratios sim / live (the target of issue 19: within 20% of each other
on a quiet machine). The machine's load average before and after is part of the output:
figures measured on a loaded machine say so. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                         text=True, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"tangram {args[0]} failed ({res.returncode}): {res.stderr[-2000:]}")


def figures(run: Path) -> dict:
    acts = pd.read_parquet(run / "actions.parquet")
    gpu = acts[acts["gpus"].astype(bool)]
    summary = json.loads((run / "summary.json").read_text())
    lead = gpu["batch_of"].where(gpu["batch_of"].astype(bool), gpu["action_id"])
    return {"gpu_actions": len(gpu), "failed": int((gpu["status"] != "ok").sum()),
            "act_mean_s": float(gpu["act_s"].mean()), "queue_mean_s": float(gpu["queue_s"].mean()),
            "exec_mean_s": float(gpu["exec_s"].mean()), "restores": int(summary["restores"]),
            "leases": int(lead.nunique()), "largest_batch": int(lead.value_counts().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--think-scale", default="0")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--gpu-device", default="cpu")
    ap.add_argument("--policy", default="tangram")
    args = ap.parse_args()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(args.trace) if args.trace else Path(tmp) / "burst.parquet"
        if not args.trace:
            cli("trace", "generate", "--workload", "mopd", "--out", str(trace),
                "--trajectories", str(args.trajectories), "--arrival", "burst")
        live, sim = Path(tmp) / "live", Path(tmp) / "sim"
        common = ["--trace", str(trace), "--think-scale", args.think_scale, "--policy",
                  args.policy, "-q"]
        cli("run", *common, "--gpu-device", args.gpu_device, "--out", str(live))
        cli("simulate", *common, "--cluster", str(live / "cluster.yaml"), "--out", str(sim))
        a, b = figures(live), figures(sim)
    ratio = {k: (b[k] / a[k] if a[k] else None)
             for k in ("act_mean_s", "restores", "leases")}
    print(json.dumps({"trace": str(args.trace or f"mopd burst of {args.trajectories}"),
                      "think_scale": args.think_scale, "policy": args.policy,
                      "gpu_device": args.gpu_device, "live": a, "sim": b, "sim_over_live": ratio,
                      "within_20pct": {k: v is not None and abs(v - 1) <= 0.2
                                       for k, v in ratio.items()},
                      "loadavg_before": load0, "loadavg_after": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
