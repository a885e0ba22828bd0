"""Cancel and timeout end the action's whole process tree, on both sandbox backends,
through a real ``tangram serve`` and the HTTP API (issue 45 #5, issue 47 #2).

Issue 45 #5: ``setsid sh -c 'while :; do :; done' >/dev/null 2>&1 &`` inside an action,
then ``DELETE /v1/actions/{id}``: the loop ran on at 93% of a core while the metrics said
the core was free, until the trajectory closed. Now the cancel's answer (and a timeout's
outcome) comes once the loop is gone: each check below looks it up by a marker in its argv
right when the answer arrives, without waiting.

Issue 47 #2: on docker, cancelling one call killed the container: the rollout's files were
gone. Now the command's tree is killed inside the container, which keeps running with its
files; the friction beside it: a container that died during a call was announced as
"reset before this command ran" on that call and again on the next one.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
from conftest import TOKEN
from helpers import procs_with, until

H = {"Authorization": f"Bearer {TOKEN}"}


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=H, timeout=180)


def _submit(http: httpx.Client, tid: str, aid: str, **body) -> None:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text


def _result(http: httpx.Client, aid: str) -> dict:
    """The action's result once it ended (long-polls; a hang guard of minutes)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        res = http.get(f"/v1/actions/{aid}", params={"wait": 60}).json()
        if res["status"] not in ("queued", "running"):
            return res
    raise AssertionError(f"action {aid} still {res['status']} after 300 s: {res}")


def _appears(marker: str) -> list[int]:
    """The pids carrying ``marker`` once it runs (a hang guard of minutes)."""
    asyncio.run(until(lambda: procs_with(marker), 300, f"a process with {marker!r} in its argv"))
    return procs_with(marker)


def _in_use(http: httpx.Client) -> float:
    """Cores the server counts as held (its Prometheus gauge)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('tangram_resource_in_use{resource="cpu"} '):
            return float(line.split()[1])
    raise AssertionError("no cpu in tangram_resource_in_use in /metrics")


def _daemon(marker: str) -> str:
    """Finding 5's command: a busy loop left as a daemon (its own session, its output
    away from the action's pipe), and the command itself then waits."""
    return f"setsid sh -c 'while :; do :; done' {marker} >/dev/null 2>&1 & sleep 600"


@pytest.fixture(params=["process", "docker"])
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


def test_cancel_ends_a_setsid_daemon_before_it_answers(server):
    """Finding 5 on both backends: gone when the cancel answers, and the core with it."""
    marker = f"loop-{uuid.uuid4().hex}"
    with _client(server) as http:
        tid = http.post("/v1/trajectories", json={}).json()["id"]
        _submit(http, tid, "cx1", command=_daemon(marker), shell=True, timeout_s=900)
        _appears(marker)
        cancelled = http.delete("/v1/actions/cx1")
        assert cancelled.status_code == 200, cancelled.text
        left = procs_with(marker)  # at the answer: no wait
        assert cancelled.json()["status"] == "cancelled", cancelled.json()
        assert left == [], f"cancelled, but the daemon loop still runs: pids {left}"
        assert _in_use(http) == 0
        # the sandbox itself goes on
        _submit(http, tid, "cx2", command="echo still here", shell=True)
        res = _result(http, "cx2")
        assert res["status"] == "ok" and res["output"] == "still here\n", res
        assert not res["state_lost"], res
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def test_timeout_ends_a_setsid_daemon_before_its_outcome(server):
    marker = f"loop-{uuid.uuid4().hex}"
    with _client(server) as http:
        tid = http.post("/v1/trajectories", json={}).json()["id"]
        _submit(http, tid, "tx1", command=_daemon(marker), shell=True, timeout_s=3)
        res = _result(http, "tx1")
        left = procs_with(marker)
        assert res["status"] == "timeout", res
        assert left == [], f"timed out, but the daemon loop still runs: pids {left}"
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def test_a_daemon_of_a_finished_action_is_not_the_cancels(server):
    """Cancel ends the cancelled action's tree only: a daemon an earlier action left (allowed
    while its trajectory is open) keeps running until the trajectory closes."""
    earlier, marker = f"keep-{uuid.uuid4().hex}", f"loop-{uuid.uuid4().hex}"
    with _client(server) as http:
        tid = http.post("/v1/trajectories", json={}).json()["id"]
        _submit(http, tid, "kx1", shell=True,
                command=f"setsid sh -c 'sleep 900' {earlier} >/dev/null 2>&1 </dev/null &")
        assert _result(http, "kx1")["status"] == "ok"
        _appears(earlier)
        _submit(http, tid, "kx2", command=_daemon(marker), shell=True, timeout_s=900)
        _appears(marker)
        assert http.delete("/v1/actions/kx2").json()["status"] == "cancelled"
        assert procs_with(marker) == []
        assert procs_with(earlier), "the earlier action's daemon was killed by another's cancel"
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def _container(tid: str):
    """The one running container serving ``tid``."""
    from conftest import sandbox_containers

    boxes = [c for c in sandbox_containers(tid, all=False)]
    assert len(boxes) == 1, f"{len(boxes)} running containers serve {tid}"
    return boxes[0]


def test_docker_cancel_ends_the_action_not_the_sandbox(docker_server):
    """Issue 47 #2: a cancelled call killed the container and the rollout's files went with
    it. Now: the same container, its files, and no process of the cancelled action left
    in it (its setsid daemon included)."""
    marker, unmarked = f"loop-{uuid.uuid4().hex}", f"unmarked-{uuid.uuid4().hex}"
    with _client(docker_server) as http:
        tid = http.post("/v1/trajectories", json={}).json()["id"]
        _submit(http, tid, "keep1", command="echo kept > f.txt", shell=True)
        assert _result(http, "keep1")["status"] == "ok"
        box = _container(tid)
        # and a child that cleared its environment (no mark) in a session of its own: found
        # as a descendant of a marked process
        _submit(http, tid, "keep2", shell=True, timeout_s=900,
                command=f"setsid env -i sh -c 'sleep 600' {unmarked} & " + _daemon(marker))
        _appears(marker)
        _appears(unmarked)
        assert http.delete("/v1/actions/keep2").json()["status"] == "cancelled"
        inside = [p for p in box.top(ps_args="-eo pid,args")["Processes"]
                  if marker in " ".join(p) or unmarked in " ".join(p)]
        assert inside == [] and procs_with(marker) == procs_with(unmarked) == [], inside
        _submit(http, tid, "keep3", command="cat f.txt", shell=True)
        res = _result(http, "keep3")
        assert res["status"] == "ok" and res["output"] == "kept\n", res
        assert not res["state_lost"], res
        assert _container(tid).id == box.id  # not a fresh one
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


def test_a_container_that_dies_during_a_call_is_announced_once(docker_server):
    """Issue 47's friction: the call during which the container died was announced as
    "reset before this command ran" (it ran with its files, and was cut short), and the
    next call said it again. Now that call's error says what happened, and the next call,
    the first in a fresh container, carries ``state_lost`` - once."""
    from tangram_sdk.integrations.common import STATE_LOST_NOTE, render

    marker = f"dying-{uuid.uuid4().hex}"
    with _client(docker_server) as http:
        tid = http.post("/v1/trajectories", json={}).json()["id"]
        _submit(http, tid, "die1", command="echo v > f.txt", shell=True)
        assert _result(http, "die1")["status"] == "ok"
        _submit(http, tid, "die2", argv=["sh", "-c", "sleep 600", marker], timeout_s=900)
        _appears(marker)
        _container(tid).kill()
        dying = _result(http, "die2")
        assert dying["status"] == "failed" and "died during the action" in dying["error"], dying
        assert not dying["state_lost"], dying
        assert not render(dying).startswith(STATE_LOST_NOTE), render(dying)
        _submit(http, tid, "die3", command="cat f.txt 2>/dev/null || echo gone", shell=True)
        after = _result(http, "die3")
        assert after["status"] == "ok" and after["output"] == "gone\n", after
        assert after["state_lost"] and render(after).startswith(STATE_LOST_NOTE), after
        _submit(http, tid, "die4", command="echo again", shell=True)
        again = _result(http, "die4")
        assert again["status"] == "ok" and not again["state_lost"], again
        assert not render(again).startswith(STATE_LOST_NOTE)
        assert http.get(f"/v1/trajectories/{tid}").json()["state_lost"] == 1
        assert http.delete(f"/v1/trajectories/{tid}").status_code == 200


@pytest.mark.parametrize("cgroup", ["own cgroup", "marked sweep"])
def test_process_backend_ends_the_tree_either_way(cgroup, tmp_path, monkeypatch):
    """Both ways the process backend finds an action's tree: its own cgroup (root, cgroup
    v2: this machine) and, where none can be made, the processes carrying its mark. A
    cancelled action's daemon is gone when its outcome is reported."""
    import os

    from conftest import reachable_by_sandboxes

    from executor.backends.process import backend as process
    from executor.driver import LiveExecutor
    from executor.node.local import local_cluster
    from tangram.core import Tangram
    from tangram.model import Action, Demand

    if cgroup == "own cgroup":
        probe = process.ActionGroups.here("probe") if os.geteuid() == 0 else None
        if probe is None:
            pytest.skip("no cgroup v2 the server can make here")
        probe.close()
    if cgroup == "marked sweep":
        monkeypatch.setattr(process.ActionGroups, "here", classmethod(lambda cls, mark: None))
    reachable_by_sandboxes(tmp_path / "work")
    marker = f"loop-{uuid.uuid4().hex}"

    async def go() -> None:
        backend = process.ProcessBackend(tmp_path / "work")
        assert (backend._trees is not None) == (cgroup == "own cgroup")
        ex = LiveExecutor(Tangram(local_cluster()), backend)
        try:
            ex.open_trajectory("a", "t", 0.25)
            action = Action("c1", "t", "a", "shell", {"cpu": Demand.fixed(1)},
                            payload={"command": _daemon(marker), "shell": True})
            running = asyncio.ensure_future(ex.run(action))
            await until(lambda: procs_with(marker), 300, f"{marker!r} running")
            ex.cancel("c1")
            _, out = await running
            left = procs_with(marker)
            assert out.exit_code == -9, out
            assert left == [], f"cancelled, but the daemon loop still runs: pids {left}"
            ex.close_trajectory("a")
        finally:
            ex.shutdown()

    asyncio.run(go())


def test_docker_exec_path_cancel_keeps_the_sandbox(tmp_path):
    """The same on a sandbox without an agent (``docker exec``): the exec's processes carry
    the action's mark too, so the host ends them and the container stays."""
    from executor.backends.docker.backend import DockerBackend
    from executor.driver import LiveExecutor
    from executor.node.local import local_cluster
    from tangram.core import Tangram
    from tangram.model import Action, Demand

    marker = f"loop-{uuid.uuid4().hex}"

    def act(aid: str, command: str) -> Action:
        return Action(aid, "t", "a", "shell", {"cpu": Demand.fixed(1)},
                      payload={"command": command, "shell": True, "timeout_s": 900})

    async def go() -> None:
        backend = DockerBackend(owner=f"cancel-{tmp_path.name}", agent=False)
        ex = LiveExecutor(Tangram(local_cluster()), backend)
        try:
            ex.open_trajectory("a", "t", 0.25)
            _, out = await ex.run(act("e1", "echo kept > f.txt"))
            assert out.status == "ok", out
            running = asyncio.ensure_future(ex.run(act("e2", _daemon(marker))))
            await until(lambda: procs_with(marker), 300, f"{marker!r} running")
            ex.cancel("e2")
            _, out = await running
            left = procs_with(marker)
            assert left == [], f"cancelled, but the daemon loop still runs: pids {left}"
            _, out = await ex.run(act("e3", "cat f.txt"))
            assert out.status == "ok" and out.output == "kept\n", out
            assert not out.extra.get("state_lost"), out
            ex.close_trajectory("a")
        finally:
            ex.shutdown()
        assert backend.remove_all() == 0

    asyncio.run(go())
