"""Counts over the bounds per metric x (cluster, rate) of regret_coding.py outputs."""
import json
import sys
from collections import Counter

from analysis.regret import BOUNDS, METRICS

for path in sys.argv[1:]:
    rows = [json.loads(x) for x in open(path)]
    print(path)
    for m in METRICS:
        c = Counter((r["cluster"], r["rate"]) for r in rows if r["regret"].get(m, 0) > BOUNDS[m])
        print(f"  {m:12s} {sum(c.values()):3d} ", dict(sorted(c.items())))
