"""`tangram reproduce --quick` (a tiny subset) and `tangram plot`, through the CLI."""

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

from analysis import cache
from analysis.evidence import TUNE_SEED, decomposition, operating_nodes, run_evidence
from analysis.experiments import (
    SCALES,
    GapInstance,
    Runner,
    exhaustive,
    gpus_needed,
    hesrpt,
    jobs_for,
    run_jobs,
    tangram_total,
)
from analysis.reproduce import headline, regret, saved_pct, verdict_lines

ROOT = Path(__file__).parent.parent


#: every results.json row's fields
ROW_KEYS = {"name", "key", "paper", "ours", "unit", "note", "setup", "vs_default", "ci",
            "vs_best", "ci_vs_best", "range", "range_vs_best", "best_baseline", "lead",
            "moved_over_20pct", "evidence"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_reproduce_quick_subset_writes_results_report_and_figures(tmp_path):
    res = cli("reproduce", "--quick", "--only", "fig6", "--only", "optgap", "--out",
              str(tmp_path), "--quiet")
    assert res.returncode == 0, res.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    names = {r["name"] for r in results}
    assert "coding: mean ACT, k8s / Tangram" in names
    for r in results:
        assert set(r) == ROW_KEYS
    act = next(r for r in results if r["name"] == "coding: mean ACT, k8s / Tangram")
    assert act["paper"] == 4.3 and act["ours"] > 1.0  # measured, and Tangram wins here
    # the paper's k8s deployment, and where the paper is silent a sweep with its point
    base = act["setup"]["baseline"]
    assert base["policy"] == "k8s" and base["pod_dop"] == 1
    sweep = act["setup"]["sweep"]
    assert sweep["param"] == "pod_cores" and sweep["point"] == base["pod_cores"]
    assert set(sweep["values"]) == {"2", "4", "8", "16"}
    assert sweep["values"][str(base["pod_cores"])] == act["ours"]
    ds = next(r for r in results if r["name"] == "deepsearch: RL step time, baseline / Tangram")
    assert ds["setup"]["baseline"]["replicas"] == 5 and ds["setup"]["baseline"]["gpu_dop"] == 4
    # equal work: the baseline retries until its calls succeed
    assert ds["setup"]["baseline"]["api_attempts"] is None and "0 calls failed" in ds["note"]
    html = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in html and "Trace parameters and sources" in html
    # rendered, not printed: no Markdown left in the page's text (its figures are data: URIs)
    text = re.sub(r"<[^>]+>", "", re.sub(r'src="data:[^"]+"', "", html))
    assert "**" not in text and "`" not in text and "<strong>" in html and "<code>" in html
    # the verdicts, then the figures, then the details
    assert (html.index("Where the paper") < html.index("<h2>Figures</h2>")
            < html.index("The paper's values") < html.index("Trace parameters and sources"))
    assert (tmp_path / "figures" / "fig6_act.png").exists()
    assert (tmp_path / "figures" / "fig6_act.svg").exists()
    assert (tmp_path / "figures" / "sweep_pod_size.png").exists()
    bad = cli("reproduce", "--quick", "--only", "nope", "--out", str(tmp_path / "x"), "--quiet")
    assert bad.returncode == 2 and "unknown experiment" in bad.stderr


def test_plot_draws_standard_figures(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for out, policy in ((a, "tangram"), (b, "k8s")):
        r = cli("simulate", "--trace", str(ROOT / "traces/samples/mopd.parquet"), "--policy",
                policy, "--out", str(out), "--quiet")
        assert r.returncode == 0, r.stderr
    r = cli("plot", str(a), str(b), "--out", str(tmp_path / "fig"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "fig" / "act_cdf.png").exists()
    r = cli("plot", str(tmp_path / "missing"))
    assert r.returncode == 2 and "summary.json" in r.stderr


def test_optgap_references_bound_each_other():
    inst = GapInstance(sizes=[30.0, 10.0, 20.0], p=0.8, cores=4, choices=[1, 2, 4])
    ex, he, tg = exhaustive(inst), hesrpt(inst), tangram_total(inst)
    assert he <= ex + 1e-9  # preemptive fractional optimum is a lower bound
    assert ex <= tg + 1e-9  # the exhaustive search covers the greedy's choices


#: a scale small enough for a test, with every key the experiments read
TINY = {**SCALES["quick"], "coding": 12, "deepsearch": 6, "mopd": 32, "mixed": 12,
        "cpu_batches": [8, 16], "cpu_nodes": [1], "cpu_cap_batch": 12, "gpu_batches": [32],
        "abl_batches": [16], "ablation_ref": 16, "pod_sizes": [2, 4], "evidence_pods": [2, 4],
        "evidence_nodes": [1],
        "abl_nodes": [1], "decomp_nodes": {"ample": 2, "oversubscribed": 1}, "seeds": [0, 1]}
#: every paper headline that is a ratio against a baseline Tangram can be tuned against
RANGED = ("coding_act", "coding_env", "coding_reward", "coding_step", "deepsearch_step",
          "cpu_scal_small", "cpu_scal_large", "gpu_static", "ablation_dop16")


def test_every_ratio_headline_carries_an_interval_and_the_best_for_its_metric():
    rows = pd.DataFrame(run_jobs(jobs_for(["fig6", "fig8", "fig9"], TINY), workers=1))
    evidence, _ = run_evidence(TINY, workers=1)
    assert set(RANGED) <= set(evidence)
    results = headline(rows, None, TINY, evidence=evidence)
    by_key = {r["key"]: r for r in results if r["evidence"] is not None}
    for key in RANGED:
        row = by_key.get(key)
        assert row is not None, f"{key}: headline row without its evidence"
        lo, hi = row["range"]
        assert lo <= row["ours"] <= hi and row["ours"] == row["vs_default"]
        assert row["ci"][0] <= row["ci"][1] and row["ci_vs_best"][0] <= row["ci_vs_best"][1]
        assert row["vs_best"] is not None and row["range_vs_best"] and row["best_baseline"]
        ev = row["evidence"]
        # every point is the mean of the same seeds, each seed's runs kept
        assert ev["points"][0]["point"] == "lead"
        for p in ev["points"]:
            assert [s["seed"] for s in p["per_seed"]] == TINY["seeds"]
        assert TUNE_SEED not in TINY["seeds"]
        # each assumption it was swept over says where its lead value comes from
        assert ev["lead"] and all(v["source"] for v in ev["lead"].values())
        # the best baseline is the best of its sweep *by this row's metric*, named in the row
        assert len(ev["best"]["sweep"]) >= 2 and row["best_baseline"] == ev["best"]["label"]
        assert ev["best"]["sweep"][ev["best"]["label"]] == min(
            v for v in ev["best"]["sweep"].values() if not math.isnan(v))
        assert set(ev["moved"]) == {"vs_default", "vs_best"}
    # the coding lead is the paper's operating point (pod-cores / cores nearest 1.067)
    nodes = evidence["coding_act"]["lead"]["cpu_nodes"]
    assert nodes["value"] == operating_nodes(TINY["coding"], 4, 64)[0]
    assert "1.067" in nodes["source"]
    # the step: rollout only, and with a training phase swept up to the paper's 1.4x
    tr = evidence["coding_step"]["training"]
    assert tr["sweep"][0]["training_s"] == 0 and tr["sweep"][0]["vs_default"] == \
        evidence["coding_step"]["vs_default"]
    if tr["paper_training_s"] > 0:
        assert abs(tr["sweep"][-1]["vs_default"] - 1.4) < 0.01
    step = next(r for r in results if r["name"].startswith("coding: RL step time with"))
    assert step["ci"] and step["range"] and "T = (k - 1.4 t) / 0.4" in step["note"]
    # the two assumptions that move coding's ACT most, swept jointly at the same seeds
    joint = evidence["coding_act"]["joint"]
    (a, b), (va, vb) = joint["params"], joint["values"]
    assert {(c[a], c[b]) for c in joint["cells"]} == {(x, y) for x in va for y in vb}
    assert all(c["ci_vs_default"] for c in joint["cells"])
    # DeepSearch: equal work (no failed call), completed searches per second reported
    for p in evidence["deepsearch_step"]["points"]:
        assert p["failed_trajectories_default"] == 0 and p["searches_per_s_default"] > 0
        assert isinstance(p["bound_by_longest_trajectory"], bool)
    decomp = decomposition(TINY, evidence, workers=1)
    rungs = {(d["cluster"], d["rung"]) for d in decomp}
    assert ("oversubscribed", "sharing alone (cores per action, DoP 1, no light lane)") in rungs
    assert any(r.startswith("static best") for _, r in rungs)
    # the prose: row by row, whether the paper's number is reproduced
    prose = "\n".join(verdict_lines(results, None))
    assert "deepsearch: RL step time" in prose and "regret matrix" in prose


def test_saved_gpus_is_null_with_a_reason_when_never_met():
    assert saved_pct(None, 36, 40) == (None, "never met: Tangram's mean ACT stayed above the "
                                          "target at every count up to 40 GPUs")
    assert saved_pct(36, 36, 40) == (0.0, None)  # met with as many GPUs as static: 0%
    assert saved_pct(9, 36, 40)[0] == 75.0


def test_regret_cells_above_one_are_rendered(tmp_path):
    path = tmp_path / "regret.json"
    assert regret(path=path) is None
    cell = {"workload": "coding", "seed": 0, "cluster": "small", "rate": 1.0,
            "profile_sigma": 0.3, "regret": {"act_mean": 1.07, "act_p99": 0.9},
            "best": {"act_mean": "fixed-dop:4", "act_p99": "k8s"}}
    path.write_text(json.dumps({"scale": "quick", "cells": [cell]}))
    got = regret(path=path)
    assert [c["metric"] for c in got["over_1"]] == ["act_mean"]
    prose = "\n".join(verdict_lines([], got))
    assert "1 (cell, metric) pairs" in prose and "| 1.07 | fixed-dop:4 |" in prose
    path.write_text("{")
    assert "unreadable" in regret(path=path)["error"]


def test_operating_point_arithmetic():
    nodes, text = operating_nodes(1024, 4, 256)
    assert nodes == 15 and "4,096 pod-cores on 15 x 256 = 3,840 cores = 1.067" in text
    assert operating_nodes(96, 4, 64)[0] == 6  # 384 / 384 = 1.0 is nearer than 384 / 320


def test_runs_and_traces_are_cached_by_their_inputs(tmp_path):
    job = jobs_for(["fig6"], TINY)[0]
    first = run_jobs([job], Runner(1, tmp_path))[0]
    assert len(list((tmp_path / "runs").iterdir())) == 1
    assert len(list((tmp_path / "traces").iterdir())) == 1
    # a second run is served from the cache: the same row, nothing simulated again
    (tmp_path / "traces" / next((tmp_path / "traces").iterdir()).name).unlink()
    assert run_jobs([job], Runner(1, tmp_path))[0] == first
    assert not list((tmp_path / "traces").iterdir())
    other = replace(job, seed=job.seed + 1)
    assert cache.key(other, cache.SIM_CODE) != cache.key(job, cache.SIM_CODE)


def test_gpus_needed_is_monotone_and_names_the_points_below_it():
    act = {16: 0.9, 17: 1.2, 18: 0.95, 19: 1.1, 20: 0.9, 24: 0.8}
    need, lucky = gpus_needed(act, 1.0)
    assert need == 20 and lucky == [16, 18]
    assert gpus_needed({8: 2.0}, 1.0) == (None, [])
