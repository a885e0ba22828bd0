"""Failure injection: whatever step of a backend fails, and however, the action
ends with a status and its lease is released (the pool is whole afterwards).

The backends are the real ones; a failure is injected by replacing one of their
steps with a function that raises (a step outside our control failing: the
engine, the kernel, a library)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import counts

from executor.backends.http.backend import HttpBackend
from executor.backends.process.backend import ProcessBackend
from executor.backends.router import RouterBackend
from executor.driver import LiveExecutor
from executor.node.local import local_cluster
from tangram.cluster import QuotaSpec
from tangram.core import Tangram
from tangram.model import Action, Demand


def _action(aid: str, payload: dict, quota: bool = False) -> Action:
    cost = {"quota:api": Demand.fixed(1)} if quota else {"cpu": Demand.fixed(1)}
    return Action(aid, "t", "tr", "shell", cost, payload=payload)


async def _check(backend, cases) -> None:
    """Run each (action, expected statuses) and check the pool is whole after it."""
    core = Tangram(local_cluster((QuotaSpec("quota:api", "concurrency", 2, 1.0),)))
    ex = LiveExecutor(core, backend)
    try:
        ex.open_trajectory("tr", "t", 0.1)
        for action, statuses in cases:
            _, out = await asyncio.wait_for(ex.run(action), 60)
            assert out.status in statuses, (action.id, out)
            assert out.error, action.id
            assert not counts(core).running_count and not counts(core).queued, action.id
            use = counts(core).usage
            assert use["cpu"] == 0 and use.get("quota:api", 0) == 0, (action.id, use)
        # and the pool still works
        _, out = await ex.run(_action("after", {"argv": ["echo", "fine"]}))
        assert out.status == "ok" and out.output == "fine\n"
        ex.close_trajectory("tr")
    finally:
        ex.shutdown()


def _raiser(exc: BaseException):
    def boom(*_a, **_k):
        raise exc
    return boom


def test_process_backend_failures_end_the_action(tmp_path, monkeypatch):
    import executor.backends.process.backend as proc_mod

    backend = RouterBackend(ProcessBackend(tmp_path / "work"))
    env = backend.env

    async def go() -> None:
        cases = [
            # H1 without the edge's checks: what create_subprocess_exec refuses
            (_action("nul-arg", {"argv": ["echo", "a\x00b"]}), {"failed"}),
            (_action("eq-env", {"argv": ["env"], "env": {"A=B": "x"}}), {"failed"}),
            (_action("nul-env", {"argv": ["env"], "env": {"A": "x\x00y"}}), {"failed"}),
            (_action("bad-argv", {"argv": [1, 2]}), {"failed"}),
            (_action("no-payload", {}), {"failed"}),
        ]
        await _check(backend, cases)

    asyncio.run(go())

    # each step failing in a way nobody planned for
    for step, exc in [("workdir", RuntimeError("disk gone")),
                      ("_mark", KeyError("mark")),
                      ("_kill_group", PermissionError("no"))]:
        backend = RouterBackend(ProcessBackend(tmp_path / f"work-{step}"))

        async def one(step=step, backend=backend, exc=exc) -> None:
            timeout = {"timeout_s": 0.2} if step == "_kill_group" else {}
            await _check_injected(backend, step, timeout,
                                  lambda: monkeypatch.setattr(backend.env, step, _raiser(exc)))

        asyncio.run(one())
    for name, exc in [("read_tail", MemoryError()), ("elastic_argv", TypeError("x"))]:
        backend = RouterBackend(ProcessBackend(tmp_path / f"work-{name}"))
        with monkeypatch.context() as m:
            m.setattr(proc_mod, name, _raiser(exc))
            asyncio.run(_check_injected(backend, name, {}))
    del env


async def _check_injected(backend, step: str, extra: dict, inject=None) -> None:
    core = Tangram(local_cluster())
    ex = LiveExecutor(core, backend)
    try:
        ex.open_trajectory("tr", "t", 0.1)
        if inject is not None:
            inject()
        _, out = await asyncio.wait_for(
            ex.run(_action(f"inj-{step}", {"argv": ["sleep", "5"] if extra else ["true"], **extra})),
            30)
        assert out.status in ("failed", "timeout"), (step, out)
        assert not counts(core).running_count and counts(core).usage["cpu"] == 0, step
    finally:
        ex.shutdown()


def test_http_backend_failures_end_the_action(tmp_path):
    backend = RouterBackend(ProcessBackend(tmp_path / "work"), HttpBackend(attempts=1))

    async def go() -> None:
        cases = [
            (_action("hdr", {"request": {"url": "http://127.0.0.1:9/x",
                                         "headers": {"X": "\u2603\x00"}}}, quota=True),
             {"failed"}),
            (_action("nourl", {"request": {"method": "GET"}}, quota=True), {"failed"}),
            (_action("scheme", {"request": {"url": "gopher://x"}}, quota=True), {"failed"}),
            (_action("private", {"request": {"url": "http://localhost:9/"},
                                 "public_only": True}, quota=True), {"failed"}),
        ]
        await _check(backend, cases)

    asyncio.run(go())


def test_a_backend_that_refuses_to_start_ends_the_action(tmp_path, monkeypatch):
    backend = RouterBackend(ProcessBackend(tmp_path / "work"))
    monkeypatch.setattr(backend.env, "start", _raiser(RuntimeError("shut down")))

    async def go() -> None:
        core = Tangram(local_cluster())
        ex = LiveExecutor(core, backend)
        ex.open_trajectory("tr", "t", 0.1)
        _, out = await asyncio.wait_for(ex.run(_action("x", {"argv": ["true"]})), 60)
        assert out.status == "failed" and "cannot start" in out.error
        assert not counts(core).running_count and counts(core).usage["cpu"] == 0

    asyncio.run(go())


@pytest.mark.parametrize("step", ["_create", "_grant", "_agent_exec", "_reclaim", "_set_cpus"])
def test_docker_backend_failures_end_the_action(tmp_path, monkeypatch, step):
    from executor.backends.docker.backend import DockerBackend

    backend = DockerBackend(owner=f"inject-{tmp_path.name}")
    monkeypatch.setattr(backend, step, _raiser(RuntimeError(f"{step} broke")))

    async def go() -> None:
        core = Tangram(local_cluster())
        ex = LiveExecutor(core, RouterBackend(backend))
        try:
            ex.open_trajectory("tr", "t", 0.1)
            _, out = await asyncio.wait_for(ex.run(_action("x", {"argv": ["true"]})), 60)
            if step == "_reclaim":  # after the answer: the action itself is unaffected
                assert out.status == "ok"
            else:
                assert out.status == "failed" and "broke" in out.error, out
            assert not counts(core).running_count and counts(core).usage["cpu"] == 0
            ex.close_trajectory("tr")
        finally:
            ex.shutdown()

    asyncio.run(go())
