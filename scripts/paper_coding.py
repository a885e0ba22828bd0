"""Paper-scale coding check of the default policy against fixed DoPs and the best k8s pod
(the reproduction's ablation and coding_act points, a few seeds): JSON lines of mean ACT,
p99 ACT, step time and the reward actions' mean ACT per (policy, batch, cpu_nodes, seed).

    PYTHONPATH=. .venv/bin/python scripts/paper_coding.py --policies tangram fixed-dop:8 --out x.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from analysis.experiments import Job, _opts, run_job

POINTS = ((1280, 15), (1280, 12), (1280, 8), (1024, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", nargs="+", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", nargs="*", default=None, help="BATCHxNODES, e.g. 1280x15")
    a = ap.parse_args()
    points = (tuple(tuple(map(int, p.split("x"))) for p in a.points) if a.points
              else POINTS)
    with open(a.out, "a") as f:
        for seed in a.seeds:
            for batch, nodes in points:
                for label in a.policies:
                    policy, opts = label, _opts("coding", label)
                    if label.startswith("k8s"):  # k8s:POD:DOP
                        _, pod, dop = label.split(":")
                        policy, opts = "k8s", _opts("coding", "k8s", pod_cores=int(pod),
                                                    pod_dop=int(dop))
                    job = Job("check", "coding", batch, policy, "paper", seed=seed,
                              cpu_nodes=nodes, options=opts, profile_sigma=0.3)
                    t = time.time()
                    r = run_job(job)
                    row = {"policy": label, "batch": batch, "nodes": nodes, "seed": seed,
                           "wall_s": round(time.time() - t, 1),
                           **{k: r[k] for k in ("act_mean_s", "act_p99_s", "step_time_s")
                              if k in r}}
                    # mean ACT of the reward actions, as analysis/regret.py ``measure``'s reward_s
                    reward = (r.get("per_category") or {}).get("reward")
                    if reward:
                        row["reward_s"] = reward["act_mean_s"]
                    if "act_mean_s" not in r:  # (a run without the figures: say what it has)
                        row["keys"] = sorted(r)[:40]
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(row, flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
