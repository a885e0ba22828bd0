"""Attack: commands inside docker sandboxes that try to stall their core, forge
results through the agent, escalate, exhaust memory or processes - against a
real `tangram serve --backend docker` and real containers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
import time

import httpx
import pytest
from conftest import TOKEN, sandbox_containers
from helpers import SWAPPER, until_true

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def http(docker_server):
    with httpx.Client(base_url=docker_server.url, headers=H, timeout=120) as c:
        yield c


def _open(http, tid: str, **body) -> None:
    r = http.post("/v1/trajectories", json={"id": tid, **body})
    assert r.status_code == 201, r.text


def _run(http, tid: str, aid: str, **body) -> dict:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text
    return http.get(f"/v1/actions/{aid}", params={"wait": 60}).json()


def _box(server, tid: str):
    owner = hashlib.sha1(str((server.state_dir / "work").resolve()).encode()).hexdigest()[:16]
    boxes = sandbox_containers(tid, owner)  # its own, or one taken from the warm pool
    assert len(boxes) == 1, boxes
    return boxes[0]


def _in_use(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('tangram_resource_in_use{resource="cpu"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_command_cannot_stop_its_agent(http):
    """H4: `kill -STOP $PPID` used to freeze the agent and hold the core 20 s."""
    _open(http, "stopper")
    # the command outlives the 60 s long-poll: "timeout" (not "running") is the proof
    # that the host stopped it at its timeout - no wall-clock bound (the CI is loaded)
    res = _run(http, "stopper", "st1", timeout_s=2,
               argv=["sh", "-c", "kill -STOP $PPID; kill -STOP 1; echo tried; sleep 3600"])
    assert res["status"] == "timeout"
    assert "tried" in res["output"]
    res = _run(http, "stopper", "st2", argv=["echo", "alive"])
    assert (res["status"], res["output"]) == ("ok", "alive\n")
    assert _in_use(http) == 0
    http.delete("/v1/trajectories/stopper")


FORGER = """
import os, socket
try:
    os.unlink('/tangram/agent.sock')
    s = socket.socket(socket.AF_UNIX); s.bind('/tangram/agent.sock'); s.listen(1)
    print('hijacked')
except OSError as e:
    print('refused', e)
"""


def test_a_command_cannot_replace_the_agent_socket(http):
    """H4: a fake agent used to report `false` as `ok, exit 0, 100 passed`."""
    _open(http, "forger")
    res = _run(http, "forger", "fg1", argv=["python3", "-c", FORGER])
    assert "refused" in res["output"] and "hijacked" not in res["output"], res
    res = _run(http, "forger", "fg2", argv=["ls", "/tangram"])
    assert res["exit_code"] != 0 and "ermission denied" in res["output"]
    res = _run(http, "forger", "fg3", argv=["false"])
    assert (res["status"], res["exit_code"]) == ("ok", 1)
    http.delete("/v1/trajectories/forger")


def test_commands_are_unprivileged_and_limited(http):
    _open(http, "locked")
    res = _run(http, "locked", "lk1", argv=["sh", "-c", (
        "id -u; grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status; "
        "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null; "
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null; "
        "touch /work/mine && echo work-writable; touch /etc/x 2>&1 | tail -1")])
    out = res["output"]
    assert out.splitlines()[0] == "65534"
    assert "CapEff:\t0000000000000000" in out and "CapPrm:\t0000000000000000" in out
    assert "NoNewPrivs:\t1" in out
    assert "\n512\n" in out  # the default process limit
    assert str(2 * 1024 ** 3) in out  # the default memory limit: 2 GiB
    assert "work-writable" in out
    http.delete("/v1/trajectories/locked")


def test_out_of_memory_is_reported_as_oom(http):
    _open(http, "hog", mem_gb=0.0625)
    res = _run(http, "hog", "hog1",
               argv=["python3", "-c", "x = bytearray(400 * 1024 * 1024); print('survived')"])
    assert res["status"] == "oom" and "out of memory" in res["error"], res
    assert "survived" not in res["output"]
    res = _run(http, "hog", "hog2", argv=["echo", "after"])
    assert res["status"] == "ok" and res["output"] == "after\n"
    http.delete("/v1/trajectories/hog")


def test_a_container_killed_while_idle_is_recreated(http, docker_server):
    _open(http, "idle-death")
    _run(http, "idle-death", "id1", argv=["sh", "-c", "echo v > f"])
    _box(docker_server, "idle-death").kill()
    time.sleep(0.5)
    res = _run(http, "idle-death", "id2", argv=["sh", "-c", "cat f 2>/dev/null || echo gone"])
    assert res["status"] == "ok" and res["state_lost"] and res["output"] == "gone\n", res
    res = _run(http, "idle-death", "id3", argv=["echo", "x"])
    assert res["status"] == "ok" and not res["state_lost"]
    http.delete("/v1/trajectories/idle-death")


def test_the_host_enforces_the_timeout_when_the_agent_is_frozen(http, docker_server):
    """Whatever happens inside, the host stops waiting at timeout + grace."""
    _open(http, "frozen")
    _run(http, "frozen", "fz0", argv=["true"])
    r = http.post("/v1/trajectories/frozen/actions",
                  json={"id": "fz1", "argv": ["sleep", "3600"], "timeout_s": 1})
    assert r.status_code == 202
    time.sleep(0.3)
    _box(docker_server, "frozen").pause()  # the whole container: agent included
    # answered within the 60 s long-poll while the command would run an hour: the host
    # stopped waiting (no wall-clock bound: the CI is loaded)
    res = http.get("/v1/actions/fz1", params={"wait": 60}).json()
    assert res["status"] == "timeout" and "did not answer" in res["error"], res
    assert _in_use(http) == 0
    res = _run(http, "frozen", "fz2", argv=["echo", "back"])
    assert res["status"] == "ok" and res["state_lost"]
    http.delete("/v1/trajectories/frozen")


def test_the_file_api_follows_no_link_the_sandbox_made(http):
    """Issue 21 #5: after ``ln -s /etc etcdir`` the file API read the container's
    /etc/passwd and wrote /etc/evil; after ``ln -s /tangram t`` a PUT replaced the
    agent's socket. Now every component is opened inside the container without
    following a link: all refused, and the sandbox keeps working."""
    _open(http, "links")
    res = _run(http, "links", "l1", shell=True, command=(
        "ln -s /etc etcdir && ln -s /tangram t && mkdir tests && ln -s /etc/passwd pw"))
    assert res["status"] == "ok" and res["exit_code"] == 0, res
    for path in ("etcdir/passwd", "pw", "t/agent.sock"):
        r = http.get(f"/v1/trajectories/links/files/{path}")
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
    for path in ("etcdir/evil", "t/agent.sock", "t/x"):
        r = http.put(f"/v1/trajectories/links/files/{path}", content=b"evil")
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
    # a trainer's upload after the model swapped tests/ for a link goes nowhere
    _run(http, "links", "l2", shell=True, command="rmdir tests && ln -s /etc tests")
    r = http.put("/v1/trajectories/links/files/tests/test_hidden.py", content=b"assert 0")
    assert r.status_code == 400, r.text
    res = _run(http, "links", "l3", shell=True,
               command="ls /etc/evil /etc/test_hidden.py 2>&1; echo alive")
    assert res["status"] == "ok" and not res["state_lost"], res
    assert "No such file" in res["output"] and res["output"].count("No such file") == 2
    # files of its own still go in and out, owned by the sandbox user
    assert http.put("/v1/trajectories/links/files/d/own.txt", content=b"mine").status_code == 200
    assert http.get("/v1/trajectories/links/files/d/own.txt").content == b"mine"
    res = _run(http, "links", "l4", shell=True, command="stat -c %u d/own.txt && echo more >> d/own.txt")
    assert res["output"].split()[0] == "65534" and res["exit_code"] == 0, res
    http.delete("/v1/trajectories/links")


def test_a_sandbox_cannot_fill_the_hosts_disk(http, docker_server):
    """Issue 21 #9: 1.5 GB written to /work landed on the host's disk. Now /work is
    bounded (storage-opt where the engine supports it, else a tmpfs below the memory
    limit): the write stops at the limit, the action says ``disk_full``, nothing
    reached the container's writable layer, and the sandbox keeps working."""
    _open(http, "filler", mem_gb=1.0)
    res = _run(http, "filler", "fill1", shell=True,
               command="head -c 1536M /dev/zero > big; echo rc=$?; ls -l big")
    assert res["status"] == "failed" and res["error"].startswith("disk_full:"), res
    assert "rc=1" in res["output"] and "No space left" in res["output"], res
    layer = int(subprocess.run(["docker", "inspect", "--size", "-f", "{{.SizeRw}}",
                                _box(docker_server, "filler").id], capture_output=True,
                               text=True, check=True).stdout.strip() or 0)
    assert layer < 64 << 20, layer  # before: 1.5 GB in the writable layer
    res = _run(http, "filler", "fill2", shell=True, command="rm big && echo ok > f && cat f")
    assert res["status"] == "ok" and res["output"].strip() == "ok", res
    http.delete("/v1/trajectories/filler")


def test_the_disk_limit_is_an_option(tmp_path):
    """`serve --sandbox-disk-gb` bounds /work (here 50 MB, well below half the sandbox's
    memory, so the option is what stops the write)."""
    from conftest import start_server

    server = start_server(tmp_path / "state", "docker", extra_args=("--sandbox-disk-gb", "0.05"))
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            _open(c, "small", mem_gb=1.0)
            res = _run(c, "small", "s1", shell=True, command="head -c 100M /dev/zero > big")
            assert res["status"] == "failed" and res["error"].startswith("disk_full:"), res
            res = _run(c, "small", "s2", shell=True, command="rm big; head -c 20M /dev/zero > b")
            assert res["status"] == "ok", res
    finally:
        server.stop()


#: forks raced on docker, 2 copies each: 40 copies (issue 45 asked 50; each copy is a
#: container, and 25 forks took ~70 s here on 2 shared cores, 20 keep it near 60 s)
RACED_FORKS = 20
SECRET = "host-file-seen-by-a-copy"
#: run in a copy: does it hold the host's file, /work's mode and owner, torn pairs
CHECK = r"""
import json, os, stat
secret = 0
for parent, dirs, files in os.walk("/work"):
    for n in files:
        try:
            with open(os.path.join(parent, n), "rb") as f:
                secret += SECRET.encode() in f.read()
        except OSError:
            pass
torn = []
for i in range(16):
    a, link = "a%d" % i, "l%d" % i
    dirs = [p for p in (a, link) if not os.path.islink(p) and os.path.isfile(p + "/mine")]
    links = [p for p in (a, link) if os.path.islink(p) and os.readlink(p) == TARGET]
    if len(dirs) != 1 or len(links) != 1:
        torn.append(a)
st = os.stat("/work")
print(json.dumps({"secret": secret, "mode": oct(stat.S_IMODE(st.st_mode)), "uid": st.st_uid,
                  "torn": torn}))
"""


def test_a_fork_raced_by_its_source_reaches_no_host_file(http, tmp_path):
    """Issue 45 #3, #7 on docker: a process of the source swaps its directories ``a<i>``
    with ``l<i>``, absolute links to a host directory, while it is forked 20 times (2
    copies each). Before: the host (root) copied through /proc/<pid>/root/work and
    resolved a swapped-in link on the host: host files landed in the copy, and the copy's
    /work took the source's mode (here 0751). Now the source's agent stops its processes
    and packs /work as the sandbox user inside its container, each copy's agent unpacks
    it as its own: no host file, /work a fresh sandbox's, every pair a snapshot."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "secret").write_text(SECRET + "\n")
    _open(http, "drace-fresh")  # what a copy's /work must look like: a fresh sandbox's
    res = _run(http, "drace-fresh", "drace-fresh-1", argv=["stat", "-c", "0o%a %u", "/work"])
    fresh = tuple(res["output"].split())
    http.delete("/v1/trajectories/drace-fresh")
    _open(http, "drace-src")
    r = http.put("/v1/trajectories/drace-src/files/swap.py", content=SWAPPER.encode())
    assert r.status_code == 200, r.text
    res = _run(http, "drace-src", "drace-start", shell=True, command=(
        f"chmod 751 /work && setsid python3 swap.py {victim} >/dev/null 2>&1 </dev/null & "
        "echo started"))
    assert res["status"] == "ok" and "started" in res["output"], res

    def count() -> int:
        r = http.get("/v1/trajectories/drace-src/files/count")
        return int(r.content) if r.status_code == 200 and r.content.isdigit() else 0

    until_true(count, 120, "the swapper's first rounds")
    check = CHECK.replace("SECRET.encode()", repr(SECRET.encode())).replace(
        "TARGET", repr(str(victim)))
    found: dict[str, list] = {"secret": [], "mode": [], "torn": [], "failed": []}
    # a file read of the source lifts its container's CPU quota from the idle 1% to a core
    # while it runs: reads kept going, the swapper races at full speed during the forks
    reading = threading.Event()

    def read_on() -> None:
        with httpx.Client(base_url=http.base_url, headers=H, timeout=120) as c:
            while not reading.is_set():
                c.get("/v1/trajectories/drace-src/files/a0/mine")

    reader = threading.Thread(target=read_on, daemon=True)
    reader.start()
    for i in range(RACED_FORKS):
        r = http.post("/v1/trajectories", json={"fork_of": "drace-src", "count": 2,
                                                "id": f"drace-{i}"})
        if r.status_code != 201:
            found["failed"].append(r.text)
            continue
        for copy in r.json()["ids"]:
            res = _run(http, copy, f"{copy}-check", argv=["python3", "-c", check])
            assert res["status"] == "ok" and res["exit_code"] == 0, res
            seen = json.loads(res["output"])
            if seen["secret"]:
                found["secret"].append(copy)
            if (seen["mode"], str(seen["uid"])) != fresh:
                found["mode"].append((copy, seen["mode"], seen["uid"]))
            if seen["torn"]:
                found["torn"].append((copy, seen["torn"]))
            assert http.delete(f"/v1/trajectories/{copy}").status_code == 200
    reading.set()
    reader.join()
    after_forks = count()
    until_true(lambda: count() > after_forks, 120, "the swapper running again after the forks")
    assert not any(found.values()), {k: (len(v), v[:3]) for k, v in found.items()}
    http.delete("/v1/trajectories/drace-src")
