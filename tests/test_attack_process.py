"""Attack: commands on the process backend that try to read the server's secrets,
outlive their action or trajectory, or flood the server's memory."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from conftest import TOKEN

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def http(process_server):
    with httpx.Client(base_url=process_server.url, headers=H, timeout=120) as c:
        yield c


def _run(http, tid: str, aid: str, **body) -> dict:
    r = http.post(f"/v1/trajectories/{tid}/actions", json={"id": aid, **body})
    assert r.status_code == 202, r.text
    return http.get(f"/v1/actions/{aid}", params={"wait": 60}).json()


def _procs_with(arg: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if arg.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


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
    deadline = time.time() + 5
    while _procs_with("314.15") and time.time() < deadline:
        time.sleep(0.1)
    assert _procs_with("314.15") == []
    http.delete("/v1/trajectories/escaper")


def test_background_processes_die_with_the_trajectory(http):
    http.post("/v1/trajectories", json={"id": "lingerer"})
    res = _run(http, "lingerer", "ling1",
               argv=["sh", "-c", "setsid sleep 271.8 > /dev/null 2>&1 < /dev/null &"])
    assert res["status"] == "ok"
    time.sleep(0.3)
    assert len(_procs_with("271.8")) == 1  # a background helper may live while it is open
    assert http.delete("/v1/trajectories/lingerer").status_code == 200
    deadline = time.time() + 5
    while _procs_with("271.8") and time.time() < deadline:
        time.sleep(0.1)
    assert _procs_with("271.8") == []


def test_huge_output_is_bounded(http, process_server):
    http.post("/v1/trajectories", json={"id": "flood"})
    before = _rss_mb(process_server.proc.pid)
    res = _run(http, "flood", "flood1", argv=["head", "-c", "300M", "/dev/zero"])
    after = _rss_mb(process_server.proc.pid)
    assert res["status"] == "ok" and len(res["output"]) == 1 << 20  # the last 1 MiB
    assert after - before < 60, (before, after)  # was +480 MB: read whole, then cut
    http.delete("/v1/trajectories/flood")
