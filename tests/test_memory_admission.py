"""Memory admission (tangram/admission.py): declared limits as caps, admission
by observed free memory with headroom; a node nobody observes reserves in full."""

from __future__ import annotations

import pytest

from tangram.admission import LIVE, RESERVE, MemoryAdmission
from tangram.cluster import CpuNodeSpec
from tangram.managers.cpu import CpuManager


def manager(admission: MemoryAdmission) -> CpuManager:
    return CpuManager([CpuNodeSpec("n", 4, 1, 16.0)], admission)


def test_unobserved_node_reserves_declared_limits_in_full():
    cpu = manager(LIVE)  # LIVE, but nobody observed the node: the paper's rule
    assert [cpu.bind(f"t{i}", 4.0, 0) for i in range(5)] == ["n"] * 4 + [None]
    assert "16 of 16 GB reserved" in cpu.why_unbound(4.0, 0)
    cpu.unbind("t0")
    assert cpu.bind("t4", 4.0, 0) == "n"


def test_observed_node_admits_by_use_up_to_the_overcommit_cap():
    cpu = manager(LIVE)
    cpu.observe_free("n", 15.0)
    # 64 sandboxes declaring 4 GB on a 16 GB node: 256 GB = 16 x 16 GB, within the cap;
    # 0.25 GB assumed each until the next observation: 15 - 1.6 headroom -> 53 of them
    bound = [cpu.bind(f"t{i}", 4.0, 0) for i in range(64)]
    assert bound.count("n") == 53 and bound[53:] == [None] * 11
    assert "headroom" in cpu.why_unbound(4.0, 0)
    cpu.observe_free("n", 14.0)  # the next observation: they use little
    assert all(cpu.bind(f"t{i}", 4.0, 0) == "n" for i in range(53, 64))
    assert cpu.bind("t64", 4.0, 0) is None  # 260 GB would pass 16 x 16
    assert "overcommit" in cpu.why_unbound(4.0, 0)


def test_observed_shortage_holds_admission_until_memory_frees():
    cpu = manager(LIVE)
    cpu.observe_free("n", 1.0)  # the machine really is short: under 10% headroom
    assert cpu.bind("t", 4.0, 0) is None
    assert "1.0 GB free (observed)" in cpu.why_unbound(4.0, 0)
    cpu.observe_free("n", 6.0)
    assert cpu.bind("t", 4.0, 0) == "n"


def test_reserve_rule_unchanged_and_values_validated():
    cpu = manager(RESERVE)
    cpu.observe_free("n", 16.0)
    assert [cpu.bind(f"t{i}", 8.0, 0) for i in range(3)] == ["n", "n", None]
    for bad in ({"overcommit": 0.5}, {"headroom": 1.0}, {"start_gb": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MemoryAdmission(**bad)


@pytest.mark.parametrize("backend", ["process", "docker"])
def test_an_idle_sandbox_gives_its_place_to_a_waiting_one(backend, tmp_path):
    """Two trajectories whose declared memory cannot both be held (--mem-overcommit 1,
    60% of the machine each): the idle one is reclaimed for the waiting one instead of
    both waiting for an idle TTL; on docker its next action says its state was lost."""
    from conftest import TOKEN, start_server

    from executor.local import mem_total_gb
    from tangram.client import TangramSyncClient

    server = start_server(tmp_path, backend, extra_args=("--mem-overcommit", "1"))
    big = round(mem_total_gb() * 0.6, 2)
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            a = c.open_trajectory(task="reclaim", mem_gb=big)
            first = c.run(a, command="echo kept > f.txt", shell=True, id="a1")
            assert first["status"] == "ok" and not first["state_lost"], first
            b = c.open_trajectory(task="reclaim", mem_gb=big)
            queued = c.submit(b, command="echo b", shell=True, id="b1")
            if queued["status"] == "queued":  # its reason, while it waits
                assert "waiting for a node" in queued["error"] and "overcommit" in queued["error"]
            done = c.wait("b1", 120)
            assert done["status"] == "ok" and done["output"] == "b\n", done
            again = c.run(a, command="cat f.txt", shell=True, id="a2")  # b is reclaimed now
            assert again["status"] == "ok", again
            if backend == "process":  # its files stayed on disk: nothing was lost
                assert again["output"] == "kept\n" and not again["state_lost"]
            else:  # its container was removed to free the memory: said so
                assert again["state_lost"] and again["exit_code"] != 0, again
            c.close_trajectory(a)
            c.close_trajectory(b)
    finally:
        server.stop()


def test_a_verl_call_waiting_for_memory_logs_why_then_runs(tmp_path, caplog):
    """A rollout whose sandbox no node can admit yet (the machine's memory declared by a
    busy one) is not a silent hang: verl's log says why; it runs once that one is idle."""
    import asyncio
    import logging
    import time
    import types

    from conftest import TOKEN, start_server

    from executor.local import mem_total_gb
    from tangram.client import TangramSyncClient
    from tangram.integrations.verl import TangramTool

    server = start_server(tmp_path, "process", extra_args=("--mem-overcommit", "1"))
    big = round(mem_total_gb() * 0.6, 2)
    try:
        with TangramSyncClient(server.url, TOKEN, timeout_s=120) as c:
            other = c.open_trajectory(task="busy", mem_gb=big)
            c.submit(other, command="sleep 3", shell=True, id="busy1")
            while c.wait("busy1", 0)["status"] == "queued":
                time.sleep(0.05)  # then running: it holds the memory until it idled 2 s
            tool = TangramTool({"base_url": server.url, "token": TOKEN, "mem_gb": big})
            tool.admission_warn_s = 0.5
            agent = types.SimpleNamespace(request_id="r", extra_fields={})

            async def call():
                iid, _ = await tool.create()
                out = await tool.execute(iid, {"command": "echo ran"}, agent_data=agent)
                await tool.release(iid)
                await tool.close_all()
                return out

            with caplog.at_level(logging.WARNING, logger="tangram.integrations.verl"):
                resp, _, metrics = asyncio.run(call())
            assert resp.text.startswith("ran") and metrics["exit_code"] == 0
            why = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
            assert why and "waiting for a node" in why[0] and "overcommit" in why[0], why
            c.close_trajectory(other)
    finally:
        server.stop()
