"""Issue 49, live: a real pytest-xdist run started on 1 core of 2 (the other held by another
trajectory's command) grows onto the second core when it frees (the core sends Resized, the
process backend re-pins its workers), on a real `tangram serve --backend process`.

The suite burns a fixed amount of CPU work per test (a loop, not a sleep) and logs, per
test, the cores its worker was allowed: the re-pin is seen from inside the command.

Not asserted: that it ran faster. Its speed-up is a timing, and the sandbox's commands run
at nice 10 beneath whatever else the machine runs (the suite's other worker, here): at
load 11, two workers on one core got 0.26 of a core per test and on two cores 0.16, and
fixed-width runs of two cores were as slow as of one (0.49 vs 0.50 of a core on average).
The speed-up on real cores wants a quiet machine (issue 49's note says what was measured)."""

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
        f"def test_work_{i}():\n"
        f"    t0, c0 = time.time(), time.process_time()\n"
        f"    total = 0\n    for k in range({WORK}):\n        total += k * k\n"
        f"    line = [os.environ.get('RUN', ''), "
        f"','.join(map(str, sorted(os.sched_getaffinity(0)))), "
        f"repr(t0), repr(time.time()), repr(time.process_time() - c0)]\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        f"        f.write(' '.join(line) + '\\n')"
        for i in range(TESTS))
    (tests / "test_work.py").write_text("import os\nimport time\n\n\n" + body + "\n")
    # its own root: pytest would otherwise take the checkout's configuration and walk it
    (tests / "pytest.ini").write_text("[pytest]\n")
    tests.chmod(0o755)
    return tests


def lines(path: Path, run: str) -> list[list[str]]:
    return [line.split() for line in (path / "log").read_text().splitlines()
            if line.split()[0] == run]


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    # two cores of this machine (the server inherits this process's affinity while it
    # starts): the run's two fixed widths and the malleable one
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(own)[:2])
    try:
        server = start_server(tmp_path_factory.mktemp("serve-malleable"), "process",
                              extra_args=("--policy", "tangram-malleable"))
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
    before = resized(http)
    # another trajectory holds a core, so the run starts on the other; it declares its
    # profile (elastic, 1 or 2 cores), so it starts two workers; the holder gives its core
    # back once the run's first tests ended (a condition its command waits for, not a time)
    tid = "grow"
    log = shared_dir / "log"
    run(http, "holder", "holder-cmd", kind="setup", cpu="1", t1_s=HOLD_S, shell=True,
        timeout_s=600,
        command=f"until [ $(grep -c '^{tid} ' {log}) -ge {FIRST} ]; do sleep 0.1; done")
    assert running(http, "holder-cmd")["status"] == "running"
    run(http, tid, f"{tid}-run", kind="test_run", cpu="1-2", elastic=True, t1_s=30.0,
        parallel_fraction=0.95, env={"RUN": tid}, command=pytest_cmd)
    got = result(http, f"{tid}-run")
    assert got["status"] == "ok" and got["exit_code"] == 0, got
    assert got["units"] == 1, got  # it started on the one core free
    assert resized(http) > before, "the run's grant was never resized"
    rows = lines(shared_dir, tid)
    assert len(rows) == TESTS, got["output"]
    # its workers were pinned to the one core, then re-pinned onto both
    narrow = [r for r in rows if len(r[1].split(",")) == 1]
    wide = [r for r in rows if len(r[1].split(",")) == 2]
    assert rows[:FIRST] == narrow[:FIRST] and rows[-1] in wide, [r[1] for r in rows]
