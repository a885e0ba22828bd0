"""Review of `tangram plan` (issue 52) meeting issue 50's images and a user's mistakes: a
node's image cache kept in the sizes searched, a plan no size can run said as such (exit
2, the error named), a target no size meets said with how close it came, and an --out
that cannot be a directory refused before the search."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from analysis.plan import PlanConfig, PlanError, Size, parse_target, plan, sized
from sim.cluster import load_cluster
from tangram.cluster import ClusterSpec, CpuNodeSpec
from traces.generate import generate
from traces.schema import validate, write

ROOT = Path(__file__).resolve().parent.parent


def test_a_sized_node_keeps_its_image_cache():
    # (it was rebuilt from cores, NUMA and memory alone: every node of a plan for a swe
    # trace had an unbounded image cache, and the plan sized a cluster for the ideal)
    base = ClusterSpec(cpu_nodes=(CpuNodeSpec("n", 8, 2, 64.0, image_cache_gb=200.0),))
    nodes = sized(base, Size(16, 3)).cpu_nodes
    assert [(n.cores, n.numa, n.mem_gb, n.image_cache_gb) for n in nodes] == \
        [(16, 2, 128.0, 200.0)] * 3
    assert len({n.name for n in nodes}) == 3


def test_a_plan_no_size_can_run_says_why():
    # a trace naming images on a cluster without the pull figures: every simulation fails
    # the same way; it was reported as "not met by any shape within N nodes" (exit 1)
    rows = validate(generate("swe", 4, 0, images=2))
    spec = load_cluster("default")
    spec = replace(spec, extra={k: v for k, v in spec.extra.items()
                                if not k.startswith("image_")})
    config = PlanConfig(parse_target("step<=1h"), ("tangram",), (64,), 4, max_nodes=4)
    with pytest.raises(PlanError, match=r"no simulation could run .*extra.image_pull_mbps"):
        plan(rows, spec, config)


def small_trace():
    df = generate("coding", 4, 5)
    for col in ("t1_s", "think_s"):
        df[col] = df[col] * 0.1
    return validate(df)


def test_a_target_no_size_meets_says_how_close_it_came():
    config = PlanConfig(parse_target("mean_act<=0.001s"), ("tangram",), (4,), 4,
                        max_nodes=3)
    answer = plan(small_trace(), ClusterSpec(cpu_nodes=(CpuNodeSpec("n", 4, 1, 64.0),)),
                  config)
    why = answer["policies"]["tangram"]["why"]
    assert not answer["policies"]["tangram"]["met"]
    assert why.startswith("not met by any shape within 3 nodes (closest: mean_act "), why
    assert " x 4 cores)" in why, why


def test_an_out_that_is_a_file_is_refused_before_the_search(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    write(small_trace(), trace)
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "plan", "--trace", str(trace), "--target",
         "step<=1h", "--policies", "tangram", "--jobs", "1", "--out", str(taken)],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 2, done.stderr
    assert f"--out: cannot make the directory {taken}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "planning" not in done.stderr, done.stderr
    assert taken.read_text() == "mine\n"


def test_plan_says_which_node_shape_it_sizes_and_that_a_row_was_cut_off(tmp_path: Path):
    # a crashed recording whose cluster file is not beside it: sized silently in nodes of
    # the built-in default's shape, its cut-off last row skipped unsaid
    trace = tmp_path / "rec.jsonl"
    write(small_trace(), trace)
    with trace.open("a") as f:
        f.write('{"task": "coding", "traj')
    done = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "plan", "--trace", str(trace), "--target",
         "step<=1h", "--policies", "tangram", "--cores-per-node", "4", "--max-nodes", "2",
         "--jobs", "1", "--out", str(tmp_path / "p"), "-q"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "no rec-cluster.yaml beside the trace" in done.stderr, done.stderr
    assert "has no end and is not JSON" in done.stderr, done.stderr


def test_a_target_past_floats_is_refused():
    # ("1e400" read as inf: every size met it, the smallest was "found" at once)
    with pytest.raises(PlanError, match=r"--target: the bound must be > 0 s and finite"):
        parse_target("step<=1e400")


def test_a_policy_or_shape_named_twice_is_planned_once():
    # (`--cores-per-node 4,4` or `--policies tangram,tangram`: a KeyError after the search)
    base = ClusterSpec(cpu_nodes=(CpuNodeSpec("n", 4, 1, 64.0),))
    config = PlanConfig(parse_target("step<=1h"), ("tangram", "tangram"), (4, 4), 4,
                        max_nodes=3)
    answer = plan(small_trace(), base, config)
    assert list(answer["policies"]) == ["tangram"] and answer["cores_per_node"] == [4]
    assert answer["policies"]["tangram"]["met"]
    assert len(answer["policies"]["tangram"]["per_resample"]) == 5


def test_no_node_shape_is_refused(tmp_path: Path):
    # (`--cores-per-node ","`: a min() of nothing, a traceback after the search)
    trace = tmp_path / "t.jsonl"
    write(small_trace(), trace)
    done = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "plan", "--trace", str(trace), "--target",
         "step<=1h", "--policies", "tangram", "--cores-per-node", ",", "--jobs", "1",
         "--out", str(tmp_path / "p")],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "--cores-per-node: name at least one core count" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_negative_seed_is_refused_before_the_search():
    # (numpy's "expected non-negative integer" from the first simulation, a traceback)
    config = PlanConfig(parse_target("step<=1h"), ("tangram",), (4,), 4, seed=-1)
    with pytest.raises(PlanError, match=r"--seed: must be >= 0, got -1"):
        plan(small_trace(), ClusterSpec(cpu_nodes=(CpuNodeSpec("n", 4, 1, 64.0),)), config)
