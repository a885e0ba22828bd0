"""Docker sandboxes ready before a rollout waits for them (issue 33 #6), on a real
`tangram serve --backend docker` (no --warm-pool: its default):

* a trajectory's container is made when it opens, by the backend's own creators, not by
  its first action on a worker holding the action's cores;
* the warm pool is sized from demand: after a burst of N trajectories that needed a
  sandbox, N default-image sandboxes are made ready for the next burst (an RL step's
  rollouts start together, and the next step starts as many).

The figures (first-call wait per step, beside the process backend) are
analysis/bench/verl_stall.py's; here only conditions, with generous deadlines.
"""

from __future__ import annotations

import hashlib
import time

import httpx
import pytest
from conftest import TOKEN, start_server

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def server(tmp_path):
    """A fresh server each: its warm pool starts empty (sized from nothing yet)."""
    s = start_server(tmp_path / "state", "docker")
    yield s
    s.stop()


def _containers(server, trajectory: str) -> list:
    import docker

    owner = hashlib.sha1(str((server.state_dir / "work").resolve()).encode()).hexdigest()[:16]
    return docker.from_env().containers.list(
        sparse=True, filters={"label": [f"tangram.owner={owner}", f"tangram.trajectory={trajectory}"]}
    )


def _until(cond, what: str, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_trajectory_has_its_container_before_its_first_action(server):
    with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
        assert c.post("/v1/trajectories", json={"id": "early"}).status_code == 201
        _until(lambda: len(_containers(server, "early")) == 1, "no container made for the opened trajectory")
        made = _containers(server, "early")[0].id
        res = c.post(
            "/v1/trajectories/early/actions", params={"wait": 60}, json={"id": "e1", "command": "true"}
        ).json()
        assert res["status"] == "ok" and not res["state_lost"], res
        assert [b.id for b in _containers(server, "early")] == [made]  # the same one
        assert c.delete("/v1/trajectories/early").status_code == 200


def test_the_warm_pool_is_sized_from_the_last_burst(server):
    n = 4
    with httpx.Client(base_url=server.url, headers=H, timeout=120) as c:
        for i in range(n):
            assert c.post("/v1/trajectories", json={"id": f"b{i}"}).status_code == 201
        for i in range(n):
            res = c.post(
                f"/v1/trajectories/b{i}/actions",
                params={"wait": 60},
                json={"id": f"b{i}-1", "command": "true"},
            ).json()
            assert res["status"] == "ok", res
        # the pool (containers of no trajectory yet) fills to the burst's size
        _until(lambda: len(_containers(server, "")) >= n, f"the warm pool did not fill to {n}")
        for i in range(n):
            assert c.delete(f"/v1/trajectories/b{i}").status_code == 200
