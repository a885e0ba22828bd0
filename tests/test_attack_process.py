"""Attack: commands on the process backend that try to read the server's secrets,
outlive their action or trajectory, or flood the server's memory."""

from __future__ import annotations

import os
import stat
import sys
import time

import httpx
import pytest
from conftest import TOKEN
from helpers import SWAPPER, procs_gone, procs_with, until_true

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


#: forks raced per backend; 50 as issue 45 asked (~20-30 s here on 2 loaded cores)
RACED_FORKS = 50
SECRET = "root-only-host-secret"


def _victim(tmp_path) -> tuple:
    """A host directory only root may enter: a 0600 secret and 200 root-owned files."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "secret").write_text(SECRET + "\n")
    (victim / "secret").chmod(0o600)
    for i in range(200):
        (victim / f"f{i}").write_text("host\n")
    return victim, _state(victim)


def _state(d) -> dict:
    return {e.name: (e.stat(follow_symlinks=False).st_uid, e.stat(follow_symlinks=False).st_mode)
            for e in os.scandir(d)}


def _tree(top) -> dict:
    """Relative path -> (lstat, start of a regular file's content), walked by descriptors
    without following a link (as root, on the host: a link swapped in meanwhile must not
    lead this walk out either); entries gone meanwhile are left out."""
    out = {}
    for parent, dirs, files, fd in os.fwalk(top, follow_symlinks=False):
        rel = os.path.relpath(parent, top)
        for name in dirs + files:
            key = name if rel == "." else f"{rel}/{name}"
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                data = b""
                if name in files and stat.S_ISREG(st.st_mode):
                    f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                    try:
                        data = os.read(f, 1 << 16)
                    finally:
                        os.close(f)
            except OSError:
                continue
            out[key] = (st, data)
    return out


def torn_pairs(tree: dict) -> list[str]:
    """The swapper's pairs a copy does not hold as one directory (with its file) and one
    link: what a copy made while the pair was being swapped looks like."""
    torn = []
    for i in range(16):
        kinds = sorted("dir" if stat.S_ISDIR(tree[n][0].st_mode) else
                       "link" if stat.S_ISLNK(tree[n][0].st_mode) else "?"
                       for n in (f"a{i}", f"l{i}") if n in tree)
        if kinds != ["dir", "link"] or not ({f"a{i}/mine", f"l{i}/mine"} & set(tree)):
            torn.append(f"a{i}")
    return torn


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes have users of their own only as root")
def test_a_fork_raced_by_its_source_reaches_no_host_file(http, process_server, tmp_path):
    """Issue 45 #1, #2, #7: the source's background process swaps its directories ``a<i>``
    with ``l<i>`` (links to a root-only host directory) in a tight loop, and does the same
    in the copies it can reach, while the source is forked 50 times. Before: the copy
    ran as root (``cp -a``) and read the host's 0600 secret, the chown after it followed
    a link swapped into the copy (host files became the copy's), the copy kept the
    source's 0777 and the source wrote into it. Now every copy is a frozen snapshot
    made as the source's user, given to the copy's user out of every sandbox's reach,
    0700: no secret, no host file re-owned, no write from the source, a and l
    consistent."""
    victim, before = _victim(tmp_path)
    work = process_server.state_dir / "work"
    copies = [f"race-{i}-0" for i in range(RACED_FORKS)]
    assert http.post("/v1/trajectories", json={"id": "race-src"}).status_code == 201
    r = http.put("/v1/trajectories/race-src/files/swap.py", content=SWAPPER.encode())
    assert r.status_code == 200, r.text
    res = _run(http, "race-src", "race-start", shell=True, command=(
        f"chmod 777 . && setsid {sys.executable} swap.py {victim} "
        + " ".join(f"../{c}" for c in copies) + " >/dev/null 2>&1 </dev/null & echo started"))
    assert res["status"] == "ok" and "started" in res["output"], res

    def count() -> int:
        try:
            return int((work / "race-src" / "count").read_text())
        except (OSError, ValueError):
            return 0

    until_true(count, 120, "the swapper's first rounds")
    src_uid = (work / "race-src").stat().st_uid
    leaked, owners, modes, written, torn, failed = [], [], [], [], [], []
    for i, copy in enumerate(copies):
        r = http.post("/v1/trajectories", json={"fork_of": "race-src", "count": 1,
                                                "id": f"race-{i}"})
        if r.status_code != 201:  # (a copy torn by the race: cp failed)
            failed.append(r.text)
            continue
        assert r.json()["ids"] == [copy], r.text
        top = work / copy
        top_st = top.lstat()
        tree = _tree(top)
        uids = {st.st_uid for st, _ in tree.values()} | {top_st.st_uid}
        if any(SECRET.encode() in data for _, data in tree.values()):
            leaked.append(copy)
        if uids != {top_st.st_uid} or top_st.st_uid == src_uid:
            owners.append((copy, uids))
        if stat.S_IMODE(top_st.st_mode) != 0o700:
            modes.append((copy, oct(top_st.st_mode)))
        if "from-the-source" in tree:
            written.append(copy)
        if torn_pairs(tree):
            torn.append((copy, torn_pairs(tree)))
        assert http.delete(f"/v1/trajectories/{copy}").status_code == 200
    after_forks = count()
    until_true(lambda: count() > after_forks, 120, "the swapper running again after the forks")
    reowned = sorted(n for n, v in _state(victim).items() if before.get(n) != v)
    found = {"copies holding the host's secret": len(leaked),
             "host files re-owned or added": len(reowned),
             "copies of mixed owners or the source's": len(owners),
             "copies not 0700": len(modes), "copies the source wrote into": len(written),
             "copies not a snapshot": len(torn), "forks failed": len(failed)}
    assert not any(found.values()), (found, leaked[:3], reowned[:3], owners[:3], modes[:3],
                                     torn[:3], failed[:3])
    assert not [p for p in work.iterdir() if p.name.startswith(" forking ")]
    assert http.delete("/v1/trajectories/race-src").status_code == 200
