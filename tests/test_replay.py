"""Live replay that does real work, and a simulator that can be held against it:
`tangram burn`, failed exits and output tails, the cluster file `run` writes,
`simulate --limit --think-scale`, `tangram compare` (real subprocesses)."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from analysis.compare import table as compare_table
from analysis.runs import load_run
from executor.commands import elastic_argv
from tangram.cluster import ClusterError, ClusterSpec
from traces.generate import generate
from traces.schema import COLUMNS, write
from traces.select import WORK_COLUMNS, fixed_work, head, scale_think, scale_work

ROOT = Path(__file__).parent.parent
CLI = [sys.executable, str(ROOT / "cli.py")]


def tangram(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_burn_uses_its_cpu_budget_over_n_processes():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-m", "executor.bench.burn", "--t1", "0.6", "-p", "0.5",
                          "-n", "3"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert res.returncode == 0, res.stderr
    assert "n=3" in res.stdout
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    # 0.6 CPU seconds in all (start-up included), whatever the machine's load
    assert 0.55 <= cpu <= 0.9, cpu
    bad = subprocess.run([sys.executable, "-m", "executor.bench.burn", "--t1", "1", "-p", "2"],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert bad.returncode == 2 and "--parallel-fraction" in bad.stderr
    failing = tangram("burn", "--t1", "0.01", "--exit-code", "3")
    assert failing.returncode == 3


def test_burn_gets_n_like_pytest_only_when_elastic():
    burn = [sys.executable, "-m", "executor.bench.burn", "--t1", "2"]
    assert elastic_argv(burn, 4, True) == burn[:3] + ["-n", "4"] + burn[3:]
    assert elastic_argv(burn, 4, False) == burn
    assert elastic_argv(burn, 1, True) == burn
    assert elastic_argv(["tangram", "burn", "--t1", "1"], 2, True)[:4] == ["tangram", "burn",
                                                                          "-n", "2"]
    assert elastic_argv(["sleep", "1"], 4, True) == ["sleep", "1"]


def test_cluster_yaml_round_trips_and_names_need_single_nodes():
    from sim.cluster import load_cluster

    for name in ("default", "paper"):
        spec = load_cluster(name)
        back = ClusterSpec.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_yaml())))
        assert back == spec
    with pytest.raises(ClusterError, match="names one node"):
        ClusterSpec.from_dict({"cpu_nodes": [{"name": "a", "count": 2, "cores": 4, "numa": 1}]})


def test_head_and_think_scale_select_like_run():
    df = generate("coding", 5, 3)
    two = head(df, 2)
    assert list(pd.unique(two["trajectory"])) == list(pd.unique(df["trajectory"]))[:2]
    assert scale_think(two, 0.5)["think_s"].tolist() == (two["think_s"] * 0.5).tolist()
    with pytest.raises(ValueError, match="think_scale"):
        scale_think(df, -1)


def test_scale_work_scales_every_rows_work_but_a_real_commands():
    df = generate("coding", 3, 4)
    df.loc[1, "command"] = "true"
    df.loc[:, "timeout_s"] = 90.0
    scaled = scale_work(df, 0.25)
    keep = fixed_work(df)
    assert keep.sum() == 1 and bool(keep[1])
    for col in WORK_COLUMNS:
        assert scaled.loc[~keep, col].tolist() == pytest.approx((df.loc[~keep, col] * 0.25).tolist())
        assert scaled.loc[keep, col].tolist() == df.loc[keep, col].tolist()
    assert scaled["think_s"].tolist() == df["think_s"].tolist()  # --think-scale's
    assert scale_work(df, 1.0) is df
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="work_scale"):
            scale_work(df, bad)


def _work_trace(path: Path) -> Path:
    """One trajectory of burn rows (one elastic) and a row that runs a real command."""
    base = {k: v[2] for k, v in COLUMNS.items()}
    steps = [("shell", "1", 0.4, float("nan"), ""), ("test_run", "1-2", 0.8, 0.9, ""),
             ("shell", "1", 0.3, float("nan"), "true"), ("shell", "1", 0.2, float("nan"), "")]
    rows = [{**base, "task": "coding", "trajectory": "w", "seq": i, "kind": kind,
             "think_s": 0.1, "t1_s": t1, "cpu_cores": cores, "mem_gb": 0.25,
             "elastic": "cpu" if cores != "1" else "", "parallel_fraction": p,
             "profiled": cores != "1", "setup_s": 0.1, "command": cmd}
            for i, (kind, cores, t1, p, cmd) in enumerate(steps)]
    return write(pd.DataFrame(rows), path)


def test_a_scaled_simulation_models_s_times_the_work(tmp_path):
    trace = _work_trace(tmp_path / "w.csv")
    runs = {}
    for scale in ("1", "0.25"):
        out = tmp_path / f"sim-{scale}"
        res = tangram("simulate", "--trace", str(trace), "--work-scale", scale, "--out",
                      str(out), "--quiet")
        assert res.returncode == 0, res.stderr
        runs[scale] = pd.read_parquet(out / "actions.parquet").set_index("action_id")
    full, quarter = runs["1"], runs["0.25"]
    assert (quarter["units"] == full["units"]).all()  # one trajectory: nothing contends
    scaled = ["w#1", "w#3"]
    assert quarter.loc[scaled, "exec_s"].tolist() == \
        pytest.approx((full.loc[scaled, "exec_s"] * 0.25).tolist())
    # the first action also waits for its environment to start (the cluster's, not the
    # row's work): only its 0.4 s + 0.1 s setup shrank, by 3/4
    assert full.loc["w#0", "exec_s"] - quarter.loc["w#0", "exec_s"] == pytest.approx(0.375)
    assert quarter.loc["w#2", "exec_s"] == pytest.approx(full.loc["w#2", "exec_s"])  # command
    config = json.loads((tmp_path / "sim-0.25" / "config.json").read_text())
    assert config["work_scale"] == 0.25 and config["work_unscaled_rows"] == 1
    assert "1 of 4 row(s) run a real command" in res.stderr
    bad = tangram("simulate", "--trace", str(trace), "--work-scale", "0", "--quiet")
    assert bad.returncode == 2 and "--work-scale" in bad.stderr and "Traceback" not in bad.stderr


def test_a_scaled_replay_burns_s_times_the_work(tmp_path):
    trace = _work_trace(tmp_path / "w.csv")
    live = tmp_path / "live"
    res = tangram("run", "--trace", str(trace), "--work-scale", "0.25", "--out", str(live),
                  "--quiet")
    assert res.returncode == 0, res.stderr
    assert "1 of 4 row(s) run a real command" in res.stderr
    summary = json.loads((live / "summary.json").read_text())
    assert summary["actions"] == 4 and summary["failed"] == 0
    by_id = {o["action_id"]: o for o in
             map(json.loads, (live / "outputs.jsonl").read_text().splitlines())}
    t1 = {aid: float(o["argv"][o["argv"].index("--t1") + 1]) for aid, o in by_id.items()
          if "executor.bench.burn" in o["argv"]}
    assert t1 == pytest.approx({"w#0": 0.1, "w#1": 0.2, "w#3": 0.05})
    config = json.loads((live / "config.json").read_text())
    assert config["work_scale"] == 0.25 and config["work_unscaled_rows"] == 1


def _tiny_trace(path: Path) -> Path:
    base = {k: v[2] for k, v in COLUMNS.items()}
    rows = []
    for j in range(3):
        steps = [("shell", "1", 0.05, float("nan"), ""),
                 ("test_run", "1-2", 0.2, 0.9, ""),
                 ("shell", "1", 0.0, float("nan"),
                  "sh -c 'echo to-stdout; echo to-stderr >&2; exit 3'" if j == 0 else "")]
        for i, (kind, cores, t1, p, cmd) in enumerate(steps):
            rows.append({**base, "task": "coding", "trajectory": f"j{j}", "seq": i, "kind": kind,
                         "think_s": 0.2, "t1_s": t1, "cpu_cores": cores, "mem_gb": 0.25,
                         "elastic": "cpu" if cores != "1" else "", "parallel_fraction": p,
                         "command": cmd})
    return write(pd.DataFrame(rows), path)


def test_run_does_real_work_counts_failures_and_simulate_takes_its_cluster(tmp_path):
    trace = _tiny_trace(tmp_path / "t.csv")
    live = tmp_path / "live"
    res = tangram("run", "--trace", str(trace), "--out", str(live), "--limit", "2",
                  "--think-scale", "0.5", "--quiet")
    assert res.returncode == 0, res.stderr
    summary = json.loads((live / "summary.json").read_text())
    assert summary["actions"] == 6 and summary["trajectories"] == 2
    # the one failing command: counted failed, its exit code in the histogram
    assert summary["failed"] == 1 and summary["exit_codes"] == {"0": 5, "3": 1}
    outputs = [json.loads(line) for line in (live / "outputs.jsonl").read_text().splitlines()]
    by_id = {o["action_id"]: o for o in outputs}
    assert by_id["j0#2"]["status"] == "failed" and by_id["j0#2"]["exit_code"] == 3
    assert "to-stdout" in by_id["j0#2"]["output_tail"] and "to-stderr" in by_id["j0#2"]["output_tail"]
    # rows without a command burn CPU (not sleep, not echo)
    assert by_id["j1#1"]["argv"][1:3] == ["-m", "executor.bench.burn"]
    assert "burn t1=0.2" in by_id["j1#1"]["output_tail"]
    frame = pd.read_parquet(live / "actions.parquet")
    assert set(frame.loc[frame["status"] == "failed", "action_id"]) == {"j0#2"}
    # think times were halved: the first action of each trajectory was submitted at ~0.1 s
    first = frame[frame["action_id"].str.endswith("#0")]["submit_s"]
    assert (first < 0.19).all(), first.tolist()

    sim = tmp_path / "sim"
    res = tangram("simulate", "--trace", str(trace), "--cluster", str(live / "cluster.yaml"),
                  "--limit", "2", "--think-scale", "0.5", "--out", str(sim), "--quiet")
    assert res.returncode == 0, res.stderr
    sim_summary = json.loads((sim / "summary.json").read_text())
    assert sim_summary["actions"] == 6
    assert yaml.safe_load((sim / "cluster.yaml").read_text()) == \
        yaml.safe_load((live / "cluster.yaml").read_text())

    table = compare_table([load_run(live), load_run(sim)]).set_index("metric")
    assert list(table.columns) == ["live", "sim", "% sim"]
    for metric in ("act_mean_s", "act_p50_s", "act_p99_s", "queue_mean_s", "exec_p99_s",
                   "makespan_s", "same_units"):
        assert metric in table.index
    expect = 100 * (table.loc["act_mean_s", "sim"] / table.loc["act_mean_s", "live"] - 1)
    assert table.loc["act_mean_s", "% sim"] == pytest.approx(expect)
    assert 0.0 <= table.loc["same_units", "sim"] <= 1.0
    res = tangram("compare", str(live), str(sim), "--out", str(tmp_path / "cmp"))
    assert res.returncode == 0, res.stderr
    assert "act_mean_s" in res.stdout and (tmp_path / "cmp" / "compare.png").exists()
    bad = tangram("compare", str(live), str(tmp_path / "nope"))
    assert bad.returncode == 2 and "not a tangram run directory" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_coding_trace_action_share_matches_fig3c():
    """Fig. 3(c): a coding trajectory spends 47% of its time in actions (on average)."""
    df = generate("coding", 1024, 11)
    g = df.groupby("trajectory")
    action, think = g["t1_s"].sum(), g["think_s"].sum()
    share = float((action / (action + think)).mean())
    assert 0.45 <= share <= 0.49, share
