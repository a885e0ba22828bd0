"""Review of issue 50's simulator half: sizes and bandwidths that hung a simulation or were
simulated as free, refused with the field and value named (or run to an end)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sim.clock import SimClock
from sim.cluster import load_cluster
from sim.driver import SimConfig, simulate
from sim.images import ImageCaches
from traces.generate import generate
from traces.schema import TraceError, validate


def swe(n: int = 4) -> object:
    return validate(generate("swe", n, 0, images=2))


def test_an_infinite_pull_bandwidth_is_refused_not_looped_on():
    # (it re-armed a 0 s timer that never moved the clock: a simulation that never ended)
    spec = load_cluster("default")
    bad = replace(spec, extra={**spec.extra, "image_pull_mbps": math.inf})
    with pytest.raises(ValueError, match=r"extra.image_pull_mbps: must be a finite number "
                                         r"> 0, got inf"):
        simulate(swe(), bad, SimConfig())


def test_a_pull_ends_when_the_clock_cannot_advance_by_its_last_bytes():
    # late in a run a float clock cannot move by the time a pull's last bytes take: the
    # timer set for the pull with least left ends it all the same
    clock = SimClock()
    ended: list[float] = []
    caches = ImageCaches(clock, {"a": 1000.0}, {"n": None}, 8000.0, 1)
    clock.call_later(1e17, lambda: caches.acquire("n", "a", lambda p: ended.append(1.0)))
    clock.run()
    assert ended == [1.0] and caches.pulls_done == 1


@pytest.mark.parametrize("gb", [0.0, math.inf, math.nan, -1.0])
def test_the_simulator_refuses_an_image_without_a_size(gb):
    # (a size of 0 was pulled in no time: every image free, silently)
    with pytest.raises(ValueError, match=r"image 'x': image_gb must be a finite size > 0"):
        ImageCaches(SimClock(), {"x": gb}, {"n": None}, 1000.0, 1)


def test_a_trace_naming_an_image_with_no_size_is_not_simulated_as_free():
    df = swe().copy()
    df["image_gb"] = 0.0
    with pytest.raises(ValueError, match=r"image_gb must be a finite size > 0 .* got 0.0"):
        simulate(df, load_cluster("default"), SimConfig())


@pytest.mark.parametrize(("value", "why"), [
    ("inf", "not a finite size"),
    (9.3e9, "more than 10,000 GB (sizes are GB, not MB or bytes)"),
])
def test_image_sizes_that_cannot_be_simulated_are_named(value, why):
    df = swe().astype({"image_gb": object})
    df.loc[3, "image_gb"] = value
    with pytest.raises(TraceError) as e:
        validate(df)
    assert any("row 4, column 'image_gb'" in p and why in p for p in e.value.problems), \
        e.value.problems


def test_a_pull_ahead_for_a_trajectory_that_starts_elsewhere_is_wanted_no_more():
    # The core pulls b ahead to n1 for t1, and a ahead to n2 for t2; t1 then starts on
    # n2 (its planned node had no room when it bound). It used to take t2's want of its
    # image on n2 (t2's image evictable before t2 starts) and leave its own on n1 for
    # ever (b never evictable there: left wanted at the end of a run).
    clock = SimClock()
    caches = ImageCaches(clock, {"a": 1.0, "b": 1.0}, {"n1": 1.0, "n2": 1.0}, 8000.0, 1)
    caches.prefetch("n1", "b", "t1")
    caches.prefetch("n2", "a", "t2")
    clock.run()
    caches.acquire("n2", "b", lambda p: None, "t1")
    clock.run()
    assert caches.nodes["n1"].wanted["b"] == 0
    assert caches.nodes["n2"].wanted["a"] == 1
    assert "a" in caches.nodes["n2"].held  # (still wanted by t2: kept, b's pull over)
    caches.release("n2", "b")
    assert set(caches.nodes["n2"].held) == {"a"}  # b, unused and unwanted, went
    got: list = []
    caches.acquire("n2", "a", got.append, "t2")
    assert got == [None]  # t2's image was held: no pull of its own


def test_a_trajectory_closed_before_it_started_leaves_no_want():
    clock = SimClock()
    caches = ImageCaches(clock, {"a": 1.0}, {"n": 1.0}, 8000.0, 1)
    caches.prefetch("n", "a", "t")
    clock.run()
    caches.forget("t")
    assert caches.nodes["n"].wanted["a"] == 0 and not caches.wants


def test_the_core_names_the_trajectory_it_pulls_ahead_for():
    from tangram.cluster import ClusterSpec, CpuNodeSpec
    from tangram.core import Tangram
    from tangram.policies import make_policy
    from tangram.protocol import Attach, Capabilities, Open, PullImage

    core = Tangram(ClusterSpec((CpuNodeSpec("n0", cores=8, numa=1, mem_gb=64,
                                            image_cache_gb=20.0),)), make_policy("tangram"))
    core.handle(Attach(Capabilities(pulls=True)), 0.0)
    out = core.handle(Open("t", "swe", 1.0, "img", 5.0), 0.0)
    assert out == [PullImage("n0", "img", "t")]


def _validate_cli(*args: str):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, str(root / "cli.py"), "trace", "validate", *args],
                          capture_output=True, text=True, cwd=root, timeout=600)


def test_trace_validate_says_what_simulate_will_refuse_of_images(tmp_path):
    # (it said "valid" to a trace whose images have no size, and, with --cluster, to a
    # cluster without the pull figures: both refused by simulate)
    from traces.schema import write

    df = swe().copy()
    df["image_gb"] = 0.0
    sizeless = write(df, tmp_path / "sizeless.jsonl")
    done = _validate_cli(str(sizeless))
    assert done.returncode == 0 and "image(s) with no image_gb" in done.stderr, done.stderr
    cluster = tmp_path / "c.yaml"
    cluster.write_text("cpu_nodes:\n  - {count: 2, cores: 64, numa: 2, mem_gb: 512}\n")
    sized = write(swe(), tmp_path / "swe.jsonl")
    done = _validate_cli(str(sized), "--cluster", str(cluster))
    assert done.returncode == 2, done.stderr
    assert "the cluster file has no extra.image_pull_mbps" in done.stderr, done.stderr
