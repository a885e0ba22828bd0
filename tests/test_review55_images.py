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
