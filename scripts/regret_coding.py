"""Quick regret matrix of the coding workload with the competitors cached.

Competitors do not change when only the default policy changes, so their figures are
computed once per cell (cache: JSON lines under --cache) and only ``tangram`` is run
again. Prints the counts over the bounds per metric and the worst cells.

    PYTHONPATH=. .venv/bin/python scripts/regret_coding.py --seeds 1009 2027 3041 --out /tmp/x.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

from analysis.regret import (
    BOUNDS,
    COMPETITORS,
    METRICS,
    Competitor,
    _options,
    cells,
    cluster_of,
    measure,
    row_of,
    scale_for,
    trace_of,
)
from sim.driver import SimConfig, simulate


def _key(cell) -> str:
    return f"{cell.seed}/{cell.cluster}/{cell.rate}/{cell.error}"


def _run(args):
    cell, sc, comps = args
    df = trace_of(cell)
    cluster = cluster_of(cell, sc)
    runs = {}
    for comp in comps:
        opts, sim = _options(comp, cell, sc)
        result = simulate(df, cluster, SimConfig(policy=comp.policy, seed=cell.seed,
                                                 options=opts, **sim))
        runs[comp.label] = measure(result)
    return _key(cell), runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--cache", default="/tmp/regret_cache")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="cell keys seed/cluster/rate/error")
    a = ap.parse_args()
    sc = scale_for(False, a.seeds, ["coding"])
    todo = cells(sc)
    if a.only:
        todo = [c for c in todo if _key(c) in a.only]
    os.makedirs(a.cache, exist_ok=True)
    path = os.path.join(a.cache, "coding_competitors.jsonl")
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                k, runs = json.loads(line)
                cache[k] = runs
    missing = [c for c in todo if _key(c) not in cache]
    # the default and its malleable variant change with the core: never cached
    ours = [Competitor("tangram", "tangram"), Competitor("tangram-malleable", "tangram-malleable")]
    uncached = {c.label for c in ours}
    with ProcessPoolExecutor(max_workers=a.workers) as pool:
        if missing:
            with open(path, "a") as f:
                comps = [c for c in COMPETITORS["coding"] if c.label not in uncached]
                for k, runs in pool.map(_run, [(c, sc, comps) for c in missing]):
                    cache[k] = runs
                    f.write(json.dumps([k, runs]) + "\n")
                    f.flush()
        mine = dict(pool.map(_run, [(c, sc, ours) for c in todo]))
    rows = []
    for c in todo:
        runs = {**mine[_key(c)], **cache[_key(c)]}
        rows.append(row_of(c, cluster_of(c, sc), runs))
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for m in METRICS:
        vals = [(r["regret"][m], r) for r in rows if m in r["regret"]]
        if not vals:
            continue
        over = [(v, r) for v, r in vals if v > BOUNDS[m]]
        worst = max(vals, key=lambda x: x[0])
        print(f"{m:12s} over {BOUNDS[m]}: {len(over):3d}  worst {worst[0]:.3f} "
              f"({_key_row(worst[1])} by {worst[1]['best'][m]})")


def _key_row(r) -> str:
    return f"s{r['seed']}/{r['cluster']}/x{r['rate']}/e{r['profile_sigma']}"


if __name__ == "__main__":
    main()
