"""`tangram reproduce`: run the experiments, draw the figures, set our numbers
beside the paper's (results.json, report.md, report.html)."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import figures
from analysis.evidence import (
    SEEDS,
    SKEW,
    TUNE_SEED,
    _moves,
    decomposition,
    mean_interval,
    run_evidence,
)
from analysis.experiments import (
    BASELINE_OF,
    EXPERIMENTS,
    EXTRA,
    HEADLINE_QUOTA,
    PAPER_BASELINE,
    SCALES,
    Runner,
    Workers,
    gpu_savings,
    gpus_needed,
    jobs_for,
    optgap,
    scale_of,
    table1_job,
)
from analysis.paper import CITATION, PAPER, TEACHER_DEMAND_NOTE
from analysis.report_html import markdown_to_html
from sim.cluster import load_cluster
from traces.generate import CALIBRATION


def _ratio(a: float, b: float) -> float:
    return float(a / b) if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _get(df: pd.DataFrame, **match: Any) -> pd.Series | None:
    sub = df
    for k, v in match.items():
        if k not in sub:
            return None
        sub = sub[sub[k] == v]
    return None if sub.empty else sub.iloc[0]


def _pair_setup(ours: pd.Series, base: pd.Series, **extra: Any) -> dict[str, Any]:
    """The setup of a ratio row: both runs' parameters."""
    return {"tangram": ours.setup, "baseline": base.setup, **extra}


def _sweep(points: dict[Any, float], param: str, point: Any) -> dict[str, Any]:
    """Which point of a sweep a headline value is, and the whole range."""
    vals = [v for v in points.values() if not math.isnan(v)]
    return {"param": param, "point": point,
            "values": {str(k): round(v, 4) for k, v in points.items()},
            "range": [round(min(vals), 4), round(max(vals), 4)] if vals else None}


def _k8s_ratios(rows: pd.DataFrame, t: pd.Series) -> dict[int, float]:
    pods = rows[(rows["experiment"] == "fig6_pods") & (rows["variant"].fillna("") == "")] \
        if "variant" in rows else rows[rows["experiment"] == "fig6_pods"]
    pods = pods[pods["policy"] == "k8s"]
    return {int(r.x): _ratio(r.act_mean_s, t.act_mean_s) for r in pods.itertuples()}


def _lead_note(ev: dict[str, Any]) -> str:
    """Where a headline's figure is measured: its lead point, the seeds, the interval."""
    lead = ", ".join(f"{k}={v['value']}" for k, v in ev["lead"].items())
    return (f"; lead point {lead or '(no assumption)'}: the mean over {len(ev['seeds'])} "
            f"seeds, [95% bootstrap interval]; vs best: {ev['best']['label']}, the best for "
            f"this row's metric (tuned once at seed {TUNE_SEED}, held)")


def _attach(row: dict[str, Any], ev: dict[str, Any] | None) -> None:
    """A headline row's evidence: its interval over seeds, the range over the other
    points of its assumptions, and the ratio against the paper's default baseline and
    against the best baseline for this row's metric."""
    if ev is None:
        return
    row["ours"] = ev["vs_default"]
    row["vs_default"] = ev["vs_default"]
    row["ci"] = ev["ci_vs_default"]
    row["vs_best"] = ev["vs_best"]
    row["ci_vs_best"] = ev["ci_vs_best"]
    row["range"] = ev["range_vs_default"]
    row["range_vs_best"] = ev["range_vs_best"]
    row["best_baseline"] = ev["best"]["label"]
    row["lead"] = ev["lead"]
    row["moved_over_20pct"] = ev["moved_over_20pct"]
    row["evidence"] = ev
    row["note"] += _lead_note(ev)
    row["setup"] = {**row["setup"], "lead_point": {k: v["value"] for k, v in ev["lead"].items()}}


def headline(rows: pd.DataFrame, gaps: pd.DataFrame | None, scale: str | dict[str, Any],
             savings: pd.DataFrame | None = None,
             overheads: list[dict[str, Any]] | None = None,
             evidence: dict[str, dict[str, Any]] | None = None,
             savings_points: list[dict[str, Any]] | None = None,
             overhead_seeds: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every headline figure of the paper with ours beside it; each row's ``setup``
    says which runs (and which point of a sweep) it comes from. With ``evidence``
    (analysis/evidence.py), a paper row also carries its range (seeds and unswept
    assumptions) and its ratio against the default and the best-tuned baseline."""
    sc = scale_of(scale)
    ev = evidence or {}
    out: list[dict[str, Any]] = []

    def add(name: str, key: str | None, ours: float | None, unit: str, note: str,
            setup: dict[str, Any], paper: Any = None) -> dict[str, Any]:
        row = {"name": name, "key": key, "paper": PAPER[key].value if key else paper,
               "ours": None if ours is None or (isinstance(ours, float) and math.isnan(ours))
               else round(float(ours), 4), "unit": unit, "note": note, "setup": setup,
               "vs_default": None, "ci": None, "vs_best": None, "ci_vs_best": None,
               "range": None, "range_vs_best": None,
               "best_baseline": None, "lead": None, "moved_over_20pct": None,
               "evidence": None}
        _attach(row, ev.get(key) if key else None)
        out.append(row)
        return row

    _fig6_rows(add, rows, sc, ev)
    _cpu_scalability_rows(add, rows)
    _gpu_static_rows(add, rows)
    if savings is not None and not savings.empty:
        add_savings(add, savings, savings_points or [])
    _ablation_rows(add, rows, sc)
    _overhead_rows(add, overheads or [], overhead_seeds or [])
    _beyond_rows(add, rows, gaps)
    return out


#: headline's row maker (its ``add``): name, key, ours, unit, note, setup[, paper] -> the row
AddRow = Callable[..., dict[str, Any]]


def _fig6_rows(add: AddRow, rows: pd.DataFrame, sc: dict[str, Any],
               ev: dict[str, dict[str, Any]]) -> None:
    """Fig. 6: the coding rows (k8s against Tangram) and the deepsearch rows (the
    baseline against Tangram, per search quota)."""
    f6 = rows[rows["experiment"] == "fig6"]
    if f6.empty:
        return
    _coding_rows(add, rows, f6, sc, ev)
    _deepsearch_rows(add, f6, ev)


def _coding_rows(add: AddRow, rows: pd.DataFrame, f6: pd.DataFrame, sc: dict[str, Any],
                 ev: dict[str, dict[str, Any]]) -> None:
    """Fig. 6, coding: k8s against Tangram (ACT, environment, reward and step time; the
    step with a training phase; the variant whose pods are held to the rollout's end)."""
    t, k = _get(f6, workload="coding", policy="tangram"), _get(f6, workload="coding", policy="k8s")
    if t is not None and k is not None:
        pods = _k8s_ratios(rows, t)
        pod = PAPER_BASELINE["coding"]["pod_cores"]
        sweep = _sweep(pods, "pod_cores", pod) if pods else None
        rng = (f"; pod size {min(pods)}-{max(pods)} cores (single-process) gives "
               f"{sweep['range'][0]:.3g}x-{sweep['range'][1]:.3g}x") if sweep else ""
        add("coding: mean ACT, k8s / Tangram", "coding_act",
            _ratio(k.act_mean_s, t.act_mean_s), "x",
            f"{sc['coding']} trajectories, pods of {pod} cores created at trajectory "
            f"open, tests single-process; on cluster '{sc['base']}' ({int(t.cpu_nodes)} "
            f"nodes, seed 0) {_ratio(k.act_mean_s, t.act_mean_s):.3g}x{rng}",
            _pair_setup(t, k, sweep=sweep))
        env = _ratio(k.per_category["env"]["per_trajectory_s"],
                     t.per_category["env"]["per_trajectory_s"])
        add("coding: environment interaction time, k8s / Tangram", "coding_env", env, "x",
            "sum of a trajectory's tool-call ACTs (shell, edits, agent test runs)",
            _pair_setup(t, k))
        rew = _ratio(k.per_category["reward"]["per_trajectory_s"],
                     t.per_category["reward"]["per_trajectory_s"])
        add("coding: reward time, k8s / Tangram", "coding_reward", rew, "x",
            "the hidden test suite (single-process in its pod)", _pair_setup(t, k))
        add("coding: RL step time, rollout only, k8s / Tangram", "coding_step",
            _ratio(k.step_time_s, t.step_time_s),
            "x", "step = rollout (no training time added): an upper bound of the step "
            "ratio; the paper's step includes training (next row)", _pair_setup(t, k))
        tr = ev.get("coding_step", {}).get("training")
        if tr:
            row = add("coding: RL step time with a training phase T, k8s / Tangram", None,
                      tr["vs_default"], "x",
                      f"T = {tr['lead_training_s']:.0f} s ({tr['lead_source']}); swept "
                      f"from 0 to {tr['paper_training_s']:.0f} s, the T that would make "
                      f"the paper's 1.4x: {tr['arithmetic']}",
                      {"training": tr}, paper=PAPER["coding_step"].value)
            row.update({"vs_default": tr["vs_default"], "ci": tr["ci_vs_default"],
                        "vs_best": tr["vs_best"], "ci_vs_best": tr["ci_vs_best"],
                        "range": tr["range_vs_default"],
                        "range_vs_best": tr["range_vs_best"],
                        "best_baseline": ev["coding_step"]["best"]["label"],
                        "lead": {"training_s": {"value": tr["lead_training_s"],
                                                "source": tr["lead_source"]}},
                        "key": "coding_step_training",
                        "moved_over_20pct": ["training_s"] if _moves(
                            [r["vs_default"] for r in tr["sweep"]]) else []})
        held = rows[(rows["experiment"] == "fig6_pods") & (rows.get("variant") ==
                                                             "held to rollout end")] \
            if "variant" in rows else pd.DataFrame()
        h, th = _get(held, policy="k8s"), _get(held, policy="tangram")
        if h is not None and th is not None:
            add("coding (variant): mean ACT, k8s with pods held to rollout end / Tangram",
                None, _ratio(h.act_mean_s, th.act_mean_s), "x",
                f"batch {int(h.trajectories)}: the largest whose pods all fit (a larger "
                "one deadlocks); RL step time ratio "
                f"{_ratio(h.step_time_s, th.step_time_s):.3g}x", _pair_setup(th, h))


def _deepsearch_rows(add: AddRow, f6: pd.DataFrame, ev: dict[str, dict[str, Any]]) -> None:
    """Fig. 6, deepsearch: the RL step time, baseline against Tangram, per search quota."""
    for quota in (HEADLINE_QUOTA, *sorted(set(f6["quota"]) - {HEADLINE_QUOTA, ""})):
        t, b = (_get(f6, workload="deepsearch", policy=p, quota=quota)
                for p in ("tangram", "baseline"))
        if t is None or b is None:
            continue
        head = quota == HEADLINE_QUOTA
        e = ev.get("deepsearch_step") if head else None
        work = ""
        if e:
            lead = e["points"][0]
            work = (f"; equal work: completed searches/s Tangram "
                    f"{lead['searches_per_s_tangram']:.3g} vs baseline "
                    f"{lead['searches_per_s_default']:.3g}; step {lead['step_s']:.0f} s vs "
                    f"the longest trajectory's own think + execution "
                    f"{lead['longest_trajectory_s']:.0f} s"
                    + (" (bound by it: no scheduler could shorten this step)"
                       if lead["bound_by_longest_trajectory"] else ""))
        add("deepsearch: RL step time, baseline / Tangram" + ("" if head else f" ({quota})"),
            "deepsearch_step" if head else None, _ratio(b.step_time_s, t.step_time_s), "x",
            f"search quota: Brave Search API {quota} plan; baseline = per-trajectory calls "
            f"retried until they succeed ({int(b.api_429s or 0)} HTTP 429s, "
            f"{int(b.api_failed or 0)} calls failed; Tangram: {int(t.failed)} failed) + 5 "
            f"static judge replicas x 4 GPUs{work}", _pair_setup(t, b))


def _cpu_scalability_rows(add: AddRow, rows: pd.DataFrame) -> None:
    """Fig. 8 (CPU): k8s against Tangram at the smallest and the largest batch."""
    f8 = rows[rows["experiment"] == "fig8_cpu_batch"]
    if not f8.empty:
        pod = PAPER_BASELINE["coding"]["pod_cores"]
        xs = sorted(f8["x"].unique())
        by_pod: dict[int, dict[int, float]] = {}
        for r in f8[(f8["policy"] == "k8s") & (f8["pod_dop"] == 1)].itertuples():
            t = _get(f8, x=r.x, policy="tangram")
            by_pod.setdefault(int(r.pod), {})[int(r.x)] = _ratio(r.act_mean_s, t.act_mean_s)
        cores = float(f8.iloc[0].cpu_cores)
        for label, x, key in (("smallest", xs[0], "cpu_scal_small"),
                              ("largest", xs[-1], "cpu_scal_large")):
            t, k = _get(f8, x=x, policy="tangram"), _get(f8, x=x, policy="k8s", pod=pod,
                                                         pod_dop=1)
            per_pod = {p: v[int(x)] for p, v in by_pod.items()}
            add(f"CPU scalability: mean ACT k8s / Tangram, {label} batch", key,
                _ratio(k.act_mean_s, t.act_mean_s), "x",
                f"batch {int(x)} on {cores:.0f} cores, pods of {pod}: oversubscription "
                f"{x * pod / cores:.2f} pod-cores per core; the paper's range is 3.1x-27.7x "
                f"as the batch grows; other pod sizes (single-process): "
                + ", ".join(f"{p}: {v:.3g}x" for p, v in sorted(per_pod.items())),
                _pair_setup(t, k, sweep=_sweep(per_pod, "pod_cores", pod),
                            oversubscription=round(x * pod / cores, 4)))


def _gpu_static_rows(add: AddRow, rows: pd.DataFrame) -> None:
    """Fig. 8 (GPU): static deployments against Tangram at the largest batch."""
    g8 = rows[rows["experiment"] == "fig8_gpu_batch"]
    if not g8.empty:
        top = g8["x"].max()
        t, s = _get(g8, x=top, policy="tangram"), _get(g8, x=top, policy="static")
        ratios = {int(x): _ratio(_get(g8, x=x, policy="static").act_mean_s,
                                 _get(g8, x=x, policy="tangram").act_mean_s)
                  for x in sorted(g8["x"].unique())}
        by_batch = ", ".join(f"{x}: {v:.3g}x" for x, v in ratios.items())
        add(f"GPU: mean ACT static / Tangram at batch {int(top)}", "gpu_static",
            _ratio(s.act_mean_s, t.act_mean_s), "x",
            f"paper: batch 2048; static = 9 teachers x 4 GPUs (SGLang-like, one replica each); "
            f"calls across teachers: Zipf exponent {SKEW.lead} ({TEACHER_DEMAND_NOTE}); "
            f"static / Tangram by batch (seed 0): {by_batch}",
            _pair_setup(t, s, by_batch=by_batch))


def _ablation_rows(add: AddRow, rows: pd.DataFrame, sc: dict[str, Any]) -> None:
    """Fig. 9: the fixed DoP 16 against Tangram (by node count), and the paper's
    Alg. 1-2 against ours."""
    f9 = rows[rows["experiment"] == "fig9"]
    f9c = rows[rows["experiment"] == "fig9_capacity"]
    if not f9.empty or not f9c.empty:
        ref = min(f9["x"].unique(), key=lambda x: abs(x - sc["ablation_ref"])) \
            if not f9.empty else sc["ablation_ref"]
        by_cap, saturated = {}, []
        for n in sorted(f9c["x"].unique()) if not f9c.empty else []:
            t, d = _get(f9c, x=n, policy="tangram"), _get(f9c, x=n, policy="fixed-dop:16")
            by_cap[int(n)] = _ratio(d.act_mean_s, t.act_mean_s)
            # DoP 16 saturates the cores when its actions wait at least as long as they run
            if d.queue_mean_s >= d.exec_mean_s:
                saturated.append(int(n))
        base_nodes = len(load_cluster(sc["base"]).cpu_nodes)
        src = f9[f9["x"] == ref] if not f9.empty else f9c[f9c["x"] == base_nodes]
        t, d = _get(src, policy="tangram"), _get(src, policy="fixed-dop:16")
        if t is not None and d is not None:
            add(f"ablation: mean ACT fixed DoP=16 / Tangram at batch {sc['ablation_ref']}",
                "ablation_dop16", _ratio(d.act_mean_s, t.act_mean_s), "x",
                f"paper: batch 1280; cluster '{sc['base']}' ({base_nodes} CPU nodes, the "
                "paper's testbed in the full run); DoP 16 saturates the cores (its queueing "
                f">= its execution) at {saturated or 'no capacity swept'}; by node count: "
                + ", ".join(f"{n}: {v:.3g}x" for n, v in by_cap.items()),
                _pair_setup(t, d, sweep=_sweep(by_cap, "cpu_nodes", base_nodes)))
        if not f9.empty:
            p = _get(f9, x=ref, policy="tangram-paper")
            t = _get(f9, x=ref, policy="tangram")
            if p is not None:
                add(f"beyond: mean ACT paper's Alg. 1-2 / ours at batch {int(ref)}", None,
                    _ratio(p.act_mean_s, t.act_mean_s), "x",
                    "ours anticipates closed-loop arrivals, may hold an elastic action "
                    "(bounded) for a wider grant, and prices GPU restores in the DP",
                    _pair_setup(t, p))


def _overhead_rows(add: AddRow, overheads: list[dict[str, Any]],
                   overhead_seeds: list[dict[str, Any]]) -> None:
    """Table 1: the system overhead over execution time, CPU and GPU, over the seeds."""
    for r in overheads:
        seeds = [o for o in overhead_seeds if o["workload"] == r["workload"]]
        if r["workload"] == "coding":
            row = add("CPU: system overhead / execution time (Table 1)", "table1_cpu",
                      r["overhead_share_pct"], "%",
                      "scheduling decision (measured in the simulation) + allocate-on-execution "
                      f"({r['aoe_source']}, applied to every CPU action) + restore, over "
                      "execution", r["setup"])
            vals = [o["overhead_share_pct"] for o in seeds]
        elif r["workload"] == "mopd":
            row = add("GPU: restore overhead / execution time (Table 1)", "table1_gpu",
                      100 * r["gpu_restore_s"] / max(r["execution_s"], 1e-9), "%",
                      "EOE restores from host memory, over execution", r["setup"])
            vals = [100 * o["gpu_restore_s"] / max(o["execution_s"], 1e-9) for o in seeds]
        else:
            continue
        if vals:
            row["range"] = _span([row["ours"], *vals])
            mean, row["ci"] = mean_interval([row["ours"], *vals])
            row["ours"] = row["vs_default"] = round(mean, 4)
            row["note"] += (f"; the mean over seeds {list(SEEDS)} [95% bootstrap interval] "
                            "(no baseline: Tangram's own overhead)")
            row["lead"] = {"seed": {"value": list(SEEDS), "source": "the mean over the seeds"}}


def _beyond_rows(add: AddRow, rows: pd.DataFrame, gaps: pd.DataFrame | None) -> None:
    """Beyond the paper: greedy eviction against the optimum and a lower bound, and
    FCFS against shortest-expected-first."""
    if gaps is not None and not gaps.empty:
        add("beyond: greedy eviction vs exhaustive optimum (mean excess)", None,
            100 * gaps["gap_vs_exhaustive"].mean(), "%",
            "exhaustive over per-action DoPs, FCFS list scheduling, small instances; "
            f"the paper's Alg. 1-2: {100 * gaps['paper_gap_vs_exhaustive'].mean():.1f}%",
            {"instances": int(len(gaps))})
        add("beyond: greedy eviction vs heSRPT lower bound (mean excess)", None,
            100 * gaps["gap_vs_hesrpt"].mean(), "%", "heSRPT preempts and splits cores",
            {"instances": int(len(gaps))})
    od = rows[rows["experiment"] == "ordering"]
    if not od.empty:
        f, s = _get(od, ordering="fcfs"), _get(od, ordering="sef")
        add("beyond: mean ACT FCFS / shortest-expected-first (aging 30 s)", None,
            _ratio(f.act_mean_s, s.act_mean_s), "x",
            f"p99 ACT {f.act_p99_s:.1f} s vs {s.act_p99_s:.1f} s; max queue "
            f"{f.queue_max_s:.1f} s vs {s.queue_max_s:.1f} s", {"fcfs": f.setup, "sef": s.setup})


def saved_pct(gpus: int | None, used: int, top: int) -> tuple[float | None, str | None]:
    """GPUs saved (%) when Tangram meets the target with ``gpus`` of ``used``; None, and
    why, when no count up to ``top`` met it (0% would read as "as many GPUs as static")."""
    if gpus is None:
        return None, f"never met: Tangram's mean ACT stayed above the target at every count up to {top} GPUs"
    return round((1 - gpus / used) * 100, 2), None


def add_savings(add: Callable[..., dict[str, Any]], savings: pd.DataFrame,
                points: list[dict[str, Any]]) -> None:
    """The GPU-savings headline: the mean over the seeds at the lead teacher skew, with its
    95% interval, or none (and why) when a seed never met static's mean ACT."""
    ref = savings[(savings["policy"] == "static") & (savings["seed"] == 0)].iloc[0]
    used = 9 * PAPER_BASELINE["mopd"]["gpu_dop"]
    seeds = [p for p in points if p["param"] == "seed"]
    missed = [p["seed"] for p in seeds if p["saved_pct_default"] is None]
    value, ci = mean_interval([p["saved_pct_default"] for p in seeds]) if seeds and not missed \
        else (None, None)
    best_missed = [p["seed"] for p in seeds if p["saved_pct_best"] is None]
    vb, cib = mean_interval([p["saved_pct_best"] for p in seeds]) if seeds and not best_missed \
        else (None, None)
    need = {p["seed"]: p["gpus_default"] for p in seeds}
    why = (f"; null: {seeds[0]['reason_default']} at seed(s) {missed}" if missed else "")
    row = add("GPU: GPUs saved at equal mean ACT vs static", "gpu_saved", value, "%",
              f"static: 9 teachers x 4 GPUs = {used} GPUs (of {int(ref.x)}), mean ACT "
              f"{ref.act_mean_s:.3g} s (seed 0); GPUs Tangram needs per seed: {need} (1-GPU "
              "steps; the fewest from which every larger count also meets static's ACT)"
              f"{why}; vs best: the best static split's ACT on all {int(ref.x)} GPUs"
              + (f", not met at seed(s) {best_missed}" if best_missed else ""),
              {"static": ref.setup, "tangram_gpus": need, "resolution_gpus": 1,
               "sweep": _sweep({int(r.x): float(r.act_mean_s) for r in savings[
                   (savings["policy"] == "tangram") & (savings["seed"] == 0)].itertuples()},
                   "gpus (tangram mean ACT, s, seed 0)", need.get(0))})
    if not points:
        return
    saved = [p["saved_pct_default"] for p in points]
    best = [p["saved_pct_best"] for p in points]
    row.update({"vs_default": row["ours"], "ci": ci, "range": _span(saved),
                "vs_best": None if vb is None else round(vb, 2), "ci_vs_best": cib,
                "range_vs_best": _span(best), "best_baseline": points[0]["best_label"],
                "lead": {"teacher_skew": {"value": SKEW.lead, "source": SKEW.source}},
                "evidence": {"points": points,
                             "reason": None if not missed else
                             f"{seeds[0]['reason_default']} at seed(s) {missed}"}})
    by: dict[str, dict[str, float | None]] = {}
    for p in points:
        if p["param"] != "seed":
            by.setdefault(p["param"], {})[str(p["value"])] = p["saved_pct_default"]
    row["moved_over_20pct"] = [k for k, v in by.items() if (sp := _span(list(v.values())))
                               and sp[1] - sp[0] > 20 * max(abs(sp[0]), 1e-9) / 100]


def _span(vals: list[float | None]) -> list[float] | None:
    vals = [float(v) for v in vals if v is not None and not math.isnan(float(v))]
    return [round(min(vals), 4), round(max(vals), 4)] if vals else None


def table1(rows: pd.DataFrame, live: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Table 1 as the paper defines it: per action, scheduling + allocate-on-execution +
    restore, as a share of execution (Tangram)."""
    out = []
    t1 = rows[rows["experiment"] == "table1"]
    f6 = rows[(rows["experiment"] == "fig6") & (rows["policy"] == "tangram")]
    if "quota" in f6:
        f6 = f6[f6["quota"].isin(["", HEADLINE_QUOTA])]
    source = (f"{live['backend']} backend, p50 {live['overhead_p50_ms']} ms per action, "
              "measured live on this machine") if live and "error" not in live else "not measured"
    for r in [*t1.itertuples(), *(r for r in f6.itertuples() if r.workload != "coding" or t1.empty)]:
        aoe = float(dict(r.setup).get("aoe_s", 0.0)) if r.workload == "coding" else 0.0
        # the backend's overheads (restore, environment start, AOE) are not execution
        execution = r.exec_mean_s - (r.overhead_mean_s or 0.0)
        sched = r.decision_mean_us / 1e6
        overhead = sched + aoe + r.restore_mean_s
        out.append({"workload": r.workload, "queueing_s": r.queue_mean_s,
                    "scheduling_decision_s": sched, "aoe_s": aoe,
                    "gpu_restore_s": r.restore_mean_s, "execution_s": execution,
                    "overhead_share_pct": 100 * overhead / max(execution, 1e-9),
                    "aoe_source": source if r.workload == "coding" else "-",
                    "setup": r.setup})
    return out


def measure_live() -> dict[str, Any]:
    """The allocate-on-execution cost per action, measured on this machine: the docker
    backend (cgroup update + exec), or the process backend where there is no engine."""
    from analysis.bench.executor import executor_bench

    errors = []
    for backend in ("docker", "process"):
        try:
            res = executor_bench(backend, n=20, long_n=1, long_s=0.2)
            if errors:
                res["note"] = "; ".join(errors)
            return res
        except Exception as e:  # no engine here: try the next, and say why
            errors.append(f"{backend}: {type(e).__name__}: {e}")
    return {"error": "; ".join(errors)}


def _paper_line(ax, value: float, label: str, axis: str = "y") -> None:
    line = ax.axhline if axis == "y" else ax.axvline
    line(value, color="#d1495b", ls="--", lw=1.0, label=label)


def _finish(ax, out: Path, name: str, xlabel: str, ylabel: str, title: str,
            legend_size: int = 8, grid: bool = True) -> Path:
    """Label, legend and save one report figure (the report's common look)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=legend_size, frameon=False)
    if grid:
        ax.grid(alpha=0.3)
    return figures.save(ax.figure, out, name)[0]


#: the paper's per-workload ratios (Fig. 6 step times, Fig. 7 categories) where it gives one
FIG6_PAPER = {"coding": "coding_act", "deepsearch": "deepsearch_step"}
FIG7_PAPER = {("coding", "env"): "coding_env", ("coding", "reward"): "coding_reward"}


#: what a reader must know to read a figure beside the headline table
FIGURE_NOTES = {
    "fig6_act": "Fig. 6 is one run per workload (seed 0, the base cluster, pods of the "
                "default size); the headline table's ratios are means over the seeds at each "
                "row's lead point, and its coding variant holds pods to the rollout's end, so "
                "a ratio here may differ from the table's row for the same workload. Bar "
                "labels are RL step times (rollout only).",
}


def _fig6_label(f6: pd.DataFrame, w: str) -> str:
    t, b = _get(f6, workload=w, policy="tangram"), _get(f6, workload=w, policy=BASELINE_OF[w])
    ours = _ratio(b.act_mean_s, t.act_mean_s) if t is not None and b is not None else math.nan
    key = FIG6_PAPER.get(w)
    paper = f"\npaper {PAPER[key].value}x" if key else ""
    # one ratio a line: side by side, four groups' labels ran into each other
    return f"{w}\n(vs {BASELINE_OF[w]})\nACT ours {ours:.2g}x{paper}"


def draw_ranges(results: list[dict[str, Any]], out: Path) -> Path | None:
    """Each headline's 95% interval (seeds) and range (assumptions) against the default baseline,
    its value against the best-tuned baseline, and the paper's value."""
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.get("range") and r["unit"] == "x"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.4, 0.42 * len(rows) + 1.4))
    for i, r in enumerate(rows):
        lo, hi = r["range"]
        ax.plot([lo, hi], [i, i], color=figures.COLORS["tangram"], lw=5, alpha=0.35,
                solid_capstyle="butt", label="range vs default" if i == 0 else None)
        ax.plot([r["ours"]], [i], "o", color=figures.COLORS["tangram"],
                label="lead point vs default" if i == 0 else None)
        if r.get("ci"):
            ax.plot(r["ci"], [i, i], color=figures.COLORS["tangram"], lw=1.5,
                    marker="|", ms=8, label="95% interval (seeds)" if i == 0 else None)
        if r.get("range_vs_best"):
            blo, bhi = r["range_vs_best"]
            ax.plot([blo, bhi], [i - 0.18, i - 0.18], color="#333", lw=2,
                    label="range vs best baseline" if i == 0 else None)
        if r.get("vs_best") is not None:
            ax.plot([r["vs_best"]], [i - 0.18], "s", color="#333", ms=4,
                    label="lead point vs best" if i == 0 else None)
        if isinstance(r["paper"], float | int):
            ax.plot([r["paper"]], [i], "x", color="#d1495b", ms=8, mew=2,
                    label="paper" if i == 0 else None)
    ax.axvline(1.0, color="#999", lw=0.8)
    ax.set_yticks(range(len(rows)), [r["name"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    return _finish(ax, out, "headline_ranges", "baseline / Tangram (log)", "",
                   "Headlines: 95% interval over seeds, range over assumptions; vs default and best",
                   legend_size=7)


def draw_decomposition(decomp: list[dict[str, Any]], out: Path) -> Path | None:
    import matplotlib.pyplot as plt

    if not decomp:
        return None
    clusters = list(dict.fromkeys(d["cluster"] for d in decomp))
    fig, axes = plt.subplots(1, len(clusters), figsize=(4.2 * len(clusters), 3.8))
    for ax, cl in zip(np.atleast_1d(axes), clusters, strict=True):
        sub = [d for d in decomp if d["cluster"] == cl]
        ys = [d["act_mean_s"] for d in sub]
        ax.barh(range(len(sub)), ys, color=[figures.COLORS.get(d["policy"], "#888")
                                            for d in sub])
        ax.set_yticks(range(len(sub)), [d["rung"] for d in sub], fontsize=6)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("mean ACT (s)")
        ax.set_title(cl, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("Where the gain comes from: one mechanism at a time", fontsize=10)
    fig.tight_layout()
    return figures.save(fig, out, "decomposition")[0]


def draw_evidence(results: list[dict[str, Any]], decomp: list[dict[str, Any]] | None,
                  evidence: dict[str, dict[str, Any]] | None, out: Path) -> list[Path]:
    """The evidence's figures: the headlines' intervals and ranges, the decomposition, the
    joint sweeps."""
    paths = [draw_ranges(results, out), draw_decomposition(decomp or [], out)]
    paths += [draw_joint(key, ev["joint"], out) for key, ev in (evidence or {}).items()
              if ev.get("joint")]
    return [p for p in paths if p is not None]


def draw_joint(key: str, joint: dict[str, Any], out: Path) -> Path:
    """A claim's two most moving assumptions swept jointly: the ratio in every cell,
    against the default (left) and the best baseline for its metric (right)."""
    import matplotlib.pyplot as plt

    (pa, pb), (va, vb) = joint["params"], joint["values"]
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for ax, against in zip(axes, ("vs_default", "vs_best"), strict=True):
        grid = np.array([[next(c[against] for c in joint["cells"]
                               if c[pa] == a and c[pb] == b) for b in vb] for a in va])
        im = ax.imshow(np.log(grid), cmap="RdBu", vmin=-np.log(8), vmax=np.log(8),
                       aspect="auto")
        for i, a in enumerate(va):
            for j, b in enumerate(vb):
                ci = next(c[f"ci_{against}"] for c in joint["cells"]
                          if c[pa] == a and c[pb] == b)
                txt = f"{grid[i, j]:.2f}x" + (f"\n[{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")
                ax.text(j, i, txt, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(vb)), [str(b) for b in vb])
        ax.set_yticks(range(len(va)), [str(a) for a in va])
        ax.set_xlabel(pb)
        ax.set_ylabel(pa)
        ax.set_title(f"{key}: baseline / Tangram, {against.replace('_', ' ')}", fontsize=9)
    fig.colorbar(im, ax=axes, shrink=0.8, label="log ratio (blue: Tangram faster)")
    return figures.save(fig, out, f"joint_{key}")[0]


def draw(rows: pd.DataFrame, gaps: pd.DataFrame | None, out: Path,
         savings: pd.DataFrame | None = None) -> list[Path]:
    """The report's figures, a drawing step per figure; the paths written."""
    steps = (
        _draw_fig6(rows, out),
        _draw_cpu_oversubscription(rows, out),
        _draw_act_lines(rows, out),
        _draw_capacity_ablation(rows, out),
        _draw_savings(savings, out),
        _draw_search_quota(rows, out),
        _draw_optgap(gaps, out),
        _draw_ordering(rows, out),
        _draw_sensitivity(rows, out),
    )
    return [path for step in steps for path in step]


def _draw_fig6(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Fig. 6 (mean ACT per workload), Fig. 7 (time per trajectory by category) and the
    k8s ratio across pod sizes."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    f6 = rows[rows["experiment"] == "fig6"].copy()
    if "quota" in f6:
        f6 = f6[f6["quota"].isin(["", HEADLINE_QUOTA])]
    if not f6.empty:
        f6["system"] = np.where(f6["policy"] == "tangram", "tangram", "baseline")
        f6["label"] = [_fig6_label(f6, w) for w in f6["workload"]]
        ax = figures.bars(f6, "label", "system", "act_mean_s",
                          title="Fig. 6: mean ACT per workload (labels: RL step time)",
                          ylabel="mean ACT (s)", annotate="step_time_s", log=True)
        paths.append(figures.save(ax.figure, out, "fig6_act")[0])
        parts = []
        for r in f6.itertuples():
            for cat, v in r.per_category.items():
                key = FIG7_PAPER.get((r.workload, cat))
                mark = f"\npaper {PAPER[key].value}x" if key else ""
                parts.append({"bucket": f"{r.workload}: {cat}\n(vs {BASELINE_OF[r.workload]})"
                                        f"{mark}",
                              "system": r.system, "seconds": v["per_trajectory_s"]})
        ax = figures.bars(pd.DataFrame(parts), "bucket", "system", "seconds",
                          title="Fig. 7: time per trajectory by category",
                          ylabel="ACT per trajectory (s)", log=True)
        paths.append(figures.save(ax.figure, out, "fig7_breakdown")[0])
        t = _get(f6, workload="coding", policy="tangram")
        pods = _k8s_ratios(rows, t) if t is not None else {}
        if pods:
            fig, ax = plt.subplots(figsize=(5.2, 3.4))
            xs = sorted(pods)
            ax.plot(xs, [pods[x] for x in xs], marker="o", color=figures.COLORS["k8s"],
                    label="ours")
            _paper_line(ax, PAPER["coding_act"].value, "paper: 4.3x (pod size not stated)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            paths.append(_finish(ax, out, "sweep_pod_size",
                                 "k8s pod size (cores)", "mean ACT k8s / Tangram",
                                 "Coding: the k8s ratio across pod sizes"))
    return paths


def _draw_cpu_oversubscription(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Fig. 8a: the k8s / Tangram ratio against oversubscription."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    f8 = rows[rows["experiment"] == "fig8_cpu_batch"]
    if not f8.empty:
        fig, ax = plt.subplots(figsize=(5.6, 3.6))
        cores = float(f8.iloc[0].cpu_cores)
        for (pod, dop), sub in f8[f8["policy"] == "k8s"].groupby(["pod", "pod_dop"]):
            pts = []
            for r in sub.itertuples():
                t = _get(f8, x=r.x, policy="tangram")
                pts.append((r.x * pod / cores, _ratio(r.act_mean_s, t.act_mean_s)))
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    ls="-" if dop == 1 else "--",
                    label=f"pods of {int(pod)} cores, -n {int(dop)}")
        _paper_line(ax, PAPER["cpu_scal_small"].value, "paper: 3.1x (smallest batch)")
        ax.axhline(PAPER["cpu_scal_large"].value, color="#d1495b", ls=":", lw=1.0,
                   label="paper: 27.7x (largest batch)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        paths.append(_finish(ax, out, "fig8_cpu_oversubscription",
                             "oversubscription (k8s pod-cores / cores)", "mean ACT k8s / Tangram",
                             "Fig. 8a: CPU scalability against oversubscription", legend_size=7))
    return paths


def _draw_act_lines(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Figs. 8b, 8c, 9 and 9 on capacity: mean ACT per policy along the swept axis."""
    paths: list[Path] = []
    for exp, x, title, xlabel in (
            ("fig8_cpu_capacity", "x", "Fig. 8b: CPU, mean ACT vs capacity", "CPU nodes"),
            ("fig8_gpu_batch", "x", "Fig. 8c: GPU, mean ACT vs batch size", "RL batch (trajectories)"),
            ("fig9", "x", "Fig. 9: elastic vs fixed DoP", "RL batch (trajectories)"),
            ("fig9_capacity", "x", "Fig. 9 on capacity: elastic vs fixed DoP", "CPU nodes")):
        sub = rows[(rows["experiment"] == exp) & rows["act_mean_s"].notna()]
        if not sub.empty:
            ax = figures.lines(sub, x, "policy", "act_mean_s", title=title, xlabel=xlabel,
                               ylabel="mean ACT (s)")
            mark = {"fig8_gpu_batch": "paper: static / Tangram 18.1x at batch 2048",
                    "fig9": "paper: DoP 16 / Tangram 3.0x at batch 1280",
                    "fig9_capacity": "paper: 3.0x on its 15 nodes"}.get(exp)
            if mark:  # the paper gives a ratio here, not these absolute times
                ax.text(0.02, 0.02, mark, transform=ax.transAxes, fontsize=7,
                        color="#d1495b")
            paths.append(figures.save(ax.figure, out, exp)[0])
    return paths


def _draw_capacity_ablation(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Fig. 9: the ablation ratio as capacity shrinks."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    f9c = rows[rows["experiment"] == "fig9_capacity"]
    if not f9c.empty:
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        xs = sorted(f9c["x"].unique())
        ys = [_ratio(_get(f9c, x=x, policy="fixed-dop:16").act_mean_s,
                     _get(f9c, x=x, policy="tangram").act_mean_s) for x in xs]
        ax.plot(xs, ys, marker="o", color=figures.COLORS["tangram"], label="ours")
        _paper_line(ax, PAPER["ablation_dop16"].value, "paper: 3.0x at batch 1280")
        paths.append(_finish(ax, out, "sweep_fig9_capacity",
                             "CPU nodes", "mean ACT DoP=16 / Tangram",
                             "Fig. 9: the ablation ratio as capacity shrinks"))
    return paths


def _draw_savings(savings: pd.DataFrame | None, out: Path) -> list[Path]:
    """Fig. 8d: the GPUs Tangram needs for static's mean ACT."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    if savings is not None and not savings.empty:
        fig, ax = plt.subplots(figsize=(5.6, 3.6))
        ref = savings[savings["policy"] == "static"].iloc[0]
        for policy, sub in savings[savings["policy"] != "static"].groupby("policy"):
            sub = sub.sort_values("x")
            ax.plot(sub["x"], sub["act_mean_s"], marker="o", ms=3, label=policy,
                    color=figures.COLORS.get(policy))
        ax.scatter([36], [ref.act_mean_s], color=figures.COLORS["static"], zorder=3,
                   label="static: 9 x 4 GPUs")
        ax.axhline(ref.act_mean_s, color=figures.COLORS["static"], lw=0.8)
        _paper_line(ax, (1 - PAPER["gpu_saved"].value / 100) * 36, "paper: 28.8% of static's GPUs", axis="x")
        ax.set_yscale("log")
        paths.append(_finish(ax, out, "fig8_gpu_savings",
                             "GPUs", "mean ACT (s)",
                             "Fig. 8d: GPUs for static's mean ACT (1-GPU steps)", legend_size=7))
    return paths


def _draw_search_quota(rows: pd.DataFrame, out: Path) -> list[Path]:
    """DeepSearch: the step-time ratio across published API quotas."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    ds = rows[(rows["experiment"] == "fig6") & (rows["workload"] == "deepsearch")]
    if not ds.empty and "quota" in ds:
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        quotas = sorted(set(ds["quota"]))
        ys = [_ratio(_get(ds, quota=q, policy="baseline").step_time_s,
                     _get(ds, quota=q, policy="tangram").step_time_s) for q in quotas]
        ax.bar(quotas, ys, color=figures.COLORS["baseline"], label="ours")
        _paper_line(ax, PAPER["deepsearch_step"].value, "paper: 1.5x (quota not stated)")
        paths.append(_finish(ax, out, "sweep_search_quota",
                             "search quota (Brave Search API plan)", "step time baseline / Tangram",
                             "DeepSearch across published API quotas", grid=False))
    return paths


def _draw_optgap(gaps: pd.DataFrame | None, out: Path) -> list[Path]:
    """Beyond: the optimality gap of greedy eviction."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    if gaps is not None and not gaps.empty:
        fig, ax = plt.subplots(figsize=(5.2, 3.4))
        ax.hist([100 * gaps["gap_vs_exhaustive"], 100 * gaps["gap_vs_hesrpt"]], bins=15,
                label=["vs exhaustive (FCFS, fixed DoP)", "vs heSRPT (lower bound)"])
        paths.append(_finish(ax, out, "beyond_optgap",
                             "total completion time above the reference (%)", "instances",
                             "Beyond: optimality gap of greedy eviction", grid=False))
    return paths


def _draw_ordering(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Beyond: FCFS against shortest-expected-first."""
    paths: list[Path] = []
    od = rows[rows["experiment"] == "ordering"]
    if not od.empty:
        long = od.melt(id_vars=["ordering"], value_vars=["act_mean_s", "act_p99_s", "queue_max_s"],
                       var_name="metric", value_name="seconds")
        ax = figures.bars(long, "metric", "ordering", "seconds",
                          title="Beyond: FCFS vs shortest-expected-first (aging 30 s)",
                          ylabel="seconds")
        paths.append(figures.save(ax.figure, out, "beyond_ordering")[0])
    return paths


def _draw_sensitivity(rows: pd.DataFrame, out: Path) -> list[Path]:
    """Beyond: the sensitivity of the headline ratio."""
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    sens = rows[rows["experiment"] == "sensitivity"]
    if not sens.empty:
        params = list(dict.fromkeys(sens["param"]))
        fig, axes = plt.subplots(1, len(params), figsize=(3.2 * len(params), 3.0))
        for ax, param in zip(np.atleast_1d(axes), params, strict=True):
            sub = sens[sens["param"] == param]
            base = "static" if param == "restore_gbps" else "k8s"
            xs = sorted(sub["x"].unique())
            ys = [_ratio(_get(sub, x=x, policy=base).act_mean_s,
                         _get(sub, x=x, policy="tangram").act_mean_s) for x in xs]
            ax.plot(xs, ys, marker="o", color=figures.COLORS["tangram"])
            ax.axhline(1.0, color="#999", lw=0.8)
            ax.set_xlabel(param)
            ax.set_ylabel(f"mean ACT {base} / tangram")
            ax.grid(alpha=0.3)
        fig.suptitle("Beyond: sensitivity of the headline ratio", fontsize=10)
        fig.tight_layout()
        paths.append(figures.save(fig, out, "beyond_sensitivity")[0])
    return paths


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float | int) else str(v)


def _rng(r: list[float] | None) -> str:
    return "-" if not r else f"{r[0]:.3g}-{r[1]:.3g}"


def decomposition_lines(decomp: list[dict[str, Any]]) -> list[str]:
    """The decomposition table, and what it says of the env / reward split."""
    lines = ["## Where Tangram's gain comes from", "",
             "Each rung adds one mechanism to the one above it (same trace, same cluster). "
             "Ratios are the baseline's over the rung's: `k8s default` is the paper's pods "
             "(4 cores, tests single-process), `k8s best` the best pod size x `pytest -n` "
             "of the tuning grid. Learning (curves of the unprofiled agent test runs) shares a "
             "rung with our scheduler: the paper's rule runs unprofiled tests at their "
             "minimum, and no switch separates learning from the rest.", "",
             "| cluster | rung | mean ACT (s) | queue (s) | env / traj (s) | reward / traj (s) "
             "| default / rung | best / rung |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cl in dict.fromkeys(d["cluster"] for d in decomp):
        sub = [d for d in decomp if d["cluster"] == cl]
        dflt, best = sub[0], sub[1]
        for d in sub:
            lines.append(f"| {cl} | {d['rung']} | {_fmt(d['act_mean_s'])} | "
                         f"{_fmt(d['queue_mean_s'])} | {_fmt(d['env_s'])} | "
                         f"{_fmt(d['reward_s'])} | "
                         f"{_ratio(dflt['act_mean_s'], d['act_mean_s']):.3g}x | "
                         f"{_ratio(best['act_mean_s'], d['act_mean_s']):.3g}x |")
    lines.append("")
    for cl in dict.fromkeys(d["cluster"] for d in decomp if d["env_s"] is not None):
        sub = {d["rung"]: d for d in decomp if d["cluster"] == cl}
        dflt = next(iter(sub.values()))
        share = next((d for r, d in sub.items() if r.startswith("sharing alone")), None)
        full = next((d for r, d in sub.items() if r.endswith("(= tangram)")), None)
        if share is None or full is None or not share["env_s"] or not full["env_s"]:
            continue
        lines.append(
            f"* {cl}: environment time k8s / sharing alone "
            f"{_ratio(dflt['env_s'], share['env_s']):.3g}x, / Tangram "
            f"{_ratio(dflt['env_s'], full['env_s']):.3g}x (paper 9.0x); reward time k8s / "
            f"sharing alone {_ratio(dflt['reward_s'], share['reward_s']):.3g}x, / Tangram "
            f"{_ratio(dflt['reward_s'], full['reward_s']):.3g}x (paper 2.8x).")
    lines += ["* Why our split differs from the paper's: in our traces the environment's "
              "tool calls are mostly sub-second shell commands and edits (assumed mix "
              "55/30/15, `traces/generate.py`), so removing the pod's over-provisioning "
              "(sharing alone) saves environment time only where pods wait for cores: "
              "compare the environment ratio of sharing alone on the two clusters above. "
              "The hidden test suite is tens of seconds and parallel (p 0.67-0.95), so "
              "elasticity gains on the reward, which sharing alone cannot. The paper's "
              "production tool calls (builds, installs) and its cluster's load are not "
              "published, so its 9.0x / 2.8x split cannot be checked against ours.", ""]
    return lines


#: docs/evidence/regret.json: `tangram bench regret`'s matrix (Tangram / the best
#: competitor per cell and metric), written by its own run
REGRET = Path(__file__).resolve().parent.parent / "docs" / "evidence" / "regret.json"


def regret(out: Path | None = None, path: Path = REGRET) -> dict[str, Any] | None:
    """The regret matrix's cells above 1.0 (Tangram slower than the best competitor), from
    ``path`` when it exists: its scale, the cells counted, and those cells worst first."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return {"error": f"{path}: unreadable ({e})"}
    losses = data.get("losses")
    if losses is None:  # no list of losses: find them in the cells
        losses = sorted(({**{k: c.get(k) for k in ("workload", "seed", "cluster", "rate",
                                                     "profile_sigma")},
                          "metric": m, "regret": v, "best": (c.get("best") or {}).get(m)}
                         for c in data.get("cells", []) for m, v in c.get("regret", {}).items()
                         if v > 1.0), key=lambda x: -x["regret"])
    return {"path": str(path), "scale": data.get("scale"), "cells": len(data.get("cells", [])),
            "over_1": losses}


#: why a paper figure is not reproduced, where the reason is known (by its key)
WHY: dict[str, str] = {
    "deepsearch_step": "our DeepSearch step is bound by its longest trajectory's own think + "
                       "execution (deep-research questions of ~45 searches, lognormal tail "
                       "to 150, ~3 s of generation between searches): no scheduler can "
                       "shorten that step, and at the paid quota (50 requests/s) searches "
                       "hardly wait, so there is nothing to win; at the free quota (1 "
                       "request/s) the ratio is in the row below. The paper's question mix "
                       "and quota are not published.",
    "gpu_static": "at our batch sizes static's 9 x 4 GPUs serve the burst with little "
                  "queueing (the hot teacher's replica is the only one that queues) and "
                  "Tangram pays host-to-GPU restores for the variants it moves; the paper's "
                  "18.1x is at batch 2048 on its production demand. Per batch: {gpu_batches}.",
    "gpu_saved": "Tangram needs the GPU count at which its mean ACT meets static's; with "
                 "teachers' weights restored on demand, fewer GPUs mean more restores.",
    "coding_env": "our tool calls are mostly sub-second shell commands and edits "
                  "(assumed mix 55/30/15): removing pods' over-provisioning saves "
                  "environment time only where pods wait for cores (see the decomposition).",
    "coding_reward": "the reward suites gain from elastic parallelism; an operator who runs "
                     "`pytest -n` inside wider pods (the best baseline) gets part of it.",
    "coding_act": "at the paper's operating point (its pod-cores / cores) pods seldom wait "
                  "for cores, so removing their over-provisioning gains less than the paper "
                  "reports; on an oversubscribed cluster (fewer nodes: the range) the ratio "
                  "reaches its upper end. Against the best pod size x `pytest -n` the lead "
                  "shrinks to about parity: most of the default's loss is its single-process "
                  "tests, which an operator can fix without Tangram.",
    "coding_step_training": "the rollout-only ratio is already near the paper's 1.4x, so any "
                            "training phase added to both steps (here as long as Tangram's "
                            "rollout, an assumption) pulls it below; the sweep from T = 0 "
                            "to the T that would give 1.4x is the row's range.",
    "coding_step": "the simulated step is the rollout only; the paper's includes training "
                   "(the next row adds it as an assumption).",
    "cpu_scal_small": "the smallest batch barely contends for cores, so sharing gains little.",
    "cpu_scal_large": "the paper's 27.7x is at batch 2048 on its testbed; our largest batch "
                      "oversubscribes less.",
    "ablation_dop16": "fixed DoP 16 is the paper's ablation; the best fixed DoP for this "
                      "cluster and batch is the fairer comparison (vs best).",
}


def verdict_lines(results: list[dict[str, Any]],
                  regret_cells: dict[str, Any] | None) -> list[str]:
    """Row by row: whether the paper's number is reproduced (inside our 95% interval, or our
    lead value where a row has no interval), against the default and the best baseline,
    and why not where we know."""
    lines = ["## Where the paper's number is not reproduced, and why", ""]
    for r in results:
        paper = r.get("paper")
        if not isinstance(paper, int | float):
            continue
        ours, ci = r.get("ours"), r.get("ci")
        if ours is None:
            reason = (r.get("evidence") or {}).get("reason") or "no value measured"
            lines.append(f"* **{r['name']}**: paper {paper}{r['unit']}; ours: none ({reason}). "
                         + WHY.get(r.get("key") or "", ""))
            continue
        lo, hi = ci or (ours, ours)
        if lo <= paper <= hi:
            verdict = "reproduced (the paper's value lies in our interval)"
        elif hi < paper:
            verdict = "**not reproduced**: ours is smaller"
        else:
            verdict = "not reproduced: ours is larger"
        best = ""
        if r.get("vs_best") is not None:
            lose = r["vs_best"] < 1.0 if r["unit"] == "x" else r["vs_best"] <= 0
            best = (f"; against the best baseline for this metric ({r['best_baseline']}) "
                    f"{r['vs_best']:.3g}{r['unit']} {_rng(r.get('ci_vs_best'))}"
                    + (" — **the best baseline wins here**" if lose else ""))
        why = WHY.get(r.get("key") or "", "")
        if "{gpu_batches}" in why:
            why = why.format(gpu_batches=r.get("setup", {}).get("by_batch", "-"))
        ok = verdict.startswith("reproduced") and not best.endswith("wins here**")
        lines.append(f"* **{r['name']}**: paper {paper}{r['unit']}, ours {ours:.3g}{r['unit']} "
                     f"[{_rng(ci)}]: {verdict}{best}." + ("" if ok or not why else f" Why: {why}"))
    lines.append("")
    if regret_cells is None:
        lines += ["The regret matrix (`tangram bench regret`, docs/evidence/regret.json) was "
                  "not on record when this report was written.", ""]
    elif "error" in regret_cells:
        lines += [f"The regret matrix could not be read: {regret_cells['error']}.", ""]
    else:
        over = regret_cells["over_1"]
        lines += [f"Regret matrix ({regret_cells['path']}, scale {regret_cells['scale']}, "
                  f"{regret_cells['cells']} cells): {len(over)} (cell, metric) pairs where "
                  "Tangram is slower than the best competitor (regret above 1.0)"
                  + (":" if over else "."), ""]
        if over:
            lines += ["| workload | cluster | rate | profile error | seed | metric | regret "
                      "| best competitor |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for c in over[:25]:
                lines.append(f"| {c.get('workload')} | {c.get('cluster')} | {c.get('rate')} | "
                             f"{c.get('profile_sigma')} | {c.get('seed')} | {c['metric']} | "
                             f"{c['regret']:.3g} | {c.get('best')} |")
            if len(over) > 25:
                lines.append(f"| ... {len(over) - 25} more in regret.json | | | | | | | |")
            lines.append("")
    return lines


def report(results: list[dict], paths: list[Path], out: Path, scale: str, wall_s: float,
           overheads: list[dict[str, Any]] | None = None, live: dict[str, Any] | None = None,
           decomp: list[dict[str, Any]] | None = None,
           regret_cells: dict[str, Any] | None = None) -> None:
    sc = SCALES[scale]
    lines = [f"# Tangram reproduction ({scale})", "",
             f"Our simulation of the studies in {CITATION}, measured {time.strftime('%Y-%m-%d')}, "
             f"{wall_s:.0f} s of wall time. CPU cluster '{sc['base']}' (see `sim/clusters/"
             f"{sc['base']}.yaml`), the paper's GPU cluster ({sc['gpu_total']} GPUs). Every "
             "number below is what the simulator measured; nothing was calibrated to the "
             "paper's figures. Each row of results.json carries its `setup` (the runs' "
             "parameters, and for a sweep which point the headline value is and the range).",
             "", "## Headline figures", "",
             f"`ours` is the mean over seeds {list(SEEDS)} at the lead point (every assumption "
             "at its lead; for AI coding the paper's operating point, pod-cores / cores as in "
             "its testbed) against the paper's default baseline, with its 95% bootstrap "
             "interval over the seeds; `range` spans the other points (each assumption moved "
             "one at a time, each point the mean of the same seeds); `vs best` is against the "
             "best baseline *for that row's metric*, named in the row, chosen from its tuning "
             f"grid once at seed {TUNE_SEED} (a seed of its own) and held at every point; "
             "`moved` lists the assumptions whose sweep moves the ratio (against the default "
             "or the best) by more than 20%.", "",
             "| figure | paper | ours (vs default) | 95% interval | range vs default | vs best "
             "| 95% interval | range vs best | best baseline (this metric) | moved > 20% | unit "
             "| note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        paper = "-" if r["paper"] is None else r["paper"]
        ours = "n/a" if r["ours"] is None else f"{r['ours']:.3g}"
        lines.append(f"| {r['name']} | {paper} | {ours} | {_rng(r.get('ci'))} | "
                     f"{_rng(r.get('range'))} | {_fmt(r.get('vs_best'))} | "
                     f"{_rng(r.get('ci_vs_best'))} | {_rng(r.get('range_vs_best'))} | "
                     f"{r.get('best_baseline') or '-'} | "
                     f"{', '.join(r.get('moved_over_20pct') or []) or '-'} | {r['unit']} | "
                     f"{r['note']} |")
    lines += ["", *verdict_lines(results, regret_cells)]
    # the figures right after the verdicts: a reader looks before reading the details
    lines += ["## Figures", "", "Dashed red lines (or red text, where the paper gives a "
              "ratio and the figure shows times) mark the paper's values.", ""]
    for p in paths:
        lines += [f"![{p.stem}](figures/{p.name})", ""]
        if p.stem in FIGURE_NOTES:
            lines += [FIGURE_NOTES[p.stem], ""]
    # an assumption may lead at different values in different rows (the coding rows'
    # capacity is the paper's operating point, the ablation's the base cluster)
    leads: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        for k, v in (r.get("lead") or {}).items():
            leads.setdefault((k, str(v["value"])), {**v, "rows": []})["rows"].append(r["name"])
    if leads:
        lines += ["", "### The lead point of each assumption, and why", "",
                  "| assumption | lead | rows | source |", "| --- | --- | --- | --- |"]
        for (k, value), v in leads.items():
            lines.append(f"| {k} | {value} | {'; '.join(v['rows'])} | {v['source']} |")
    lines += ["", "### The paper's values", "", "| key | paper | where | setup |",
              "| --- | --- | --- | --- |"]
    for k, v in PAPER.items():
        lines.append(f"| {k} | {v.value} {v.unit} | {v.where} | {v.setup or '-'} |")
    lines += ["", "## The paper's setups, and where it is silent", "",
              "* k8s: a pod per trajectory, created when the trajectory opens and held until it "
              "ends (variant: until the rollout ends), bound by kube-scheduler at most 50 per "
              "second (bursts of 100), started in ~2 s (p99 5 s, the Kubernetes pod-startup "
              "SLO); the dataset's tests run single-process inside the pod. The pod size is "
              "not stated: 4 cores here, swept 2-16 (figure `sweep_pod_size`), and the CPU "
              "scalability figure puts oversubscription (pod-cores / cores) on its axis.",
              "* Static GPU: 9 teachers x 4 GPUs (MOPD), 10 services x 4 GPUs (MOPD+Search), 5 "
              "judge replicas of 4 GPUs (DeepSearch). GPU savings are searched in 1-GPU steps "
              "(partial nodes of 4/2/1 GPUs). The best static baseline splits replicas to the "
              "step's observed demand (the hot teacher gets more), the best case for it. The "
              f"demand across teachers: {TEACHER_DEMAND_NOTE}; Zipf exponent {SKEW.lead} "
              "(assumption), swept 0-2.",
              "* DeepSearch: the search quota is a published limit (Brave Search API: 50 "
              "requests/s on the Search plan, 1 request/s free); a rejected call gets HTTP 429 "
              "with the window's reset and is retried after it (or its backoff) until it "
              "succeeds, so both systems do the same searches (equal work); rows report "
              "completed searches per second and whether the step is bound by its longest "
              "trajectory's own think + execution time.",
              "* Profiles are estimates: a profiled action declares t1_s and its parallel "
              "fraction off by a lognormal profiling error (sigma 0.3, assumption, swept 0-0.6); "
              "the judge's declared cost assumes the median output length (its real output "
              "is known only after it ran).",
              "* Fig. 9: the paper's 3.0x needs DoP 16 to saturate the cores; the capacity "
              "sweep shows where it does.",
              "* The paper measured production traces; ours are synthetic traces generated "
              "from public figures (below; each constant cited or marked as an assumption). "
              "The simulated step is the rollout only: the rollout-only step ratio is an upper "
              "bound of what a real RL step shows; a training phase T (assumption) is added to "
              "both systems' steps in the row beside it, swept from 0 to the T that would "
              "give the paper's 1.4x.",
              "* `tangram` (ours) also counts the actions that thinking trajectories will "
              "submit, may hold an elastic action, bounded by its own run time, for a wider "
              "grant, and prices GPU restores in the DP; `tangram-paper` is Alg. 1-2's rules. "
              "Fig. 9 shows both.", ""]
    if overheads:
        lines += ["## Table 1: overhead breakdown (Tangram, mean per action)", "",
                  "| workload | queueing (s) | scheduling (s) | allocate-on-execution (s) "
                  "| GPU restore (s) | execution (s) | overhead / execution |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in overheads:
            lines.append(f"| {r['workload']} | {r['queueing_s']:.3g} | "
                         f"{r['scheduling_decision_s']:.2e} | {r['aoe_s']:.2e} | "
                         f"{r['gpu_restore_s']:.3g} | {r['execution_s']:.3g} | "
                         f"{r['overhead_share_pct']:.2f}% |")
        if live and "error" not in live:
            lines += ["", f"Allocate-on-execution measured live ({live['backend']} backend, "
                      f"{live['actions']} actions): submit-to-start p50 "
                      f"{live['submit_to_start_p50_ms']} ms, end-to-result p50 "
                      f"{live['end_to_result_p50_ms']} ms"
                      + (f", cgroup update p50 {live['cgroup_update_p50_ms']} ms"
                         if "cgroup_update_p50_ms" in live else "")
                      + (f" ({live['note']})" if live.get("note") else "") + "."]
        elif live:
            lines += ["", f"Allocate-on-execution not measured: {live['error']}"]
        lines.append("")
    if decomp:
        lines += decomposition_lines(decomp)
    lines += ["## Trace parameters and sources", "", "| parameter | value | source |",
              "| --- | --- | --- |"]
    for k, (v, src) in CALIBRATION.items():
        lines.append(f"| {k} | {v} | {src} |")
    lines += ["", "Sizes: " + ", ".join(f"{k}={v}" for k, v in sc.items()), ""]
    md = "\n".join(lines)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(markdown_to_html(md, out))


def reproduce(out: Path, quick: bool, only: list[str] | None = None, workers: int = 2,
              progress: Callable[[int, int], None] | None = None,
              cache: Path | None = None) -> list[dict[str, Any]]:
    """Run the studies and write the report. One worker pool serves the whole command
    (simulations, the optimality gap, the figures); every simulation's result and every
    generated trace is cached under ``cache`` (default ``out/cache``) by its inputs' hash,
    so a run that stopped resumes where it was and a repeated run is cheap."""
    scale = "quick" if quick else "full"
    names = only or [*EXPERIMENTS, *EXTRA]
    unknown = [n for n in names if n not in EXPERIMENTS and n not in EXTRA]
    if unknown:
        raise ValueError(f"--only: unknown experiment(s) {unknown} "
                         f"(choose from {[*EXPERIMENTS, *EXTRA]})")
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    with Runner(workers, out / "cache" if cache is None else cache) as runner:
        results = _reproduce(out, scale, names, runner, progress, t0)
    # after the pool's shutdown: its workers' CPU is counted among the children
    (out / "run.json").write_text(json.dumps(
        run_record(scale, names, workers, runner, t0, load0), indent=1) + "\n")
    return results


def run_record(scale: str, names: list[str], workers: int, runner: Runner, t0: float,
               load0: tuple[float, float, float]) -> dict[str, Any]:
    """How this run was made: the command, the commit, the machine, its load, the time."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown"

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"command": " ".join(["tangram", *sys.argv[1:]]) if sys.argv else None,
            "scale": scale, "experiments": names, "workers": workers,
            "commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                        "mem_gib": round(int(mem) / 2**20, 1) if mem else None,
                        "python": platform.python_version(), "platform": platform.platform()},
            "load_average_start": [round(x, 2) for x in load0],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 1),
            "simulations": {"simulated": runner.simulated, "from_cache": runner.hits},
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _reproduce(out: Path, scale: str, names: list[str], runner: Runner,
               progress: Callable[[int, int], None] | None, t0: float) -> list[dict[str, Any]]:
    sc = SCALES[scale]
    jobs = jobs_for(names, scale)
    live = None
    if "table1" in names:  # the live per-action cost, applied in the simulation
        live = measure_live()
        if "error" not in live:
            jobs.append(table1_job(scale, live["overhead_p50_ms"] / 1e3))
        if "fig6" not in names:  # Table 1's GPU row comes from fig. 6's MOPD run
            jobs += [j for j in jobs_for(["fig6"], scale)
                     if j.experiment == "fig6" and j.policy == "tangram" and j.workload == "mopd"]
    if "table1" in names and live is not None and "error" not in live:
        # Table 1 at the other seeds: its interval
        jobs += [replace(table1_job(scale, live["overhead_p50_ms"] / 1e3), seed=s,
                         experiment="table1_seed") for s in SEEDS[1:]]
        jobs += [replace(j, seed=s, experiment="table1_seed") for s in SEEDS[1:]
                 for j in jobs_for(["fig6"], scale)
                 if j.experiment == "fig6" and j.policy == "tangram" and j.workload == "mopd"]
    # the optimality gap runs in the pool beside the simulations
    gaps_f = runner.submit(optgap, sc["optgap_instances"]) if "optgap" in names else None
    rows = pd.DataFrame(runner.run(jobs, progress))
    evidence = decomp = None
    if "evidence" in names:
        evidence, _ = run_evidence(sc, runner, progress)
        decomp = decomposition(sc, evidence, runner, progress)
        (out / "evidence.json").write_text(json.dumps(evidence, indent=1, default=str) + "\n")
        (out / "decomposition.json").write_text(json.dumps(decomp, indent=1, default=str) + "\n")
    savings, savings_points = (savings_search(scale, runner, evidence, progress)
                               if "gpu_savings" in names else (None, None))
    gaps = pd.DataFrame(gaps_f.result()) if gaps_f is not None else None
    if rows.empty:
        rows = pd.DataFrame(columns=["experiment", "act_mean_s"])
    rows.to_json(out / "runs.json", orient="records", indent=1)
    if savings is not None:
        savings.to_json(out / "gpu_savings.json", orient="records", indent=1)
    if gaps is not None:
        gaps.to_csv(out / "optgap.csv", index=False)
    overheads = table1(rows, live) if "table1" in names else None
    seeds = rows[rows["experiment"] == "table1_seed"].copy()
    overhead_seeds = None
    if overheads is not None and not seeds.empty:
        # the same rows table1() reads, at the other seeds
        seeds["experiment"] = np.where(seeds["workload"] == "coding", "table1", "fig6")
        seeds["quota"] = ""
        overhead_seeds = table1(seeds, live)
    results = headline(rows, gaps, scale, savings, overheads, evidence, savings_points,
                       overhead_seeds)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    if overheads is not None:
        (out / "table1.json").write_text(json.dumps(overheads, indent=2, default=str) + "\n")
    lead_savings = savings[savings["point"] == "seed 0"] if savings is not None else None
    # the figures are drawn in the pool, two workers at once
    drawn = [runner.submit(draw_evidence, results, decomp, evidence, out / "figures"),
             runner.submit(draw, rows, gaps, out / "figures", lead_savings)]
    paths = [p for f in drawn for p in f.result()]
    report(results, paths, out, scale, time.perf_counter() - t0, overheads, live, decomp,
           regret(out))
    return results


def savings_search(scale: str, workers: Workers, evidence: dict[str, Any] | None,
                   progress: Callable[[int, int], None] | None = None
                   ) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """The GPU-savings search at every point of its range (every seed at the lead skew; in
    the full run also each other teacher skew at seed 0), against static's paper deployment
    and, with the evidence run, against the best static split at the same seed."""
    sc = SCALES[scale]
    pts = [("seed", s, s, None) for s in SEEDS]
    if scale == "full":
        pts += [("teacher_skew", v, 0, v) for v in SKEW.values if v != SKEW.lead]
    ev = (evidence or {}).get("gpu_static", {})
    best_label = ev.get("best", {}).get("label")
    lead = ev["points"][0]["per_seed"] if ev.get("points") else []
    skews = {p["params"].get("teacher_skew"): p["per_seed"] for p in ev.get("points", [])}
    frames, out = [], []
    used = 9 * PAPER_BASELINE["mopd"]["gpu_dop"]
    for param, value, seed, skew in pts:
        label = f"seed {seed}" if param == "seed" else f"teacher_skew={value}"
        per_seed = lead if param == "seed" else skews.get(value, [])
        best_s = next((p["best_s"] for p in per_seed if p["seed"] == seed), None)
        rows = gpu_savings(scale, workers, progress, seed=seed, teacher_skew=skew,
                           targets=[best_s] if best_s else [])
        frame = pd.DataFrame(rows).assign(point=label)
        frames.append(frame)
        static = float(frame[frame["policy"] == "static"].iloc[0]["act_mean_s"])
        act = {int(r.x): float(r.act_mean_s) for r in frame[frame["policy"] == "tangram"].itertuples()}
        gd, lucky_d = gpus_needed(act, static)
        gb, lucky_b = gpus_needed(act, best_s) if best_s else (None, [])
        saved_d, why_d = saved_pct(gd, used, sc["gpu_total"])
        saved_b, why_b = saved_pct(gb, sc["gpu_total"], sc["gpu_total"]) if best_s else (None, None)
        out.append({"point": label, "param": param, "value": value, "seed": seed,
                    "static_act_s": static, "best_static_act_s": best_s,
                    "best_label": best_label, "gpus_default": gd, "lucky_default": lucky_d,
                    "gpus_best": gb, "lucky_best": lucky_b,
                    "saved_pct_default": saved_d, "reason_default": why_d,
                    "saved_pct_best": saved_b, "reason_best": why_b})
    return pd.concat(frames, ignore_index=True), out
