"""The analysis API (analysis/runs.py) that notebooks, `tangram plot` and the report share:
a run directory round-trips into the same frames, `compare` reports what summary.json
says, and the CLI reads runs through it (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib
import pandas as pd
import pytest
from conftest import ROOT

from analysis import figures
from analysis.runs import STATS, RunError, change, compare, load_run, per_kind, simulate, with_trace
from traces.generate import generate
from traces.schema import write

matplotlib.use("Agg")


def tangram(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same small trace through `tangram simulate` under two policies."""
    tmp = tmp_path_factory.mktemp("runs")
    trace = write(generate("coding", 12, 1), tmp / "coding.parquet")
    for policy, options in (("tangram", []), ("k8s", ["--pod-cores", "8"])):
        r = tangram("simulate", "--trace", str(trace), "--policy", policy, *options,
                    "--out", str(tmp / policy), "--quiet")
        assert r.returncode == 0, r.stderr
    return tmp, trace


def test_load_run_reads_what_simulate_wrote(runs):
    tmp, trace = runs
    run = load_run(tmp / "k8s")
    assert run.name == "k8s" and run.policy == "k8s" and run.path == tmp / "k8s"
    assert run.config["policy"]["cpu"]["pod_cores"] == 8 and run.config["trace"] == str(trace)
    assert len(run.actions) == len(pd.read_parquet(trace)) == run.summary["actions"]
    assert {"act_s", "queue_s", "exec_s", "kind", "cores"} <= set(run.actions.columns)
    assert run.utilisation is not None and "cpu" in run.utilisation
    assert run.timing is not None and len(run.timing) == len(run.actions)
    assert run.capacity("cpu") == 128.0 and run.capacity("tpu") is None
    assert repr(run) == f"Run('k8s', policy='k8s', actions={len(run.actions)}, path='{tmp / 'k8s'}')"


def test_in_memory_simulation_equals_the_cli_run(runs):
    tmp, trace = runs
    mine = simulate(trace, "default", "k8s", pod_cores=8)
    theirs = load_run(tmp / "k8s")
    pd.testing.assert_frame_equal(mine.actions, theirs.actions)
    mine.summary.pop("timing")
    theirs.summary.pop("timing")
    assert json.loads(json.dumps(mine.summary)) == theirs.summary


def test_compare_measures_each_run_as_its_summary_does(runs):
    tmp, _ = runs
    t, k = load_run(tmp / "tangram"), load_run(tmp / "k8s")
    table = compare([t, k])
    assert list(table.index) == ["tangram", "k8s"] and table.loc["k8s", "policy"] == "k8s"
    for m in ("act_mean_s", "act_p50_s", "act_p99_s", "queue_mean_s", "queue_p99_s",
              "exec_mean_s", "makespan_s", "failed", "actions"):
        assert table.loc["k8s", m] == pytest.approx(k.summary[m]), m
    for name, col, stat in STATS:  # p50 of queue/exec: straight from actions.parquet
        q = {"mean": k.actions[col].mean(), "p50": k.actions[col].quantile(0.5),
             "p99": k.actions[col].quantile(0.99)}[stat]
        assert table.loc["k8s", name] == pytest.approx(q), name
    assert table.loc["tangram", "cpu_busy"] == pytest.approx(t.summary["utilisation"]["cpu"]["busy"])
    same = (t.actions.set_index("action_id")["units"]
            == k.actions.set_index("action_id")["units"].reindex(t.actions["action_id"])).mean()
    assert table.loc["tangram", "same_units"] == 1.0
    assert table.loc["k8s", "same_units"] == pytest.approx(same) and same < 1.0
    pct = change(table, "tangram")
    expected = 100 * (k.summary["act_mean_s"] / t.summary["act_mean_s"] - 1)
    assert pct.loc["k8s", "act_mean_s"] == pytest.approx(expected)
    assert (pct.loc["tangram"].dropna() == 0).all()
    assert not {"actions", "failed", "same_units"} & set(pct.columns)  # read those as is
    with pytest.raises(ValueError, match="unique"):
        compare([t, t])


def test_frames_for_figures(runs):
    tmp, trace = runs
    t = load_run(tmp / "tangram")
    kinds = per_kind([t])
    assert kinds.set_index("kind")["count"].to_dict() == t.actions["kind"].value_counts().to_dict()
    joined = with_trace(t.actions, pd.read_parquet(trace))
    assert joined["t1_s"].notna().all() and len(joined) == len(t.actions)
    for draw in (figures.act_cdf, figures.act_per_kind, figures.time_breakdown,
                 figures.utilisation):
        ax = draw([t])
        assert ax.get_title() and ax.get_legend() is not None


def test_load_run_names_what_is_wrong(tmp_path):
    with pytest.raises(RunError, match="no summary.json"):
        load_run(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(RunError, match="summary.json: not valid JSON"):
        load_run(tmp_path)


def test_plot_draws_from_run_directories(runs, tmp_path):
    tmp, _ = runs
    r = tangram("plot", str(tmp / "tangram"), str(tmp / "k8s"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for name in ("act_cdf", "act_per_kind", "time_breakdown", "cpu_utilisation"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert not (tmp_path / "gpu_utilisation.png").exists()  # no GPU was ever allocated
    bad = tangram("plot", str(tmp_path))
    assert bad.returncode == 2 and "no summary.json" in bad.stderr and "Traceback" not in bad.stderr


def test_streamed_records_read_back_as_the_frame_of_kept_ones(tmp_path):
    """A simulation's records written in row groups as it runs (several, the last one
    partial) read back as the frame of the same run's records kept in memory."""
    import pyarrow.parquet as pq

    from analysis.outputs import ActionsWriter, analyse, records_frame
    from sim.cluster import load_cluster
    from sim.driver import SimConfig
    from sim.driver import simulate as run_sim
    from traces.schema import validate

    df = validate(generate("coding", 12, 1))
    spec = load_cluster("default")
    kept = run_sim(df, spec, SimConfig())
    writer = ActionsWriter(tmp_path / "actions.parquet", rows=7)
    streamed = run_sim(df, spec, SimConfig(), records=writer)
    path = writer.close()
    n = len(kept.records)
    assert streamed.records == [] and streamed.streamed == n > 14
    assert pq.ParquetFile(path).metadata.num_row_groups == -(-n // 7)
    pd.testing.assert_frame_equal(pd.read_parquet(path), records_frame(kept.records))
    with pytest.raises(ValueError, match="streamed"):
        analyse(streamed)  # its records are in the file, not in the result


def test_a_failed_simulation_leaves_no_run_directory(tmp_path):
    def interrupted(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(generate("coding", 12, 1), "default", out=tmp_path / "run", progress=interrupted)
    assert not (tmp_path / "run").exists()


def test_a_summary_from_the_files_columns_is_the_whole_frames(tmp_path):
    """summary.json of a streamed run is computed from actions.parquet's columns
    (summary_frame: no action ids, text as categoricals), its frame read back a row group
    at a time (read_actions): both as from the whole frame, batches and failures included."""
    from analysis.outputs import (
        ActionsWriter,
        dispatches_frame,
        gpu_summary,
        read_actions,
        records_frame,
        summarise,
        summary_frame,
    )
    from tangram.runtime import Record

    def rec(i, kind, start, end, *, gpus="", cores="0", batch="", status="ok", code=None,
            restore=0.0, traj="t0"):
        return Record(f"a{i}", "task", traj, kind, 0.5 * i, start, end, 2 if gpus else 1,
                      "n0", cores if not gpus else "", gpus, restore, 0.1, status, code, 1.0,
                      False, batch)

    records = [rec(0, "shell", 1.0, 2.0), rec(1, "teacher", 2.0, 5.0, gpus="0,1", batch="a1",
                                                restore=1.0, traj="t1"),
               rec(2, "teacher", 2.0, 5.5, gpus="0,1", batch="a1", traj="t2"),
               rec(3, "test_run", 3.0, 9.0, code=1, traj="t1"),
               rec(4, "teacher", 6.0, 7.0, gpus="2", restore=0.5),
               rec(5, "shell", 4.0, 4.5, status="timeout", traj="t2"),
               rec(6, "teacher", 2.0, 6.0, gpus="0,1", batch="a1", traj="t3")]
    writer = ActionsWriter(tmp_path / "actions.parquet", rows=2)
    for r in records:
        writer.append(r)
    path = writer.close()
    whole = records_frame(records)
    pd.testing.assert_frame_equal(read_actions(path), whole)
    slim = summary_frame(path)
    assert "action_id" not in slim
    args = {"policy": "p", "capacity": {"cpu": 4.0, "gpu": 8.0}, "utilisation": None,
            "steps": []}
    assert summarise(slim, **args) == summarise(whole, **args)
    # (summary.json's key order too: grouped by the text, not by a categorical's codes)
    assert json.dumps(summarise(slim, **args)) == json.dumps(summarise(whole, **args))
    assert gpu_summary(slim, 8.0, 9.0, None, None) == gpu_summary(whole, 8.0, 9.0, None, None)
    leases = dispatches_frame(whole)
    assert leases["lease"].tolist() == ["a0", "a1", "a3", "a4", "a5"]
    assert leases.set_index("lease").loc["a1", ["actions", "start_s", "end_s", "restore_s"]
                                          ].tolist() == [3, 2.0, 6.0, 1.0]
    assert summarise(whole, **args)["exit_codes"] == {"1": 1, "none": 6}


def test_a_run_without_batches_has_a_lease_per_record_as_the_grouping_gives():
    """analysis.outputs._leases takes the rows as they are when no record is batched; a
    batch of one (its own id in ``batch_of``) goes through the grouping: the same frame."""
    from analysis.outputs import _leases

    for workload, policy in (("coding", "tangram"), ("deepsearch", "baseline")):
        df = simulate(generate(workload, 6, 2), "default", policy=policy).actions
        assert (df["batch_of"] == "").all() and len(df)
        alone = df.copy()
        alone.loc[alone.index[-1], "batch_of"] = alone["action_id"].iloc[-1]
        pd.testing.assert_frame_equal(_leases(df), _leases(alone))


def test_a_valid_trace_is_not_checked_again(monkeypatch):
    """`tangram simulate` hands analysis.runs.simulate the rows it loaded and checked as a
    ValidTrace: the trace is validated once (a frame is checked, a ValidTrace is not)."""
    import traces.schema
    from traces.schema import ValidTrace, validate

    rows = validate(generate("coding", 4, 1))
    calls = []
    real = traces.schema.validate
    monkeypatch.setattr(traces.schema, "validate", lambda *a, **k: calls.append(1) or real(*a, **k))
    checked = simulate(ValidTrace(rows), "default")
    assert calls == []
    again = simulate(rows, "default")
    assert calls == [1]
    pd.testing.assert_frame_equal(checked.actions, again.actions)
