"""Issue 9's CPU targets, in simulation with fixed seeds: no head-of-line blocking of
short commands, elasticity learnt online (no oracle) that still pays off."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from helpers import open_trajectory, submit
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.outputs import analyse
from sim.driver import SimConfig, simulate
from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.estimates import DurationModel, Estimates, SpeedupCurve, residual_mean
from tangram.model import Action, Demand
from traces.schema import COLUMNS, validate

NODE = ClusterSpec(cpu_nodes=(CpuNodeSpec("n0", 2, 1, 64.0),))


def hol_trace(seed: int, trajectories: int = 8, shorts: int = 10) -> pd.DataFrame:
    """Each trajectory: ls-like commands (0.01-0.05 s) with LLM thinking between them
    (1-4 s), and one elastic test run (2-20 s on one core, Amdahl 0.5-0.8) somewhere in
    the middle. Nothing is profiled: the scheduler learns."""
    rng = np.random.default_rng(seed)
    base = {k: v[2] for k, v in COLUMNS.items()}
    rows = []
    for j in range(trajectories):
        test_at = int(rng.integers(2, shorts - 2))
        for seq in range(shorts + 1):
            row = {**base, "task": "swe", "trajectory": f"j{j}", "seq": seq, "mem_gb": 1.0,
                   "think_s": float(rng.uniform(1, 4)) if seq else float(rng.uniform(0, 2))}
            if seq == test_at:
                row.update(kind="test_run", t1_s=float(rng.uniform(2, 20)), cpu_cores="1-2",
                           elastic="cpu", parallel_fraction=float(rng.uniform(0.5, 0.8)))
            else:
                row.update(kind="shell", t1_s=float(rng.uniform(0.01, 0.05)), cpu_cores="1")
            rows.append(row)
    return validate(pd.DataFrame(rows))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_commands_do_not_wait_behind_test_runs(seed):
    """Execution time is what the run recorded (it includes the trajectory's container
    start at its first action and the lane's time-sharing slowdown)."""
    df = hol_trace(seed)
    runs = {name: analyse(simulate(df, NODE, SimConfig(policy=p, seed=seed, options=o)))
            for name, p, o in (("tangram", "tangram", {}), ("fixed-dop:1", "fixed-dop:1", {}),
                               ("no-lane", "tangram", {"light_s": 0.0}))}
    acts = runs["tangram"].actions
    short = acts[acts["kind"] == "shell"]
    ratio = short["act_s"].mean() / short["exec_s"].mean()
    assert ratio <= 1.5, f"short commands' mean ACT is {ratio:.2f}x their execution time"
    t, f = (runs[p].summary["act_mean_s"] for p in ("tangram", "fixed-dop:1"))
    assert t <= f, f"tangram mean ACT {t:.3f} s > fixed DoP 1's {f:.3f} s"
    assert short["lane"].mean() > 0.5  # most shorts used the lane once learnt light
    # without the lane the same shorts wait for whole cores behind the test runs
    blocked = runs["no-lane"].actions
    blocked = blocked[blocked["kind"] == "shell"]
    assert blocked["queue_s"].mean() > 5 * max(short["queue_s"].mean(), 1e-3)


def test_unprofiled_rows_reach_the_scheduler_without_their_truth():
    from traces.schema import trajectories

    df = hol_trace(0, trajectories=2)
    for spec in trajectories(df):
        for step in spec.steps:
            assert step.action.t1_s is None and step.action.elasticity is None
            assert step.truth is not None and step.truth.t1_s > 0
            assert "t1_s" not in step.action.payload and "parallel_fraction" not in step.action.payload


# -- elasticity learnt online ----------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.floats(0.0, 20.0), st.floats(0.1, 50.0), st.floats(0.0, 3.0),
       st.lists(st.sampled_from([1, 2, 4, 8]), min_size=6, max_size=30))
def test_curve_recovers_a_noiseless_curve(a, b, c, units):
    """Whatever the serial, parallel and per-unit parts (a slowdown included), exact
    observations at three or more unit counts give back the curve."""
    units = [*units, 1, 2, 8]
    curve = SpeedupCurve()
    for m in units:
        curve.observe(m, a + b / m + c * (m - 1))
    for m in (1, 2, 4, 8):
        assert curve.duration(m) == pytest.approx(a + b / m + c * (m - 1), rel=1e-6, abs=1e-6)


def test_exploration_is_bounded_and_a_learnt_slowdown_keeps_the_minimum():
    from tangram.core import Tangram

    model = DurationModel()
    key, choices = ("t", "test_run"), (1, 2, 4)
    assert model.learnt_table(key, choices) is not None  # the prior: explore
    act = Action("x", "t", "j", "test_run", {"cpu": Demand.range(1, 4)}, elastic="cpu")
    for _ in range(DurationModel.EXPLORE_RUNS):  # only ever ran on one core
        model.observe(act, 1, 5.0, "cpu:n0", elastic=True)
    assert model.learnt_table(key, choices) is None  # stop exploring: run at the minimum
    # a kind whose workers cost more than they bring: -n 2 slower than -n 1
    est = Estimates()
    core = Tangram(ClusterSpec(cpu_nodes=(CpuNodeSpec("n0", 4, 1, 16.0),)), estimates=est)
    # (enough runs to outweigh the prior the fit is shrunk to: EXPLORE_RUNS runs' worth)
    for m in (1, 2, 4) * DurationModel.EXPLORE_RUNS:
        est.durations.observe(act, m, 4.0 + 1.0 / m + 2.0 * (m - 1), "cpu:n0", True)
    open_trajectory(core, "j")
    [d] = submit(core, Action("y", "t", "j", "test_run", {"cpu": Demand.range(1, 4)},
                             elastic="cpu"), 0.0)
    table = est.durations.learnt_table(key, choices + (3,))
    assert d.units == 1 and d.expected_s == pytest.approx(table[1])


def test_a_kind_run_at_one_width_explores_a_middle_one():
    """Issue 30: exploration ran nearly every test at one width, and the curve then rested
    on two small 1-core runs. Once half of EXPLORE_RUNS runs sat at one count and until
    CONTRAST_RUNS runs were at others, the next runs are held at the choice nearest the
    geometric midpoint of the minimum and that count (4 of 1-16); then the curve decides."""
    act = Action("x", "t", "j", "test_run", {"cpu": Demand.range(1, 16)}, elastic="cpu")
    key, choices = ("t", "test_run"), tuple(range(1, 17))
    model = DurationModel()

    def best() -> int:
        table = model.learnt_table(key, choices)
        assert table is not None
        return min(table, key=table.get)

    for _ in range(DurationModel.EXPLORE_RUNS // 2 - 1):
        model.observe(act, 16, 6.0, "cpu:n0", elastic=True)
    assert best() == 16  # the prior: explore wide
    model.observe(act, 16, 6.0, "cpu:n0", elastic=True)
    assert best() == 4  # one width only: try the middle one
    for _ in range(DurationModel.CONTRAST_RUNS - 1):
        model.observe(act, 4, 9.0, "cpu:n0", elastic=True)
    assert best() == 4
    model.observe(act, 4, 9.0, "cpu:n0", elastic=True)
    assert best() == 16  # enough contrast: the curve (4 cores 1.5x slower) decides


def test_a_few_runs_do_not_overrule_the_speedup_prior():
    """The runs of one kind are suites of different sizes: a few of them fit any shape.
    The learnt curve is shrunk towards the exploration prior (as if it were EXPLORE_RUNS
    runs), so three runs in which the wide grants happened to be the large suites do not
    make the kind look serial (issue 30: a flat curve after 12 runs kept the next tests
    on 1 core of 63 free, and those runs then confirmed it); many runs do."""
    act = Action("x", "t", "j", "test_run", {"cpu": Demand.range(1, 16)}, elastic="cpu")
    key, choices = ("t", "test_run"), (1, 2, 4, 8, 16)
    few = DurationModel()
    for m, s in ((16, 12.0), (16, 10.0), (1, 9.0)):  # wide runs no faster: a flat fit
        few.observe(act, m, s, "cpu:n0", elastic=True)
    curve = few.curve(key)
    assert curve is not None and curve.duration(16) >= curve.duration(1)  # the fit: serial
    table = few.learnt_table(key, choices)
    assert table is not None and table[16] < table[1]  # still worth trying wider
    many = DurationModel()
    for _ in range(20 * DurationModel.EXPLORE_RUNS):
        for m, s in ((16, 10.0), (1, 10.0)):  # a kind that really is serial
            many.observe(act, m, s, "cpu:n0", elastic=True)
    table = many.learnt_table(key, choices)
    assert table is not None and table[16] > 0.9 * table[1]


def test_runs_in_flight_are_read_as_censored():
    """Issue 30: runs end in order of length, so a unit count's first results are its short
    runs; read alone, a count just moved to looks fast, the fit goes flat and grants step
    down to 1 core. A run in flight at ``m`` units for ``e`` s says its time there is at
    least ``e``: the curve counts it at its expected time given that (residual_mean)."""
    def act(i: int) -> Action:
        return Action(f"a{i}", "t", "j", "test_run", {"cpu": Demand.range(1, 16)},
                      elastic="cpu")

    key, choices = ("t", "test_run"), (1, 2, 4, 8, 16)
    sizes = (6.0, 20.0, 34.0)  # one-unit times of the kind's suites: Amdahl, p = 1

    def table(censored: bool) -> dict[int, float]:
        model = DurationModel()
        for i in range(12):  # 12 runs each at 16 and 8 units, all ended
            for m in (16, 8):
                model.observe(act(i), m, sizes[i % 3] / m, "cpu:n0", elastic=True)
        for i in range(100, 112):  # 12 started at 4 units at 0 s ...
            if censored:
                model.started(act(i), 4, 0.0)
        for i in range(100, 112, 3):  # ... at 3 s only the small suites (1.5 s) ended
            model.observe(act(i), 4, sizes[0] / 4, "cpu:n0", elastic=True)
            model.ended(f"a{i}")
        model.now = 3.0
        got = model.learnt_table(key, choices)
        assert got is not None
        return got

    ended_only, with_running = table(False), table(True)
    assert ended_only[1] / ended_only[16] < 3  # read flat (truth: 16x)
    assert with_running[1] / with_running[16] > 8
    # the memoryless case: a run e s in ends e + its expected time from now; runs of one
    # length (cv 0): at the later of e and the expected time
    e = np.array([0.0, 5.0, 30.0])
    assert residual_mean(e, 10.0, 1.0) == pytest.approx([10.0, 15.0, 40.0])
    assert residual_mean(e, 10.0, 0.0) == pytest.approx([10.0, 10.0, 30.0])


def test_a_run_ends_out_of_flight_however_it_ends():
    model = DurationModel()
    a = Action("a", "t", "j", "test_run", {"cpu": Demand.range(1, 16)}, elastic="cpu")
    model.started(a, 4, 1.0)
    model.started(a, 8, 2.0)  # (announced twice: the first start counts)
    model.now = 3.0
    running = model.running(("t", "test_run"))
    assert running is not None
    elapsed, features = running
    assert elapsed.tolist() == [2.0] and features.tolist() == [[1.0, 0.25, 3.0]]
    model.now = 4.0  # (the arrays are kept; the elapsed times are as of now)
    assert model.running(("t", "test_run"))[0].tolist() == [3.0]
    model.ended("a")  # (not observed: a failure)
    assert model.running(("t", "test_run")) is None
    model.ended("a")  # (ended twice, or never announced: nothing)
    for i, m in enumerate((1, 2, 4, 8) * 5):  # (past the arrays' first capacity)
        model.started(Action(f"b{i}", "t", "j", "test_run", {"cpu": Demand.range(1, 16)},
                             elastic="cpu"), m, float(i))
    for i in range(0, 20, 3):
        model.ended(f"b{i}")
    model.now = 30.0
    elapsed, features = model.running(("t", "test_run"))
    left = sorted(zip((30.0 - elapsed).tolist(), features[:, 1].tolist(), strict=True))
    assert left == [(float(i), 1.0 / (1, 2, 4, 8)[i % 4]) for i in range(20) if i % 3]
