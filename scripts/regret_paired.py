"""The default policy's own figures on the quick regret matrix, paired per cell between two
versions of the code (issue 51's rule for a change of schedules).

``run`` simulates only ``tangram`` in every quick cell of the given seeds (the competitors
are not needed to pair Tangram with itself) and writes one JSON line per cell.
``bests`` runs every competitor of the cells whose Tangram figure rose on some metric
between two ``run`` outputs (only those can cross a bound) and writes their best figure
per metric. ``compare`` prints, per seed set and metric, the geometric mean of new / old
over the cells, and, given each version's ``bests``, the cells over a bound now that were
not before.

    PYTHONPATH=. python scripts/regret_paired.py run --seeds 1009 2027 3041 --out old.jsonl
    PYTHONPATH=. python scripts/regret_paired.py bests old.jsonl new.jsonl --out bests.jsonl
    PYTHONPATH=. python scripts/regret_paired.py compare old.jsonl new.jsonl \\
        --sets 1009,2027,3041 11,12,13 --bests old-bests.jsonl new-bests.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ProcessPoolExecutor

from analysis.regret import (
    BOUNDS,
    COMPETITORS,
    METRICS,
    Cell,
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

TANGRAM = Competitor("tangram", "tangram")


def key(cell: Cell) -> str:
    return f"{cell.workload}/{cell.seed}/{cell.cluster}/{cell.rate}/{cell.error}"


def _run(args: tuple[Cell, object, list]) -> tuple[str, dict]:
    cell, sc, comps = args
    df, cluster = trace_of(cell), cluster_of(cell, sc)
    runs = {}
    for comp in comps:
        opts, sim = _options(comp, cell, sc)
        result = simulate(df, cluster, SimConfig(policy=comp.policy, seed=cell.seed,
                                                 options=opts, **sim))
        runs[comp.label] = measure(result)
    return key(cell), runs


def _read(path: str) -> dict[str, dict]:
    with open(path) as f:
        return dict(json.loads(line) for line in f)


def _all_cells(seeds: list[int], workloads: list[str] | None = None
               ) -> tuple[list[Cell], object]:
    sc = scale_for(False, seeds, workloads)
    return cells(sc), sc


def run(seeds: list[int], out: str, workers: int, workloads: list[str] | None) -> None:
    todo, sc = _all_cells(seeds, workloads)
    jobs = [(c, sc, [TANGRAM]) for c in todo]
    with ProcessPoolExecutor(workers) as pool, open(out, "w") as f:
        for k, runs in pool.map(_run, jobs, chunksize=4):
            f.write(json.dumps([k, runs["tangram"]]) + "\n")


def bests(old: str, new: str, out: str, workers: int) -> None:
    a, b = _read(old), _read(new)
    rose = [k for k in a if any(b[k][m] > a[k][m] for m in METRICS
                                if not (math.isnan(a[k][m]) or math.isnan(b[k][m])))]
    seeds = sorted({int(k.split("/")[1]) for k in rose})
    todo, sc = _all_cells(seeds, sorted({k.split("/")[0] for k in rose}))
    todo = [c for c in todo if key(c) in set(rose)]
    jobs = [(c, sc, list(COMPETITORS[c.workload])) for c in todo]
    with ProcessPoolExecutor(workers) as pool, open(out, "w") as f:
        for cell, (k, runs) in zip(todo, pool.map(_run, jobs), strict=True):
            row = row_of(cell, cluster_of(cell, sc), {"tangram": b[k], **runs})
            best = {m: runs[row["best"][m]][m] for m in row["best"]}
            f.write(json.dumps([k, best]) + "\n")
    print(f"{len(rose)} of {len(a)} cells rose on some metric; their competitors in {out}")


def compare(old: str, new: str, sets: list[str], best_files: list[str] | None) -> None:
    a, b = _read(old), _read(new)
    for s in sets:
        seeds = {x for x in s.split(",") if x}
        ks = [k for k in a if k.split("/")[1] in seeds and k in b]
        line = [f"seeds {s} ({len(ks)} cells):"]
        for m in METRICS:
            logs = [math.log(b[k][m] / a[k][m]) for k in ks
                    if a[k][m] > 0 and b[k][m] > 0 and not math.isnan(a[k][m] + b[k][m])]
            gm = math.exp(sum(logs) / len(logs)) if logs else float("nan")
            changed = sum(1 for k in ks if b[k][m] != a[k][m])
            line.append(f"{m} {gm:.4f} ({changed} changed)")
        print("  ".join(line))
    if best_files:
        old_best, new_best = (_read(p) for p in best_files)
        crossed = []
        for k, bn in new_best.items():
            bo = old_best.get(k, bn)
            for m in METRICS:
                if m not in bn or m not in bo:
                    continue
                before, after = a[k][m] / bo[m], b[k][m] / bn[m]
                if before <= BOUNDS[m] < after:
                    crossed.append(f"{k} {m} {before:.4f} -> {after:.4f}")
                elif after <= BOUNDS[m] < before:
                    crossed.append(f"{k} {m} {before:.4f} -> {after:.4f} (now within)")
        print(f"cells crossing a bound ({len(new_best)} checked):")
        for c in crossed:
            print("  " + c)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--seeds", type=int, nargs="+", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--workloads", nargs="+", default=None,
                   help="(default: all four; the CPU path is coding's alone)")
    bs = sub.add_parser("bests")
    bs.add_argument("old")
    bs.add_argument("new")
    bs.add_argument("--out", required=True)
    bs.add_argument("--workers", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--sets", nargs="+", required=True)
    c.add_argument("--bests", nargs=2, default=None)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a.seeds, a.out, a.workers, a.workloads)
    elif a.cmd == "bests":
        bests(a.old, a.new, a.out, a.workers)
    else:
        compare(a.old, a.new, a.sets, a.bests)


if __name__ == "__main__":
    main()
