"""Attack: commands on the process backend that try to read the server's secrets,
outlive their action or trajectory, or flood the server's memory."""

from __future__ import annotations

import os
import sys
import time

import httpx
import pytest
from conftest import TOKEN
from helpers import procs_gone, procs_with

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def http(process_server):
    with httpx.Client(base_url=process_server.url, headers=H, timeout=120) as c:
        yield c


def _run(http, tid: str, aid: str, **body) -> dict:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text
    return http.get(f"/v1/actions/{aid}", params={"wait": 60}).json()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_commands_do_not_see_the_servers_token(http):
    http.post("/v1/trajectories", json={"id": "env-spy"})
    res = _run(http, "env-spy", "spy1", argv=["env"])
    assert res["status"] == "ok"
    assert TOKEN not in res["output"] and "TANGRAM_TOKEN" not in res["output"]
    assert "TANGRAM_CORES=" in res["output"]  # what the command is meant to see
    # nor can a client smuggle the variable name back in
    res = _run(http, "env-spy", "spy2", argv=["env"], env={"TANGRAM_TOKEN": "x"})
    assert "TANGRAM_TOKEN" not in res["output"]
    http.delete("/v1/trajectories/env-spy")


def test_setsid_children_die_with_the_timeout(http):
    http.post("/v1/trajectories", json={"id": "escaper"})
    res = _run(http, "escaper", "esc1", timeout_s=1,
               argv=["sh", "-c", "setsid sleep 314.15 > /dev/null 2>&1 & sleep 60"])
    assert res["status"] == "timeout"
    assert procs_gone("314.15") == []
    http.delete("/v1/trajectories/escaper")


def test_background_processes_die_with_the_trajectory(http):
    http.post("/v1/trajectories", json={"id": "lingerer"})
    res = _run(http, "lingerer", "ling1",
               argv=["sh", "-c", "setsid sleep 271.8 > /dev/null 2>&1 < /dev/null &"])
    assert res["status"] == "ok"
    time.sleep(0.3)
    assert len(procs_with("271.8")) == 1  # a background helper may live while it is open
    assert http.delete("/v1/trajectories/lingerer").status_code == 200
    assert procs_gone("271.8") == []


def test_huge_output_is_bounded(http, process_server):
    http.post("/v1/trajectories", json={"id": "flood"})
    before = _rss_mb(process_server.proc.pid)
    res = _run(http, "flood", "flood1", argv=["head", "-c", "300M", "/dev/zero"])
    after = _rss_mb(process_server.proc.pid)
    assert res["status"] == "ok" and len(res["output"]) == 1 << 20  # the last 1 MiB
    assert after - before < 60, (before, after)  # was +480 MB: read whole, then cut
    http.delete("/v1/trajectories/flood")


def test_a_background_child_does_not_hold_the_action(http):
    """Issue 21 #1: ``sleep & echo`` kept the action (and its cores) until the child
    ended - asyncio's wait() returns only when the pipe closes. Now the action ends when
    the command exits and the child still holding the pipe is killed."""
    http.post("/v1/trajectories", json={"id": "bg-child"})
    r = http.post("/v1/trajectories/bg-child/actions", json={
        "id": "bg1", "command": "sleep 3141.5 & echo started", "shell": True})
    assert r.status_code == 202, r.text
    # a stuck action is still "running" when the 60 s long-poll returns
    res = http.get("/v1/actions/bg1", params={"wait": 60}).json()
    assert res["status"] == "ok", res
    assert res["output"].strip() == "started"
    assert procs_gone("3141.5") == []
    http.delete("/v1/trajectories/bg-child")


def test_a_child_that_clears_its_environment_is_detached(http):
    """A child that escapes the mark (``env -i``) and the group (``setsid``) still
    does not hold the action: its pipe is dropped; the trajectory's close kills it
    (as root: by its user id, which it cannot drop)."""
    http.post("/v1/trajectories", json={"id": "bg-env"})
    r = http.post("/v1/trajectories/bg-env/actions", json={
        "id": "bge1", "command": "env -i setsid sleep 2718.2 & echo started", "shell": True})
    assert r.status_code == 202, r.text
    res = http.get("/v1/actions/bge1", params={"wait": 60}).json()
    assert res["status"] == "ok", res
    http.delete("/v1/trajectories/bg-env")
    if os.geteuid() == 0:
        assert procs_gone("2718.2") == []
    else:  # not ours to find: clean up after the test
        for pid in procs_with("2718.2"):
            os.kill(pid, 9)


@pytest.mark.skipif(os.geteuid() != 0, reason="commands switch user only under a root server")
def test_commands_of_a_root_server_cannot_touch_it(http, process_server):
    """Issue 21 #4: as root, a command read the token from /proc/$PPID/environ and could
    kill the server. Now it runs under a user id of its own: both are refused by the
    kernel, not by a filter."""
    pid = process_server.proc.pid
    http.post("/v1/trajectories", json={"id": "root-spy"})
    res = _run(http, "root-spy", "rs1", shell=True, command=(
        f"id -u; cat /proc/{pid}/environ; echo cat=$?; kill -0 {pid}; echo kill=$?; "
        "cat ../../journal.sqlite > /dev/null; echo journal=$?; touch mine && echo wrote"))
    assert res["status"] == "ok", res
    out = res["output"]
    assert out.splitlines()[0] != "0"
    assert TOKEN not in out and "cat=1" in out and "kill=1" in out, out
    assert "journal=1" in out, out  # other trajectories' outputs
    assert "wrote" in out  # its own directory is its own
    # another trajectory's commands run as another user: its files are out of reach
    http.post("/v1/trajectories", json={"id": "root-spy2"})
    _run(http, "root-spy2", "rs2", shell=True, command="echo secret > s")
    res = _run(http, "root-spy", "rs3", shell=True, command="cat ../root-spy2/s; echo rc=$?")
    assert "secret" not in res["output"] and "rc=1" in res["output"], res
    assert process_server.proc.poll() is None
    http.delete("/v1/trajectories/root-spy")
    http.delete("/v1/trajectories/root-spy2")


def test_secret_looking_names_are_scrubbed():
    from executor.backends.process.backend import scrubbed_env

    env = scrubbed_env({"MY_PRIVATE_PASSPHRASE": "x", "DB_PASSWORD": "x", "AWS_ACCESS_KEY_ID": "x",
                        "GH_AUTH": "x", "OPENAI_API_KEY": "x", "PATH": "/bin", "LANG": "C",
                        "KEYBOARD": "us"})
    assert env == {"PATH": "/bin", "LANG": "C", "KEYBOARD": "us"}


def test_a_deep_tree_is_removed_when_its_trajectory_closes(http, process_server):
    """Issue 21 #8: ``shutil.rmtree`` recurses once per level; past ~1,000 it raised
    RecursionError (not caught by ignore_errors) and the "closing" directory stayed
    forever. A tree 5,000 directories deep is now removed."""
    http.post("/v1/trajectories", json={"id": "deep"})
    res = _run(http, "deep", "deep1", argv=[sys.executable, "-c", (
        "import os\nfor _ in range(5000):\n    os.mkdir('d')\n    os.chdir('d')\n"
        "open('leaf', 'w').write('x')\nprint('made')")])
    assert res["status"] == "ok" and "made" in res["output"], res
    work = process_server.state_dir / "work"
    assert http.delete("/v1/trajectories/deep").status_code == 200
    deadline = time.time() + 60
    while any(p.name.startswith(" closing") for p in work.iterdir()) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(p.name.startswith(" closing") for p in work.iterdir())
    assert not (work / "deep").exists()


def test_a_declared_light_action_that_runs_long_is_moved_off_the_lane(http):
    """Issue 21 #10: ``t1_s: 0`` put an action on the shared lane (nice 0, preempting
    exclusive-core work) for as long as it ran. Issue 30: a lane action still running
    ``lane_hold_s`` after it started is moved off the lane by the core: onto a core of its
    own at the exclusive actions' priority, or at nice 19 while none is free; and its
    command is known long from then on: the next run of it gets a core of its own."""
    from executor.backends.process.backend import DEMOTED_NICE
    from executor.commands import EXCLUSIVE_NICE
    from tangram.policies import SharedCores

    http.post("/v1/trajectories", json={"id": "liar"})
    wait = SharedCores().lane_hold_s * 3
    lanes = []
    for i in range(3):
        res = _run(http, "liar", f"liar{i}", kind="liar-kind", t1_s=0, shell=True,
                   command=f"nice; sleep {wait}; nice; grep Cpus_allowed_list /proc/self/status")
        assert res["status"] == "ok", res
        lanes.append(res["lane"])
        if res["lane"]:  # the server's own niceness at first (0, or what it was started at)
            before, after, cpus = res["output"].split("\n")[:3]
            before, after = int(before), int(after)
            assert after in (min(before + EXCLUSIVE_NICE, 19), DEMOTED_NICE), res
            assert before < after, res
            if after != DEMOTED_NICE:  # it holds a core of its own: pinned there
                assert cpus.split()[-1].isdigit(), res
    assert lanes == [True, False, False], lanes
    http.delete("/v1/trajectories/liar")
