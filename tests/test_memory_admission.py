"""Memory admission (tangram/cpu/admission.py): declared limits as caps, admission
by observed free memory with headroom; a node nobody observes reserves in full."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tangram.cluster import CpuNodeSpec
from tangram.cpu.admission import LIVE, RESERVE, MemoryAdmission
from tangram.cpu.manager import CpuManager


def manager(admission: MemoryAdmission) -> CpuManager:
    return CpuManager([CpuNodeSpec("n", 4, 1, 16.0)], admission)


def test_unobserved_node_reserves_declared_limits_in_full():
    cpu = manager(LIVE)  # LIVE, but nobody observed the node: the paper's rule
    assert [cpu.bind(f"t{i}", 4.0, 0) for i in range(5)] == ["n"] * 4 + [None]
    assert "16 of 16 GB reserved" in cpu.why_unbound(4.0)
    cpu.unbind("t0")
    assert cpu.bind("t4", 4.0, 0) == "n"


def test_observed_node_admits_by_use_up_to_the_overcommit_cap():
    cpu = manager(LIVE)
    cpu.observe_free("n", 15.0)
    # 64 sandboxes declaring 4 GB on a 16 GB node: 256 GB = 16 x 16 GB, within the cap;
    # 0.25 GB assumed each until the next observation: 15 - 1.6 headroom -> 53 of them
    bound = [cpu.bind(f"t{i}", 4.0, 0) for i in range(64)]
    assert bound.count("n") == 53 and bound[53:] == [None] * 11
    assert "headroom" in cpu.why_unbound(4.0)
    cpu.observe_free("n", 14.0)  # the next observation: they use little
    assert all(cpu.bind(f"t{i}", 4.0, 0) == "n" for i in range(53, 64))
    assert cpu.bind("t64", 4.0, 0) is None  # 260 GB would pass 16 x 16
    assert "overcommit" in cpu.why_unbound(4.0)


def test_observed_shortage_holds_admission_until_memory_frees():
    cpu = manager(LIVE)
    cpu.observe_free("n", 1.0)  # the machine really is short: under 10% headroom
    assert cpu.bind("t", 4.0, 0) is None
    assert "1.0 GB free (observed)" in cpu.why_unbound(4.0)
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

    from executor.node.local import mem_total_gb
    from tangram_sdk.client import TangramSyncClient

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

    from executor.node.local import mem_total_gb
    from tangram_sdk.client import TangramSyncClient
    from tangram_sdk.integrations.verl import TangramTool

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


# -- through the core's door (tangram/protocol.py): MemoryObserved, Reclaim, why_queued ----
def _core(admission: MemoryAdmission, evicts: bool = False):
    from helpers import cluster

    from tangram.core import Tangram
    from tangram.protocol import Attach, Capabilities

    core = Tangram(cluster(cores=4, mem_gb=16.0), admission=admission)
    core.handle(Attach(Capabilities(evicts=evicts)), 0.0)
    return core


def _ran(core, trajectory: str, aid: str, start: float, end: float) -> None:
    """The open ``trajectory`` ran ``aid`` from ``start`` to ``end`` (then idle)."""
    from helpers import shell

    from tangram.protocol import Finish, Submit

    (d,) = core.handle(Submit((shell(trajectory, aid=aid),)), start)
    assert d.action.id == aid
    core.handle(Finish(aid), end)


def test_an_idle_trajectory_over_the_cap_is_reclaimed_for_a_waiting_one():
    from helpers import shell

    from tangram.model import Dispatch
    from tangram.protocol import MemoryObserved, Open, Reclaim, Submit

    core = _core(MemoryAdmission(overcommit=1.0, headroom=0.1))  # --mem-overcommit 1
    for t in "ab":
        core.handle(Open(t, mem_gb=10.0), 0.0)
    _ran(core, "a", "a1", 0.0, 1.0)
    assert core.handle(Submit((shell("b", aid="b1"),)), 2.0) == []  # 20 GB > 16 GB
    snap = core.snapshot(detail=False)
    assert (snap.waiting_for_node, snap.queued) == (1, 1)
    assert "waiting for a node" in core.why_queued("b1") and "reserved" in core.why_queued("b1")
    # observed: a has been idle 1.5 s, not the 2 s asked: nobody is reclaimed yet
    assert core.handle(MemoryObserved("n0", 15.0, idle_after_s=2.0), 2.5) == []
    assert "overcommit" in core.why_queued("b1")
    out = core.handle(MemoryObserved("n0", 15.0, idle_after_s=2.0), 3.5)
    assert out[0] == Reclaim("a") and isinstance(out[1], Dispatch) and len(out) == 2
    assert out[1].action.id == "b1" and core.why_queued("b1") == ""
    assert core.node_of("a") is None and core.node_of("b") == "n0"
    snap = core.snapshot(detail=False)
    assert (snap.waiting_for_node, snap.counters["trajectories_reclaimed"]) == (0, 1)
    # a's next action binds it again like a first action: it waits for b's memory now
    assert core.handle(Submit((shell("a", aid="a2"),)), 4.0) == []
    assert core.snapshot(detail=False).waiting_for_node == 1


@pytest.mark.parametrize("evicts", [True, False])
def test_an_observed_shortage_reclaims_one_per_observation_only_if_the_backend_evicts(evicts):
    from helpers import shell

    from tangram.protocol import MemoryObserved, Open, Reclaim, Shed, Submit

    core = _core(LIVE, evicts=evicts)
    core.handle(MemoryObserved("n0", 15.0), 0.0)
    for t in "abc":
        core.handle(Open(t, mem_gb=4.0), 0.0)
    _ran(core, "a", "a1", 0.0, 1.0)  # least recently used
    _ran(core, "c", "c1", 1.0, 2.0)
    core.handle(MemoryObserved("n0", 1.0), 3.0)  # short by observation: under 10% headroom
    assert core.handle(Submit((shell("b", aid="b1"),)), 4.0) == []
    assert "1.0 GB free (observed)" in core.why_queued("b1")
    out = core.handle(MemoryObserved("n0", 1.0, idle_after_s=2.0), 5.0)
    # one per observation (its freed memory shows in the next one), and only when the
    # backend frees memory: the process backend's idle trajectories hold none, so the
    # node sheds its largest sandbox at once instead (issue 34 #1)
    keep = LIVE.headroom * core.snapshot().cpu_nodes[0].mem_gb
    assert out == ([Reclaim("a")] if evicts else [Shed("n0", 1.0, keep)])
    (d,) = core.handle(MemoryObserved("n0", 6.0), 6.0)  # memory freed: b is admitted
    assert d.action.id == "b1" and core.node_of("c") == "n0"


def test_memory_observed_refuses_an_unknown_node_or_a_bad_value():
    from tangram.protocol import MemoryObserved

    core = _core(LIVE)
    with pytest.raises(KeyError, match="node"):
        core.handle(MemoryObserved("elsewhere", 1.0), 0.0)
    for bad in ({"free_gb": float("nan")}, {"free_gb": -1.0}, {"idle_after_s": -1.0}):
        args = {"free_gb": 1.0, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            core.handle(MemoryObserved("n0", **args), 0.0)


def test_a_pod_per_trajectory_is_never_reclaimed():
    from helpers import cluster

    from tangram.core import Tangram
    from tangram.policies import make_policy
    from tangram.protocol import MemoryObserved, Open

    core = Tangram(cluster(cores=8, mem_gb=16.0), make_policy("k8s"),
                   admission=MemoryAdmission(overcommit=1.0))
    for t in "ab":
        core.handle(Open(t, mem_gb=10.0), 0.0)  # the pod starts at open: b waits for a's
    assert core.snapshot(detail=False).unbound == 1
    assert core.handle(MemoryObserved("n0", 15.0, idle_after_s=0.0), 10.0) == []
    assert core.node_of("a") == "n0" and core.node_of("b") is None


class _Refusing(MemoryAdmission):
    """The same rule through ``refusal`` itself (bind_many applies it inline otherwise)."""

    def refusal(self, *args):  # type: ignore[no-untyped-def]
        return MemoryAdmission.refusal(self, *args)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([0.0, 1.0, 2.5, 4.0, 6.0]),
                          st.integers(0, 5)), max_size=12),
       st.integers(0, 4), st.sampled_from([RESERVE, LIVE]))
def test_bind_many_inline_rule_binds_as_refusal_does(requests, busy, admission):
    """bind_many's inlined rule for an unobserved node (and its one-node loop) binds what
    ``refusal`` would: the same nodes, stopping at the same request, the same memory held."""
    specs = [CpuNodeSpec("n", 4, 1, 16.0)]
    for nodes in (specs, [*specs, CpuNodeSpec("m", 4, 1, 8.0)]):
        fast = CpuManager(nodes, admission)
        slow = CpuManager(nodes, _Refusing(admission.overcommit, admission.headroom,
                                           admission.start_gb))
        for cpu in (fast, slow):
            for i in range(busy):  # cores taken: ranks the nodes, never makes one wait
                cpu.reserve(f"x{i}", "n", 1, False)
        assert fast.bind_many(requests) == slow.bind_many(requests)
        for name in fast.nodes:
            f, s = fast.nodes[name], slow.nodes[name]
            assert (f.mem_reserved, f.mem_since) == (s.mem_reserved, s.mem_since)


class _Unremembering(CpuManager):
    """Asks every node again for every request (no memory of the last refusal)."""

    def bind_many(self, requests):  # type: ignore[no-untyped-def]
        self._refused = None
        return super().bind_many(requests)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["bind", "bind", "unbind", "observe", "join", "leave"]),
                          st.sampled_from("abc"), st.sampled_from([4.0, 9.0]),
                          st.integers(0, 4)), max_size=20),
       st.sampled_from([RESERVE, LIVE]))
@example([("bind", "a", 9.0, 0), ("bind", "b", 9.0, 0), ("unbind", "a", 4.0, 0),
          ("bind", "b", 9.0, 0)], RESERVE)  # (a close frees memory)
@example([("observe", "a", 1.0, 0), ("bind", "a", 9.0, 0), ("observe", "a", 9.0, 0),
          ("bind", "a", 9.0, 0)], LIVE)  # (an observation finds more free)
@example([("bind", "a", 9.0, 0), ("bind", "b", 9.0, 0), ("join", "a", 4.0, 0),
          ("bind", "b", 9.0, 0)], RESERVE)  # (a node joins)
def test_a_remembered_refusal_binds_as_asking_every_node_again(ops, admission):
    """A request that every node refused is not asked of them again while no node's memory
    changed: whatever frees, holds or observes memory, or a node joining or leaving, makes it
    asked again, so the bindings are those of asking every time."""
    specs = [CpuNodeSpec("n", 4, 1, 16.0), CpuNodeSpec("m", 4, 1, 8.0)]
    fast, slow = CpuManager(specs, admission), _Unremembering(specs, admission)
    for op, trajectory, gb, cores in ops:
        got = [_apply(cpu, op, trajectory, gb, cores) for cpu in (fast, slow)]
        assert got[0] == got[1], (op, trajectory, gb, cores)
        assert fast.bound == slow.bound


def _apply(cpu: CpuManager, op: str, trajectory: str, gb: float, cores: int) -> str | None:
    if op == "bind":
        return cpu.bind(trajectory, gb, cores)
    if op == "unbind":
        cpu.unbind(trajectory)
    elif op == "observe":
        cpu.observe_free("n", gb)
    elif op == "join" and "x" not in cpu.nodes:
        cpu.add_node(CpuNodeSpec("x", 4, 1, 12.0))
    elif op == "leave":
        cpu.remove_node("m")
    return None
