"""What `tangram simulate` costs, as `tangram bench sim-scale` measures it: the command's
CPU laps (summary.json's timing.cpu_s) add up to what the operating system counted for the
whole process, and the bench's row puts each phase over the floor (real subprocesses)."""

from __future__ import annotations

import pytest

from analysis.bench.sim_scale import PHASES, _floor, point_row, whole_command
from analysis.phases import Phases, cpu_s
from traces.generate import generate
from traces.schema import write


def test_laps_split_the_process_cpu_and_add_up():
    phases = Phases()
    phases.lap("start")  # everything since the process began
    assert phases.seconds["start"] > 0
    sum(i * i for i in range(200_000))
    phases.lap("work")
    phases.lap("work")  # (a phase lapped again adds up)
    assert list(phases.seconds) == ["start", "work"]
    assert sum(phases.seconds.values()) == pytest.approx(cpu_s(), abs=0.05)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    trace = write(generate("coding", 16, 3), tmp / "coding.parquet")
    whole, peak, summary = whole_command(trace, tmp / "run", seed=3)
    return tmp, trace, whole, peak, summary


def test_the_command_writes_its_phases_and_nothing_unasked(measured):
    tmp, _, whole, peak, summary = measured
    laps = summary["timing"]["cpu_s"]
    assert set(laps) == set(PHASES) - {"exit"}, laps
    assert all(v >= 0 for v in laps.values()) and laps["run"] > 0
    # the laps are the process's own CPU: together no more than the OS counted for it
    assert sum(laps.values()) <= whole + 0.05, (laps, whole)
    assert peak > 50
    assert sorted(p.name for p in (tmp / "run").iterdir()) == [
        "actions.parquet", "cluster.yaml", "config.json", "summary.json", "timing.parquet",
        "utilisation.parquet"]  # (trace.json only with --perfetto)


def test_a_row_puts_every_phase_over_the_floor(measured):
    _, trace, whole, peak, summary = measured
    actions, floor_s = _floor(trace)
    row = point_row("coding", 16, whole, peak, summary, actions, floor_s)
    assert row["actions"] == summary["actions"] == actions
    phase_s = [row[f"{p}_cpu_s"] for p in PHASES]
    assert sum(phase_s) == pytest.approx(row["whole_cpu_s"], abs=0.01)
    assert sum(row[f"{p}_x_floor"] for p in PHASES) == pytest.approx(
        row["whole_x_floor"], rel=0.01)
    laps = summary["timing"]["cpu_s"]
    assert row["run_x_floor"] == pytest.approx(laps["run"] / floor_s, rel=0.01)
    with pytest.raises(RuntimeError, match="the floor ran"):
        point_row("coding", 16, whole, peak, summary, actions + 1, floor_s)
    with pytest.raises(RuntimeError, match=r"timing\.cpu_s"):
        point_row("coding", 16, whole, peak, {**summary, "timing": {}}, actions, floor_s)
