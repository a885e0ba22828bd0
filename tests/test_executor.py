"""The live executor end to end: real server, real processes, real containers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import docker
import httpx
import pytest
import uvicorn
from conftest import TOKEN, free_port, start_server
from fastapi import FastAPI, Response
from helpers import cpus_of, until

from executor.commands import elastic_argv
from executor.node.local import allowed_cpus
from tangram_sdk.client import TangramClient, TangramError

PY = sys.executable


def run(coro):
    return asyncio.run(coro)


# -- pure pieces ----------------------------------------------------------------------------
def test_pytest_rewrite_only_for_elastic_pytest():
    assert elastic_argv(["pytest", "-q"], 4, True) == ["pytest", "-n", "4", "-q"]
    assert elastic_argv([PY, "-m", "pytest", "t.py"], 2, True)[:5] == [PY, "-m", "pytest", "-n", "2"]
    assert elastic_argv(["pytest", "-q"], 1, True) == ["pytest", "-q"]
    assert elastic_argv(["pytest", "-n", "3"], 4, True) == ["pytest", "-n", "3"]
    assert elastic_argv(["make", "test"], 4, True) == ["make", "test"]
    assert elastic_argv(["pytest"], 4, False) == ["pytest"]


# -- process backend through HTTP -----------------------------------------------------------
def test_requests_without_token_get_401(process_server):
    r = httpx.post(process_server.url + "/v1/trajectories", json={})
    assert r.status_code == 401
    r = httpx.get(process_server.url + "/metrics", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(process_server.url + "/openapi.json").status_code == 200


async def _state_and_cores(url: str) -> None:
    async with TangramClient(url, TOKEN) as tg:
        async def one(i: int) -> None:
            tid = await tg.open_trajectory(f"state-{i}", task="t", mem_gb=0.1)
            res = await tg.run(tid, command=f"sh -c 'echo hello-{i} > note.txt'")
            assert res["status"] == "ok" and res["exit_code"] == 0
            res = await tg.run(tid, command="cat note.txt")
            assert res["output"].strip() == f"hello-{i}"
            res = await tg.run(tid, command="grep Cpus_allowed_list /proc/self/status")
            granted = set(res["cores"])
            assert cpus_of(res["output"]) == granted and granted <= set(allowed_cpus())
            # one exclusive core, or (once grep is known to be light) the shared lane
            assert len(granted) == 1 or (res["lane"] and res["units"] == 0), res
            await tg.close_trajectory(tid)

        await asyncio.gather(*(one(i) for i in range(6)))


def test_concurrent_trajectories_keep_state_and_see_only_granted_cores(process_server):
    run(_state_and_cores(process_server.url))


async def _elastic_pytest(url: str) -> None:
    async with TangramClient(url, TOKEN) as tg:
        tid = await tg.open_trajectory(task="t")
        test = "def test_a():\\n    assert 1\\n\\ndef test_b():\\n    assert 2\\n"
        await tg.run(tid, argv=[PY, "-c", f"open('test_x.py', 'w').write('{test}')"])
        res = await tg.run(tid, kind="test_run", argv=[PY, "-m", "pytest", "-q", "-p",
                                                       "no:cacheprovider", "test_x.py"],
                           cpu=f"1-{len(allowed_cpus())}", elastic=True, t1_s=20.0,
                           parallel_fraction=0.9)
        k = len(allowed_cpus())
        assert res["units"] == k and len(res["cores"]) == k
        assert res["exit_code"] == 0, res["output"]
        if k >= 2:
            assert res["argv"][3:5] == ["-n", str(k)]
            assert "bringing up nodes" in res["output"], res["output"]
        await tg.close_trajectory(tid)


def test_elastic_pytest_gets_n_workers(process_server):
    run(_elastic_pytest(process_server.url))


async def _faults(url: str) -> None:
    async with TangramClient(url, TOKEN) as tg:
        tid = await tg.open_trajectory(task="t")
        res = await tg.run(tid, command="sh -c 'echo boom; exit 3'")
        assert res["status"] == "ok" and res["exit_code"] == 3 and "boom" in res["output"]
        marker = f"{31 + time.time() % 1:.4f}"
        res = await tg.run(tid, command=f"sh -c 'sleep {marker} & sleep {marker}'", timeout_s=0.5)
        assert res["status"] == "timeout" and "timeout" in res["error"]
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
        assert left.stdout.strip() == "", "the timed-out process group survived"
        with pytest.raises(TangramError) as e:
            await tg.submit(tid, command="true", cpu="abc")
        assert e.value.status == 422 and "cpu" in str(e.value.detail)
        with pytest.raises(TangramError) as e:
            await tg.submit(tid, command="true", t1_s=-1)
        assert e.value.status == 422 and "t1_s" in str(e.value.detail)
        with pytest.raises(TangramError) as e:
            await tg.submit(tid, command="true", cpu="512")
        assert e.value.status == 422 and "never fit" in str(e.value.detail)
        with pytest.raises(TangramError) as e:
            await tg.submit("no-such-trajectory", command="true")
        assert e.value.status == 404
        # idempotent by client id: the second submit does not run it again
        a = await tg.submit(tid, action_id=f"{tid}-once", command="sh -c 'echo x >> once.txt'")
        await tg.wait(a["id"])
        await tg.submit(tid, action_id=f"{tid}-once", command="sh -c 'echo x >> once.txt'")
        res = await tg.run(tid, command="cat once.txt")
        assert res["output"].count("x") == 1
        metrics = await tg.metrics()
        assert 'tangram_actions_total{status="ok"}' in metrics
        assert "tangram_resource_capacity" in metrics
        await tg.close_trajectory(tid)


def test_faults_and_bad_input(process_server):
    run(_faults(process_server.url))


def test_http_api_calls_retry_429_without_losing_the_call(process_server):
    app = FastAPI()
    hits = {"n": 0}

    @app.get("/search")
    def search() -> Response:
        hits["n"] += 1
        if hits["n"] <= 2:
            return Response("slow down", status_code=429, headers={"Retry-After": "0.05"})
        return Response('{"hits": 3}', media_type="application/json")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        async def call() -> dict:
            async with TangramClient(process_server.url, TOKEN) as tg:
                tid = await tg.open_trajectory(task="ds")
                res = await tg.run(tid, kind="search", quota={"api": 1},
                                   request={"method": "GET", "url": f"http://127.0.0.1:{port}/search"})
                await tg.close_trajectory(tid)
                return res

        res = run(call())
        assert res["status"] == "ok" and res["exit_code"] == 200 and res["retries"] == 2
        assert '"hits": 3' in res["output"]
    finally:
        server.should_exit = True
        thread.join(10)


def test_restart_reports_unfinished_actions_failed(tmp_path):
    server = start_server(tmp_path / "state")

    async def submit() -> str:
        async with TangramClient(server.url, TOKEN) as tg:
            tid = await tg.open_trajectory(task="t")
            return (await tg.submit(tid, command="sleep 30"))["id"]

    aid = run(submit())
    server.stop(signal.SIGKILL)
    again = start_server(tmp_path / "state")
    try:
        async def check() -> dict:
            async with TangramClient(again.url, TOKEN) as tg:
                return await tg.wait(aid, timeout_s=5)

        res = run(check())
        assert res["status"] == "failed" and "restarted" in res["error"]
    finally:
        again.stop()
        subprocess.run(["pkill", "-f", "sleep 30"], check=False)


# -- docker backend -------------------------------------------------------------------------
def _owner(server) -> str:
    import hashlib

    return hashlib.sha1(str((server.state_dir / "work").resolve()).encode()).hexdigest()[:16]


def _containers(server) -> list:
    return _serving(docker.from_env().containers.list(
        all=True, sparse=True, filters={"label": f"tangram.owner={_owner(server)}"}))


def _serving(containers: list) -> list:
    """Those bound to a trajectory, named for it (``container_name``), less the warm
    pool's (docker's own names: made for the next burst, sized from the last one's)."""
    return [c for c in containers
            if any(n.lstrip("/").startswith("tangram-") for n in c.attrs.get("Names") or ())]


def _named(server, trajectory: str) -> list:
    """The trajectory's container, found as an operator would: by its name."""
    return [c for c in docker.from_env().containers.list(
        all=True, sparse=True, filters={"name": f"tangram-{trajectory}-",
                                        "label": f"tangram.owner={_owner(server)}"})]


async def _docker_flow(server) -> None:
    async with TangramClient(server.url, TOKEN) as tg:
        async def one(i: int) -> None:
            tid = await tg.open_trajectory(f"d-{i}", task="t", mem_gb=0.25)
            res = await tg.run(tid, command=f"sh -c 'echo dock-{i} > f.txt'")
            assert res["status"] == "ok", res
            res = await tg.run(tid, command="cat f.txt")
            assert res["output"].strip() == f"dock-{i}"
            res = await tg.run(tid, command="grep Cpus_allowed_list /proc/self/status")
            assert cpus_of(res["output"]) == set(res["cores"])
            await tg.close_trajectory(tid)

        await asyncio.gather(*(one(i) for i in range(3)))
        await _until_gone(server)  # removed on close (in the background, within seconds)

        # a container killed mid-action: that action fails clearly, the next one gets a
        # fresh container and is told its state was lost; another trajectory is untouched
        victim = await tg.open_trajectory("victim", task="t")
        other = await tg.open_trajectory("other", task="t")
        await tg.run(victim, command="sh -c 'echo v > keep.txt'")
        await tg.run(other, command="sh -c 'echo o > keep.txt'")
        pending = await tg.submit(victim, command="sleep 20")
        seen: dict = {}

        async def running_in_its_container() -> bool:
            boxes = _named(server, "victim")
            seen["containers"] = [c.id[:12] for c in boxes]
            seen["status"] = (await tg.wait(pending["id"], 0.1))["status"]
            seen["sleeping"] = len(boxes) == 1 and any(
                "sleep 20" in " ".join(p) for p in boxes[0].top().get("Processes") or ())
            return seen["sleeping"] and seen["status"] == "running"

        await until(running_in_its_container, 300, "victim's container, named for it, "
                    "running its action", lambda: seen)
        (box,) = _named(server, "victim")
        box.kill()
        res = await tg.wait(pending["id"], 30)
        assert res["status"] == "failed" and "container died" in res["error"]
        res = await tg.run(victim, command="sh -c 'cat keep.txt || echo missing'")
        assert res["state_lost"] and "missing" in res["output"]
        res = await tg.run(other, command="cat keep.txt")
        assert res["output"].strip() == "o" and not res["state_lost"]
        await tg.close_trajectory(victim)
        await tg.close_trajectory(other)


async def _until_gone(server) -> None:
    await until(lambda: not _containers(server), 300, "the closed trajectories' containers "
                "removed", lambda: [c.attrs.get("Names") for c in _containers(server)])


def test_docker_backend_end_to_end(docker_server):
    run(_docker_flow(docker_server))
    run(_until_gone(docker_server))


def test_docker_containers_do_not_outlive_a_server_crash(tmp_path):
    server = start_server(tmp_path / "state", "docker")

    async def open_some() -> None:
        async with TangramClient(server.url, TOKEN) as tg:
            tid = await tg.open_trajectory(task="t")
            await tg.run(tid, command="true")

    run(open_some())
    before = [c.id for c in _containers(server)]
    assert len(before) == 1
    server.stop(signal.SIGKILL)  # no chance to clean up
    again = start_server(tmp_path / "state", "docker")
    try:
        # the open trajectory is restored and its container adopted (issue 34 #4), not
        # left behind and not duplicated
        assert [c.id for c in _containers(again)] == before
    finally:
        again.stop()
    assert _containers(again) == [] and docker.from_env().containers.list(  # the stop removed
        all=True, sparse=True, filters={"label": f"tangram.owner={_owner(again)}"}) == []


def test_abandoned_container_removed_after_idle_ttl(tmp_path):
    from executor.backends.docker.backend import DockerBackend
    from executor.driver import LiveExecutor
    from executor.node.local import local_cluster
    from tangram.core import Tangram
    from tangram.model import Action, Demand

    async def go() -> None:
        backend = DockerBackend(owner=f"ttl-{tmp_path.name}", idle_ttl_s=0.5)
        ex = LiveExecutor(Tangram(local_cluster()), backend)
        try:
            ex.open_trajectory("abandoned", "t", 0.25)
            await ex.run(Action("a", "t", "abandoned", "shell", {"cpu": Demand.fixed(1)},
                                payload={"command": "true"}))
            assert _count(backend) == 1
            deadline = time.time() + 60
            while _count(backend) and time.time() < deadline:  # never closed by its client
                await asyncio.sleep(0.2)
            assert _count(backend) == 0
        finally:
            ex.shutdown()

    def _count(backend) -> int:
        return len(_serving(docker.from_env().containers.list(
            all=True, sparse=True, filters={"label": f"tangram.owner={backend.owner}"})))

    run(go())


def test_result_stream_sends_status_then_result(process_server):
    async def go() -> list[str]:
        async with TangramClient(process_server.url, TOKEN) as tg:
            tid = await tg.open_trajectory(task="t")
            a = await tg.submit(tid, command="sleep 0.3")
            events = []
            async with httpx.AsyncClient(base_url=process_server.url, timeout=30,
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                async with http.stream("GET", f"/v1/actions/{a['id']}/events") as resp:
                    assert resp.headers["content-type"].startswith("text/event-stream")
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
            await tg.close_trajectory(tid)
            return events

    import json

    events = [json.loads(e)["status"] for e in run(go())]
    assert events[-1] == "ok" and events[0] in ("queued", "running")
