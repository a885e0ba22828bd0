"""Attack (issue 34 #2, #3): what a closed trajectory wrote outside its work directory.

As root, a trajectory's commands run under a user id of its own, handed to another
trajectory once it closed. Trajectory A wrote in ``/tmp``, ``/var/tmp``, ``/dev/shm``
and ``/run/lock``, made a System V shared memory segment and left a process; the next
trajectory under the same id read and appended to all of it, and A's 100 MB in
``/dev/shm`` stayed in memory charged to no one. Now everything the id owns there is
removed, and its processes killed, before the id is handed out again. (Since issue 47
#6 ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are each trajectory's own, kept beside its work
directory: A's files there are checked where they are, and removed with them.)

The server hands out :data:`UIDS` ids (``--sandbox-uids``; the default is a block of 4,096,
whose reuse took ~4,096 opens and closes): the same rotation, reached in a few dozen."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import httpx
import pytest
from conftest import TOKEN, start_server
from helpers import until_true

H = {"Authorization": f"Bearer {TOKEN}"}
PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
UIDS = 16

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="commands run under ids of their own only as root")


def _run(c: httpx.Client, tid: str, command: str) -> dict:
    aid = f"{tid}-{secrets.token_hex(4)}"
    r = c.post(f"/v1/trajectories/{tid}/actions", params={"wait": 60},
               json={"id": aid, "shell": True, "command": command, "timeout_s": 60})
    assert r.status_code in (200, 202), r.text
    res = c.get(f"/v1/actions/{aid}", params={"wait": 60}).json()
    assert res["status"] == "ok", res
    return res


def _uid(c: httpx.Client, tid: str) -> int:
    return int(_run(c, tid, "id -u")["output"].split()[0])


def _on_host(state: Path, tid: str, name: str) -> Path:
    """Where a command's ``name`` is on the host: the private places of its trajectory
    (executor/backends/process/scratch.py), else the same path."""
    from executor.backends.process.scratch import AREA
    from executor.backends.process.scratch import PLACES as PRIVATE

    for sub, place in PRIVATE:
        if name.startswith(place + "/"):
            return state / "work" / AREA / tid / sub / name[len(place) + 1:]
    return Path(name)


def _opened(c: httpx.Client, tid: str) -> bool:
    """Open ``tid``: True once opened, False while every id is being cleaned up (503)."""
    r = c.post("/v1/trajectories", json={"id": tid})
    assert r.status_code in (201, 503), r.text
    assert r.status_code == 201 or "sandbox user ids" in r.text, r.text
    return r.status_code == 201


def test_nothing_of_a_closed_trajectory_reaches_the_next_one_on_its_id(tmp_path):
    server = start_server(tmp_path / "state", extra_args=("--sandbox-uids", str(UIDS)))
    tag = secrets.token_hex(6)
    names = [f"{p}/a-{tag}" for p in PLACES]
    state = tmp_path / "state"
    opened: list[str] = []
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            c.post("/v1/trajectories", json={"id": "a"})
            writes = "; ".join(f"echo secret > {n}; mkdir {n}.d; echo s > {n}.d/f"
                               for n in names)
            res = _run(c, "a", f"{writes}; dd if=/dev/zero of=/dev/shm/a-{tag}.big bs=1M "
                       "count=20 status=none; ipcmk -M 4096 >/dev/null; ipcs -m; "
                       "sleep 600 >/dev/null 2>&1 & echo done")
            assert "done" in res["output"], res
            uid = _uid(c, "a")
            assert all(_on_host(state, "a", n).exists() for n in names)
            assert _segments(uid) and _procs(uid)
            assert c.delete("/v1/trajectories/a").status_code == 200

            # the id comes back once A is cleaned up and every other id the server hands
            # out was (oldest freed first, issue 45 #6): open trajectories until one has
            # it (its work directory is its id's from its open), closing the others
            deadline = time.time() + 600  # (~UIDS opens and closes: a hang guard)
            work = tmp_path / "state" / "work"
            tries = 0
            while True:
                tid = f"c{tries}"
                tries += 1
                # (503 while every free id is still being cleaned up: the reaper runs off
                # the loop, and on a loaded machine it can trail this loop's opens)
                until_true(lambda tid=tid: _opened(c, tid), 120, f"{tid} opened")
                opened.append(tid)
                if os.stat(work / tid).st_uid == uid:
                    break
                assert c.delete(f"/v1/trajectories/{tid}").status_code == 200
                opened.pop()
                assert time.time() < deadline, "A's id was never handed out again"
            # every other id went first (A opened first: UIDS - 1 were ahead of it in the queue)
            assert tries >= UIDS, f"A's id came back after {tries - 1} other opens"
            # (C's `id -u` may still be exiting: a process of the id that stays is A's)
            deadline = time.time() + 30
            while _procs(uid) and time.time() < deadline:
                time.sleep(0.1)
            assert not _procs(uid), "A's process lives on under C's id"
            res = _run(c, tid, " ; ".join(
                f"cat {n} {n}.d/f 2>/dev/null; echo more >> {n} 2>/dev/null && echo appended"
                for n in names) + f"; ls /dev/shm | grep -c a-{tag}; ipcs -m | grep -c {uid}")
            out = res["output"]
            assert "secret" not in out and "\ns\n" not in f"\n{out}", out
            # what it appended it created: its own, new, empty otherwise
            for n in names:
                assert _on_host(state, tid, n).read_text() == "more\n"
            assert not any(_on_host(state, a, f"{n}.d").exists() for n in names
                           for a in ("a", tid))
            assert not _on_host(state, "a", f"/dev/shm/a-{tag}.big").exists()
            assert not _segments(uid), "A's shared memory segment is still there"
    finally:
        with httpx.Client(base_url=server.url, headers=H, timeout=60) as c:
            for tid in opened:
                c.delete(f"/v1/trajectories/{tid}")
        server.stop()
        for n in names:  # whatever a failed run left
            for p in (Path(n), Path(f"{n}.d"), Path(f"/dev/shm/a-{tag}.big")):
                if p.is_dir():
                    import shutil

                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)


def _segments(uid: int) -> list[str]:
    with open("/proc/sysvipc/shm") as f:
        header = f.readline().split()
        col = header.index("uid")
        return [line for line in f if int(line.split()[col]) == uid]


def _procs(uid: int) -> list[int]:
    """The live (not zombie) processes of ``uid``."""
    from executor.backends.process.uids import pids_of_uids

    out = []
    for pid in pids_of_uids(uid, uid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out
