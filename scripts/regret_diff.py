"""Cells whose over-the-bound status differs between two regret_coding.py outputs."""
import json
import sys

from analysis.regret import BOUNDS, METRICS


def cells(path: str) -> dict:
    return {(r["seed"], r["cluster"], r["rate"], r["profile_sigma"]): r
            for r in map(json.loads, open(path))}


a, b = cells(sys.argv[1]), cells(sys.argv[2])
for k in a:
    for m in METRICS:
        x, y = a[k]["regret"].get(m, 0), b[k]["regret"].get(m, 0)
        if (x > BOUNDS[m]) != (y > BOUNDS[m]) or abs(x - y) > 0.1:
            print(k, m, x, "->", y, b[k]["best"].get(m))
