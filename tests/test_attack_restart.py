"""Attack (issue 34 #4): open trajectories across a restart.

After a kill -9 and a restart on the same state directory, 839 next-action submits got
404: the server forgot every open trajectory, and each client had to notice and reopen.
Now the journal records opens and closes; a restarted server opens again what was left
open (the process backend keeps its work directory), so the next submit works, and a
finished action submitted again with the same id returns its journalled result without
running again (what lets a preempted trainer fast-forward a rollout)."""

from __future__ import annotations

import hashlib
import signal
import time

import httpx
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}


def _run(c: httpx.Client, tid: str, aid: str, command: str) -> httpx.Response:
    return c.post(f"/v1/trajectories/{tid}/actions", params={"wait": 60},
                  json={"id": aid, "shell": True, "command": command})


def test_open_trajectories_survive_a_kill_and_finished_actions_are_not_run_again(tmp_path):
    state = tmp_path / "state"
    server = start_server(state)
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            for tid in ("t1", "t2", "gone"):
                assert c.post("/v1/trajectories", json={"id": tid, "mem_gb": 0.5}
                              ).status_code == 201
            assert _run(c, "t1", "w1", "echo kept > f").json()["status"] == "ok"
            once = _run(c, "t1", "n1", "echo run >> log; wc -l < log").json()
            assert once["status"] == "ok" and once["output"] == "1\n", once
            assert c.delete("/v1/trajectories/gone").status_code == 200
        server.stop(signal.SIGKILL)

        server = start_server(state)
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            assert c.get("/healthz").json()["trajectories_restored"] == 2
            res = _run(c, "t1", "r1", "cat f; echo more >> f; id -u; stat -c %u f")
            assert res.status_code == 202, res.text
            out = res.json()
            assert out["status"] == "ok" and out["output"].startswith("kept\n"), out
            uid, owner = out["output"].split()[1:3]
            assert uid == owner  # its files are its own under the id it has now
            assert _run(c, "t2", "r2", "true").json()["status"] == "ok"
            # the same id and body: the journalled result, not a second run
            again = _run(c, "t1", "n1", "echo run >> log; wc -l < log")
            assert again.status_code in (200, 202) and again.json()["output"] == "1\n", again.text
            assert _run(c, "t1", "r3", "wc -l < log").json()["output"] == "1\n"
            # a closed trajectory stays closed
            assert _run(c, "gone", "g1", "true").status_code == 404
            assert c.delete("/v1/trajectories/t2").status_code == 200
        server.stop()  # a stop, not a crash: open trajectories are kept the same way

        server = start_server(state)
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            assert c.get("/healthz").json()["trajectories_restored"] == 1
            assert _run(c, "t1", "s1", "cat f").json()["output"] == "kept\nmore\n"
            assert _run(c, "t2", "s2", "true").status_code == 404
    finally:
        server.stop()


def test_docker_trajectories_get_their_containers_back_or_hear_they_are_gone(tmp_path):
    """Docker (issue 34 #4): a kill -9 leaves the sandboxes running; the restarted server
    adopts a restored trajectory's container (its files are there, state_lost false); one
    whose container died meanwhile gets a fresh one and its next action says state_lost;
    one that never ran an action starts clean without a false alarm. A stop removes the
    containers: after it, the next action says state_lost too (not a silent empty box)."""
    import docker

    client = docker.from_env()

    def boxes(tid: str) -> list:
        return client.containers.list(all=True, sparse=True, filters={"label": [
            f"tangram.owner={owner}", f"tangram.trajectory={tid}"]})

    state = tmp_path / "state"
    owner = hashlib.sha1(str((state / "work").resolve()).encode()).hexdigest()[:16]
    server = start_server(state, "docker")
    try:
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            for tid in ("alive", "dead", "idle"):
                assert c.post("/v1/trajectories", json={"id": tid, "mem_gb": 0.5}
                              ).status_code == 201
            for tid in ("alive", "dead"):
                assert _run(c, tid, f"{tid}-w", "echo kept > f").json()["status"] == "ok"
            # the warm pool, sized from that burst of 3 and made at its limit (0.5 GB),
            # fills; a trajectory opened now runs in a warm sandbox, whose label names no
            # trajectory
            deadline = time.monotonic() + 120
            while len(boxes("")) < 3:
                assert time.monotonic() < deadline, "the warm pool did not fill"
                time.sleep(0.2)
            assert c.post("/v1/trajectories", json={"id": "warm", "mem_gb": 0.5}  # the pool's
                          ).status_code == 201
            assert _run(c, "warm", "warm-w", "echo kept > f").json()["status"] == "ok"
            assert boxes("warm") == []  # it runs in a sandbox of the pool
        server.stop(signal.SIGKILL)
        assert len(boxes("alive")) == 1 and len(boxes("dead")) == 1
        adopted = boxes("alive")[0].id
        client.api.kill(boxes("dead")[0].id)

        server = start_server(state, "docker")
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            assert c.get("/healthz").json()["trajectories_restored"] == 4
            out = _run(c, "warm", "w2", "cat f").json()
            assert out["output"] == "kept\n" and not out["state_lost"], out
            out = _run(c, "alive", "a2", "cat f").json()
            assert out["status"] == "ok" and out["output"] == "kept\n", out
            assert not out["state_lost"] and [b.id for b in boxes("alive")] == [adopted]
            out = _run(c, "dead", "d2", "cat f").json()
            assert out["state_lost"] and out["exit_code"] != 0, out
            out = _run(c, "idle", "i2", "true").json()
            assert out["status"] == "ok" and not out["state_lost"], out
        server.stop()

        server = start_server(state, "docker")
        with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
            out = _run(c, "alive", "a3", "cat f").json()
            assert out["state_lost"] and out["exit_code"] != 0, out
            for tid in ("alive", "dead", "idle", "warm"):
                assert c.delete(f"/v1/trajectories/{tid}").status_code == 200
    finally:
        server.stop()
    for tid in ("alive", "dead", "idle", "warm", ""):  # nothing left behind
        assert boxes(tid) == [], tid
