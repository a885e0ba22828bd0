"""Every policy of `tangram policies` live on GPU workers: one `tangram run` per policy on
a GPU trace, and a JSON table of what each measured (a benchmark: it prints figures, it
asserts nothing).

    python scripts/live_policies.py [--trace traces/samples/mopd.parquet] [--limit N]
        [--think-scale S] [--device cpu] [--out DIR]

Per policy: exit status, actions, failures, mean ACT, restores the workers made
(measured) beside the core's model, evictions, residency mismatches; with the load
average before and after (the figures depend on what else the machine runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tangram.policies import REGISTRY  # noqa: E402


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "traces/samples/mopd.parquet"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--think-scale", type=float, default=0.01)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="where the runs go (default: a temp dir)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="live-policies-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    rows, before = [], loadavg()
    for name in REGISTRY:
        policy = "fixed-dop:2" if name == "fixed-dop:N" else name
        run = out / policy.replace(":", "-")
        argv = [sys.executable, str(ROOT / "cli.py"), "run", "--trace", args.trace,
                "--gpu-device", args.device, "--think-scale", str(args.think_scale),
                "--policy", policy, "--pod-cores", "1", "--out", str(run), "-q",
                *(["--limit", str(args.limit)] if args.limit else [])]
        res = subprocess.run(argv, capture_output=True, text=True, env=env)
        row: dict = {"policy": policy, "rc": res.returncode}
        if res.returncode != 0:
            row["error"] = res.stderr.strip().splitlines()[-1:] or [""]
        else:
            s = json.loads((run / "summary.json").read_text())
            g = s.get("gpu", {})
            row.update({"actions": s["actions"], "failed": s["failed"],
                        "act_mean_s": s["act_mean_s"],
                        "restores_measured": g.get("restores_measured"),
                        "restores_modelled": g.get("restores_modelled"),
                        "evictions": g.get("evictions"),
                        "mismatches": g.get("residency_mismatches")})
        rows.append(row)
    print(json.dumps({"trace": args.trace, "limit": args.limit,
                      "think_scale": args.think_scale, "device": args.device,
                      "loadavg_before": before, "loadavg_after": loadavg(),
                      "cpus": os.cpu_count(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
