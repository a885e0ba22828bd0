"""`tangram bench regret`: runs the regret matrix (analysis/regret.py, the experiment: its
cells, competitors, summary and heat map) and writes regret.json and regret.png, the file
`tangram reproduce` reads its regret cells from (docs/evidence/regret.json)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from analysis.bench import QUIET, BenchError, Opt, Progress
from analysis.regret import cells, heatmap, report, run_matrix, scale_for


def command(
    out: Annotated[Path, Opt("Directory for regret.json and regret.png.")] = Path("runs/regret"),
    seeds: Annotated[str | None, Opt(
        "Trace seeds, comma-separated (default: 1009,2027,3041, used nowhere else).")] = None,
    workloads: Annotated[str | None, Opt(
        "Workloads, comma-separated (default: coding,deepsearch,mopd,mixed).")] = None,
    full: Annotated[bool, Opt(
        "The paper's batch sizes and node shape, every profile error (hours). Default: the "
        "quick scale (minutes).", flag="--full")] = False,
    workers: Annotated[int, Opt("Parallel simulations.", min=1)] = 2,
    progress: Progress = QUIET,
) -> Iterator[dict[str, Any]]:
    """Metrics: mean ACT, p99 ACT, step time, reward time; competitors: every policy of
    `tangram policies`, fixed DoP 1-16, k8s pod cores x in-pod -n, static GPU splits,
    tangram-paper, one ablation per GPU extension; and which competitor was best. One
    JSON line per cell, then the summary; regret.json and a heat map (regret.png) in
    --out."""
    try:
        sc = scale_for(full, [int(x) for x in seeds.split(",") if x.strip()] if seeds else None,
                       [w.strip() for w in workloads.split(",") if w.strip()]
                       if workloads else None)
    except ValueError as e:
        raise BenchError(str(e)) from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"--out: cannot create {out}: {e}") from None
    t0 = time.perf_counter()
    rows = []
    total = len(cells(sc))
    progress(0, total)
    for row in run_matrix(sc, workers):
        rows.append(row)
        progress(len(rows), total)
        yield {k: v for k, v in row.items() if k != "runs"}
    progress.phase("the summary and the heat map")
    doc = report(rows, sc, round(time.perf_counter() - t0, 1))
    (out / "regret.json").write_text(json.dumps(doc, indent=1) + "\n")
    heatmap(rows, str(out / "regret.png"))
    yield {"summary": doc["summary"], "losses": len(doc["losses"]),
           "regret_json": str(out / "regret.json"), "figure": str(out / "regret.png"),
           "elapsed_s": doc["elapsed_s"]}
