"""Async Python client for `tangram serve`, and adapters in the shapes RL
frameworks use: a verl-style tool (create / execute / calc_reward / release)
and a gym-style environment (reset / step / close).

    async with TangramClient("http://127.0.0.1:8000", token) as tg:
        tid = await tg.open_trajectory(task="coding", mem_gb=4)
        result = await tg.run(tid, command="pytest -q", cpu="1-8", elastic=True)
        await tg.close_trajectory(tid)
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import httpx


class TangramError(RuntimeError):
    """The server refused a request; ``status`` is the HTTP status."""

    def __init__(self, status: int, detail: Any) -> None:
        self.status = status
        self.detail = detail
        super().__init__(f"HTTP {status}: {detail}")


class TangramClient:
    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 30.0,
                 max_connections: int = 4096) -> None:
        token = token or os.environ.get("TANGRAM_TOKEN")
        if not token:
            raise ValueError("token: pass one or set TANGRAM_TOKEN")
        # every waiting trajectory holds one long-poll: the pool must not be the limit
        # (httpx's default of 100 made thousands of trajectories queue for a connection
        # and time out there), and kept-alive connections spare a handshake per call
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections, keepalive_expiry=30)
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), limits=limits,
                                       timeout=httpx.Timeout(timeout_s, pool=None),
                                       headers={"Authorization": f"Bearer {token}"})

    async def __aenter__(self) -> TangramClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = await self._http.request(method, path, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError,
                httpx.ReadTimeout):
            # a kept-alive connection closed under the request, or an overloaded server:
            # once more, where repeating is harmless (reads; actions are idempotent by id)
            if not (method == "GET" or path.endswith("/actions")):
                raise
            resp = await self._http.request(method, path, **kw)
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail")
            except ValueError:
                detail = resp.text
            raise TangramError(resp.status_code, detail)
        return resp.json()

    async def health(self) -> dict[str, Any]:
        return await self._call("GET", "/healthz")

    async def open_trajectory(self, trajectory: str | None = None, task: str = "default",
                              mem_gb: float | None = None, image: str | None = None) -> str:
        body = {"id": trajectory, "task": task, "mem_gb": mem_gb}
        if image is not None:  # docker backend: the sandbox's image
            body["image"] = image
        return (await self._call("POST", "/v1/trajectories", json=body))["id"]

    async def close_trajectory(self, trajectory: str) -> None:
        await self._call("DELETE", f"/v1/trajectories/{trajectory}")

    async def submit(self, trajectory: str, *, action_id: str | None = None,
                     **action: Any) -> dict[str, Any]:
        """Submit an action (fields of the server's ActionIn); returns its state."""
        body = {"id": action_id or uuid.uuid4().hex, **action}
        return await self._call("POST", f"/v1/trajectories/{trajectory}/actions", json=body)

    async def wait(self, action_id: str, timeout_s: float = 3600.0) -> dict[str, Any]:
        """Block until the action ends (long-polling) and return its result."""
        deadline = timeout_s
        while True:
            step = min(deadline, 25.0)
            res = await self._call("GET", f"/v1/actions/{action_id}", params={"wait": step},
                                   timeout=step + 60)
            deadline -= step
            if res["status"] not in ("queued", "running") or deadline <= 0:
                return res

    async def run(self, trajectory: str, *, action_id: str | None = None,
                  **action: Any) -> dict[str, Any]:
        """Submit an action and return its result: one round trip when it ends within
        25 s (the submit waits for it), long-polls after that."""
        body = {"id": action_id or uuid.uuid4().hex, **action}
        state = await self._call("POST", f"/v1/trajectories/{trajectory}/actions", json=body,
                                 params={"wait": 25.0}, timeout=85.0)
        if state["status"] not in ("queued", "running"):
            return state
        return await self.wait(state["id"])

    async def metrics(self) -> str:
        resp = await self._http.get("/metrics")
        resp.raise_for_status()
        return resp.text


class VerlTool:
    """A verl ``BaseTool``-shaped adapter: each instance is a trajectory whose
    sandbox persists across ``execute`` calls; ``calc_reward`` runs the reward
    command (e.g. the hidden test suite, elastic) and returns the pass fraction."""

    def __init__(self, client: TangramClient, task: str = "default", mem_gb: float | None = None,
                 reward_command: str | None = None, reward_cpu: str = "1-8") -> None:
        self.client = client
        self.task = task
        self.mem_gb = mem_gb
        self.reward_command = reward_command
        self.reward_cpu = reward_cpu

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return await self.client.open_trajectory(instance_id, self.task, self.mem_gb)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[str, float, dict[str, Any]]:
        res = await self.client.run(instance_id, kind=parameters.get("kind", "shell"),
                                    command=parameters["command"],
                                    timeout_s=parameters.get("timeout_s"))
        return res["output"], 0.0, {"exit_code": res["exit_code"], "status": res["status"]}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        if not self.reward_command:
            return 0.0
        res = await self.client.run(instance_id, kind="reward_test", command=self.reward_command,
                                    cpu=self.reward_cpu, elastic=True)
        return 1.0 if res["status"] == "ok" and res["exit_code"] == 0 else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await self.client.close_trajectory(instance_id)


class GymEnv:
    """A gym-style environment over one trajectory: ``step(command)`` runs it."""

    def __init__(self, client: TangramClient, task: str = "default",
                 mem_gb: float | None = None, reward_command: str | None = None) -> None:
        self.client = client
        self.task = task
        self.mem_gb = mem_gb
        self.reward_command = reward_command
        self.trajectory: str | None = None

    async def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if self.trajectory is not None:
            await self.close()
        self.trajectory = await self.client.open_trajectory(None, self.task, self.mem_gb)
        return "", {"trajectory": self.trajectory}

    async def step(self, command: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.trajectory is None:
            raise RuntimeError("step() before reset()")
        if command == "submit" and self.reward_command:
            res = await self.client.run(self.trajectory, kind="reward_test",
                                        command=self.reward_command, cpu="1-8", elastic=True)
            reward = 1.0 if res["exit_code"] == 0 else 0.0
            return res["output"], reward, True, False, res
        res = await self.client.run(self.trajectory, command=command)
        return res["output"], 0.0, False, res["status"] == "timeout", res

    async def close(self) -> None:
        if self.trajectory is not None:
            tid, self.trajectory = self.trajectory, None
            await self.client.close_trajectory(tid)
