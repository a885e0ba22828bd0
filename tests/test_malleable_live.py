"""Issue 49, live: a real pytest-xdist run started on 1 core of 2 (the other held by another
trajectory's command) grows onto the second core when it frees (the core sends Resized, the
process backend re-pins its workers), so its execution time falls between the two fixed
widths' — measured in the same test, on the same `tangram serve --backend process`, and
asserted as an order, never as a time.

The suite burns a fixed amount of CPU work per test (a loop, not a sleep): how long it
takes depends only on the cores its workers run on. Two workers on one core take about as
long as one worker; on two cores about half."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}
#: tests in the suite, and loop turns of CPU work each (~0.5-1 s of a core here)
TESTS = 12
WORK = 8_000_000
#: tests of the malleable run that end before the other trajectory gives its core back
FIRST = 2
#: how long the other trajectory declares it holds its core (s)
HOLD_S = 3.0

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="needs two cores to grow from one onto two")


def suite(path: Path) -> Path:
    """The suite: each test does WORK loop turns and writes the cores its process may run
    on (its affinity, as the backend pinned it) to ``path``/log, one line per test."""
    tests = path / "suite"
    tests.mkdir()
    log = path / "log"
    log.touch(mode=0o666)  # (the sandboxes' users append to it; they may not create in it)
    log.chmod(0o666)
    body = "\n\n".join(
        f"def test_work_{i}():\n    total = 0\n    for k in range({WORK}):\n        total += k * k\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        f"        f.write(os.environ.get('RUN', '') + ' ' + "
        f"','.join(map(str, sorted(os.sched_getaffinity(0)))) + '\\n')"
        for i in range(TESTS))
    (tests / "test_work.py").write_text("import os\n\n\n" + body + "\n")
    # its own root: pytest would otherwise take the checkout's configuration and walk it
    (tests / "pytest.ini").write_text("[pytest]\n")
    tests.chmod(0o755)
    return tests


def affinities(path: Path, run: str) -> list[int]:
    """How many cores each test of ``run`` could run on, in the order they ended."""
    return [len(line.split()[1].split(",")) for line in (path / "log").read_text().splitlines()
            if line.split()[0] == run]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    # two cores of this machine (the server inherits this process's affinity while it
    # starts): the run's two fixed widths and the malleable one
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(own)[:2])
    try:
        server = start_server(tmp_path_factory.mktemp("serve-malleable"), "process")
    finally:
        os.sched_setaffinity(0, own)
    with httpx.Client(base_url=server.url, headers=H, timeout=300) as c:
        yield c
    server.stop()


def run(http, tid: str, aid: str, **body) -> None:
    http.post("/v1/trajectories", json={"id": tid})
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text


def result(http, aid: str) -> dict:
    return http.get(f"/v1/actions/{aid}", params={"wait": 300}).json()


def running(http, aid: str) -> dict:
    """The action once it left the queue (a condition with a generous deadline)."""
    deadline = time.time() + 120
    while True:
        res = http.get(f"/v1/actions/{aid}").json()
        if res["status"] != "queued" or time.time() > deadline:
            return res
        time.sleep(0.05)


def resized(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('tangram_effects_total{effect="Resized"}'):
            return float(line.split()[-1])
    raise AssertionError("/metrics has no count of Resized effects")


def test_a_run_started_on_one_core_speeds_up_when_the_other_frees(http, shared_dir):
    tests = suite(shared_dir)
    pytest_cmd = f"{sys.executable} -m pytest -q -p no:cacheprovider {tests}"

    def fixed(n: int, k: int) -> dict:
        tid = f"fixed{n}-{k}"
        run(http, tid, f"{tid}-run", kind="test_run", cpu=str(n), env={"RUN": tid},
            command=f"{pytest_cmd} -n {n}")
        got = result(http, f"{tid}-run")
        assert got["status"] == "ok", got
        assert len(affinities(shared_dir, tid)) == TESTS, got["output"]
        return got

    def malleable(k: int, t1_s: float) -> dict:
        # another trajectory holds a core, so the run starts on the other; it declares its
        # profile (elastic, 1 or 2 cores), so it starts two workers and grows
        # the holder gives its core back once the run's first tests ended on the other
        # (a condition the command waits for, not a time)
        tid = f"grow-{k}"
        log = shared_dir / "log"
        run(http, f"holder-{k}", f"holder-{k}-cmd", kind="setup", cpu="1", t1_s=HOLD_S,
            shell=True, timeout_s=600,
            command=f"until [ $(grep -c '^{tid} ' {log}) -ge {FIRST} ]; do sleep 0.1; done")
        assert running(http, f"holder-{k}-cmd")["status"] == "running"
        run(http, tid, f"{tid}-run", kind="test_run", cpu="1-2", elastic=True, t1_s=t1_s,
            parallel_fraction=0.95, env={"RUN": tid}, command=pytest_cmd)
        got = result(http, f"{tid}-run")
        assert got["status"] == "ok", got
        assert got["units"] == 1, got  # it started on the one core free
        seen = affinities(shared_dir, tid)
        # its workers were pinned to the one core, then re-pinned onto both
        assert seen[:FIRST] == [1] * FIRST and seen[-1] == 2, seen
        return got

    before = resized(http)
    # each width twice, in mirrored order, so that a load that drifts during the test
    # weighs on each alike; the sums are compared
    one = [fixed(1, 0)]
    two = [fixed(2, 0)]
    grown = [malleable(0, one[0]["exec_s"]), malleable(1, one[0]["exec_s"])]
    two.append(fixed(2, 1))
    one.append(fixed(1, 1))
    assert resized(http) >= before + 2, "the runs' grants were not resized"
    took = {name: sum(r["exec_s"] for r in runs)
            for name, runs in (("one", one), ("two", two), ("grown", grown))}
    # the order, not a time: faster than one core throughout, slower than two throughout
    assert took["two"] < took["grown"] < took["one"], took
