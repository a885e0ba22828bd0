"""Trace formats, validation messages and the CLI's error handling (real subprocesses)."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from traces.generate import generate
from traces.schema import TraceError, load, validate, write

ROOT = Path(__file__).parent.parent


def tangram(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=300)


@pytest.mark.parametrize("ext", ["parquet", "csv", "jsonl"])
def test_round_trip_every_format(tmp_path, ext):
    df = validate(generate("mixed", 6, 2))
    path = write(df, tmp_path / f"t.{ext}")
    back = load(path)
    pd.testing.assert_frame_equal(back.reset_index(drop=True), df.reset_index(drop=True),
                                  check_dtype=False, atol=1e-9)


def test_validation_lists_every_problem(tmp_path):
    df = generate("coding", 2, 0)
    df.loc[0, "t1_s"] = -1.0
    df.loc[1, "cpu_cores"] = "8-2"
    df.loc[2, "elastic"] = "tpu"
    df = df.drop(columns=["kind"])
    with pytest.raises(TraceError) as e:
        validate(df)
    assert any("'kind': missing" in p for p in e.value.problems)
    df["kind"] = "shell"
    with pytest.raises(TraceError) as e:
        validate(df)
    text = str(e.value)
    assert "row 1, column 't1_s', value -1.0: negative" in text
    assert "row 2, column 'cpu_cores'" in text and "min 8 > max 2" in text
    assert "row 3, column 'elastic'" in text


def test_an_infinite_time_is_refused_naming_its_row():
    """An infinite think ended its trajectory in a 'deadlock' error of the simulator; an
    infinite t1_s ran until the action's timeout."""
    df = generate("coding", 2, 0)
    df.loc[1, "think_s"] = float("inf")
    df.loc[3, "t1_s"] = float("inf")
    with pytest.raises(TraceError) as e:
        validate(df)
    text = str(e.value)
    assert "row 2, column 'think_s', value inf: not finite" in text
    assert "row 4, column 't1_s', value inf: not finite" in text


def test_cli_validate_exit_codes(tmp_path):
    good = tmp_path / "good.csv"
    write(generate("deepsearch", 3, 0), good)
    ok = tangram("trace", "validate", str(good))
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.csv"
    text = good.read_text().splitlines()
    header = text[1].split(",")
    row = text[2].split(",")
    row[header.index("think_s")] = "abc"
    bad.write_text("\n".join([text[0], text[1], ",".join(row), *text[3:]]) + "\n")
    res = tangram("trace", "validate", str(bad))
    assert res.returncode == 2
    assert "row 1, column 'think_s', value 'abc': not a number" in res.stderr
    assert "Traceback" not in res.stderr
    missing = tangram("trace", "validate", str(tmp_path / "nope.parquet"))
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_cli_simulate_writes_outputs_and_refuses_bad_cluster(tmp_path):
    trace = tmp_path / "c.parquet"
    assert tangram("trace", "generate", "--workload", "coding", "--trajectories", "8",
                   "--out", str(trace)).returncode == 0
    out = tmp_path / "run"
    res = tangram("simulate", "--trace", str(trace), "--out", str(out), "--quiet", "--perfetto")
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in ("policy", "actions", "act_mean_s", "act_p50_s", "act_p99_s", "queue_mean_s",
                "exec_mean_s", "step_time_s", "utilisation", "per_kind"):
        assert key in summary
    assert len(pd.read_parquet(out / "actions.parquet")) == summary["actions"]
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    bare = tmp_path / "bare"  # without --perfetto: no trace.json, the rest as before
    assert tangram("simulate", "--trace", str(trace), "--out", str(bare), "--quiet").returncode == 0
    assert not (bare / "trace.json").exists()
    assert (bare / "actions.parquet").read_bytes() == (out / "actions.parquet").read_bytes()
    cluster = tmp_path / "bad.yaml"
    cluster.write_text("cpu_nodes:\n  - {count: 1, cores: -4}\nquotas:\n  - {key: s, mode: x}\n")
    res = tangram("simulate", "--trace", str(trace), "--cluster", str(cluster), "--quiet")
    assert res.returncode == 2
    assert "cpu_nodes[0].cores" in res.stderr and "quotas[0].mode" in res.stderr
    assert "Traceback" not in res.stderr
    res = tangram("simulate", "--trace", str(trace), "--policy", "nope", "--quiet")
    assert res.returncode == 2 and "unknown policy" in res.stderr


def test_help_on_every_command():
    for args in (["--help"], ["simulate", "--help"], ["trace", "validate", "--help"],
                 ["trace", "generate", "--help"], ["bench", "scheduler", "--help"],
                 ["policies", "--help"]):
        res = tangram(*args)
        assert res.returncode == 0 and "Usage" in res.stdout, args


def test_every_shipped_trace_declares_its_profiles(tmp_path):
    """The samples tell the scheduler what a profile would (the generator's default
    error), never the truth; the generated ones are exactly their recipe's output."""
    from traces.samples import DIR, GENERATED, exact_profiles

    shipped = sorted(DIR.glob("*.parquet"))
    assert {s.path for s in GENERATED} < set(shipped)
    for path in shipped:
        df = load(path)
        profiled = df["profiled"].astype(bool)
        assert profiled.any() and exact_profiles(df) == 0, path.name
        assert df.loc[profiled, "declared_t1_s"].notna().all(), path.name
    for s in GENERATED:
        pd.testing.assert_frame_equal(load(s.path), s.make(), check_dtype=False, atol=1e-9)
    # `trace validate` warns (and still passes) when a trace gives exact profiles
    exact = write(generate("mopd", 4, 0, profile_sigma=0.0), tmp_path / "exact.parquet")
    res = tangram("trace", "validate", str(exact))
    assert res.returncode == 0 and "4 of 4 profiled rows" in res.stderr, res.stderr
    res = tangram("trace", "validate", str(DIR / "mopd.parquet"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr


def test_a_trajectorys_steps_are_built_when_asked_for_as_a_tuple_would_give_them():
    """traces.schema.Steps: indexing, slicing and iteration give what a tuple of the steps
    would, and each access builds its step anew (a simulation holds a step only while it
    plays it, not the whole trace's actions)."""
    from traces.schema import Steps, trajectories

    df = validate(generate("coding", 6, 3))
    specs = list(trajectories(df, prefix="s1/"))
    assert sum(len(s.steps) for s in specs) == len(df)
    for spec in specs:
        steps = spec.steps
        assert isinstance(steps, Steps)
        built = list(steps)
        assert built == [steps[i] for i in range(len(steps))] == [steps[i - len(steps)]
                                                                  for i in range(len(steps))]
        assert list(steps[1:]) == built[1:] and list(steps[:2]) == built[:2]
        assert list(steps[len(steps):]) == [] and len(steps[5:2]) == 0
        assert steps[0] == built[0] and steps[0] is not steps[0]
        assert all(s.action.trajectory == spec.id and s.action.id.startswith("s1/")
                   for s in built)
        with pytest.raises(IndexError):
            steps[len(steps)]
