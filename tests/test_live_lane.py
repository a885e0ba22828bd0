"""Issue 30, live: a test run holding every core of a real `tangram serve --backend
process` must not delay another trajectory's ``ls`` beyond the light lane's bound.

Asserted on the server's recorded queue wait (the core's start minus submit, on its
clock), against the bound the decision implies: a free lane starts ``ls`` in the pass of
its submit (no wait at all); a lane full of actions that overstay frees within
``lane_hold_s`` of their start (the server moves them off the lane), far below how long
they run. No wall-clock figure of the test itself is asserted."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from conftest import TOKEN, start_server

from tangram.policies import SharedCores

H = {"Authorization": f"Bearer {TOKEN}"}
#: how long the core holders and the lane's overstaying actions run (s): far above the
#: lane's bound, so an ``ls`` that waited for them is told apart on any machine
HOLD_S = 12.0


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("serve-lane"), "process")
    with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
        yield c
    server.stop()


def submit(http, tid: str, aid: str, **body) -> None:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text


def running(http, aid: str, within_s: float = 60.0) -> dict:
    """The action once it runs (a condition with a generous deadline, not a timing)."""
    deadline = time.time() + within_s
    while True:
        res = http.get(f"/v1/actions/{aid}").json()
        if res["status"] != "queued" or time.time() > deadline:
            return res
        time.sleep(0.05)


def result(http, aid: str) -> dict:
    return http.get(f"/v1/actions/{aid}", params={"wait": 120}).json()


def hold_every_core(http, tid: str) -> None:
    cores = len(os.sched_getaffinity(0))
    http.post("/v1/trajectories", json={"id": tid})
    submit(http, tid, f"{tid}-run", kind="test_run", cpu=str(cores), command=f"sleep {HOLD_S}")
    assert running(http, f"{tid}-run")["status"] == "running"


def test_a_first_ls_starts_at_once_while_a_test_run_holds_every_core(http):
    """Placed by memory, never waiting for a core: the ``ls`` of a trajectory opened
    while every core is held starts on the lane in the pass of its submit."""
    hold_every_core(http, "holder1")
    http.post("/v1/trajectories", json={"id": "fresh1"})
    submit(http, "fresh1", "fresh1-ls", command="ls -la", t1_s=0.01)
    res = result(http, "fresh1-ls")
    assert res["status"] == "ok" and res["lane"], res
    assert res["queue_s"] == 0.0, res  # started by the submit's own pass
    assert result(http, "holder1-run")["status"] == "ok"


def test_a_full_lane_delays_ls_by_at_most_its_bound(http):
    """Every core held and every place on the lane taken by a command declared light that
    runs long: those leave the lane ``lane_hold_s`` after they started, so the ``ls``
    waits about that long, not for them to end (HOLD_S). The next run of the long command
    is known long: it never takes the lane again."""
    hold_every_core(http, "holder2")
    hold_s = SharedCores().lane_hold_s
    slots = max(1, len(os.sched_getaffinity(0)) // SharedCores().lane_cores)
    for i in range(slots):
        http.post("/v1/trajectories", json={"id": f"liar{i}"})
        submit(http, f"liar{i}", f"liar{i}-a", command=f"sleep {HOLD_S}", t1_s=0.0)
    for i in range(slots):
        assert running(http, f"liar{i}-a")["status"] == "running"
    http.post("/v1/trajectories", json={"id": "fresh2"})
    submit(http, "fresh2", "fresh2-ls", command="ls", t1_s=0.01)
    res = result(http, "fresh2-ls")
    assert res["status"] == "ok" and res["lane"], res
    # at most the lane's bound after the liars started (the submit came after they did),
    # plus the event loop's delay in firing the server's timer: far below HOLD_S
    assert res["queue_s"] <= hold_s + HOLD_S / 4, res
    liar = result(http, "liar0-a")
    assert liar["status"] == "ok" and liar["lane"], liar
    submit(http, "liar0", "liar0-b", command=f"sleep {HOLD_S}", t1_s=0.0, timeout_s=0.5)
    assert not result(http, "liar0-b")["lane"]
