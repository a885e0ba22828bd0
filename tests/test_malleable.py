"""Malleable CPU grants (issue 49, tangram/cpu/malleable.py): the manager's resize, the
core's Resized effects and Dispatch.workers, the simulator's re-timing of a resized action
and the runtime's handling of a resize that fails. The live process run is in
tests/test_malleable_live.py, the docker backend's resize in tests/test_malleable_docker.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import reachable_by_sandboxes
from helpers import (
    cluster,
    counts,
    cpu_node,
    finish,
    open_trajectory,
    poll,
    queued_ids,
    shell,
    submit,
    submit_many,
    test_run,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.backends.process.backend import ProcessBackend
from executor.driver import LiveExecutor
from executor.replay import OutputLog, RunFailed, until_failure
from sim.clock import SimClock
from sim.driver import SimConfig, simulate
from sim.modelled import RESIZE_S, ModelledBackend
from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.core import Tangram
from tangram.cpu.manager import CpuLease, CpuManager
from tangram.model import Action, Demand, Elasticity
from tangram.policies import make_policy
from tangram.protocol import Attach, Capabilities, Dispatch, Resized
from tangram.runtime import EffectFailed, Runtime
from traces.schema import COLUMNS, Truth, validate

RESIZES = Attach(Capabilities(resizes=True))


# -- CpuManager.resize ----------------------------------------------------------------------
def manager(cores: int = 8, numa: int = 2) -> CpuManager:
    return CpuManager([CpuNodeSpec("n0", cores, numa, 64.0)])


def free_of(cpu: CpuManager) -> list[list[int]]:
    return [list(d) for d in cpu.nodes["n0"].domains]


def test_resize_grows_from_its_own_numa_domain_only():
    """Domain 0 full, domain 1 idle: a lease in domain 0 cannot grow (None, nothing
    changed), though the node has 4 free cores; once its domain has cores, it grows there."""
    cpu = manager()  # two domains: cores 0-3 and 4-7
    a = cpu.reserve("a", "n0", 2, True)
    x = cpu.reserve("x", "n0", 2, True)  # best fit: the rest of domain 0
    assert (a.cores, x.cores) == ((0, 1), (2, 3))
    before = free_of(cpu), cpu.nodes["n0"].free_cores
    assert cpu.resize("a", 3) is None
    assert (free_of(cpu), cpu.nodes["n0"].free_cores) == before == ([[], [4, 5, 6, 7]], 4)
    assert cpu.lease_of("a") == a
    cpu.release(x)
    grown = cpu.resize("a", 4)
    assert grown == CpuLease("a", "n0", (0, 1, 2, 3)) == cpu.lease_of("a")
    assert free_of(cpu) == [[], [4, 5, 6, 7]] and cpu.nodes["n0"].free_cores == 4
    assert cpu.in_use("n0") == 4


def test_resize_shrinks_by_its_highest_cores():
    cpu = manager(cores=8, numa=1)
    cpu.reserve("a", "n0", 6, True)
    shrunk = cpu.resize("a", 2)
    assert shrunk.cores == (0, 1)
    assert free_of(cpu) == [[2, 3, 4, 5, 6, 7]] and cpu.nodes["n0"].free_cores == 6
    assert cpu.resize("a", 2) is shrunk  # the same size: the lease as it is
    with pytest.raises(ValueError):
        cpu.resize("a", 0)  # a grant keeps a core


def test_release_of_the_original_lease_frees_the_cores_held_now():
    """The core releases the lease it dispatched: after a shrink, its high cores may be
    another action's; after a growth, the new cores are the action's too. Either way the
    original lease frees exactly what the action holds now, and once only."""
    cpu = manager(cores=8, numa=1)
    original = cpu.reserve("a", "n0", 4, True)
    cpu.resize("a", 2)  # gives back 2, 3
    b = cpu.reserve("b", "n0", 2, True)  # best fit: 2, 3 (the rest is 4-7)
    assert b.cores == (2, 3)
    cpu.release(original)
    assert free_of(cpu) == [[0, 1, 4, 5, 6, 7]], "b's cores must stay held"
    with pytest.raises(KeyError):
        cpu.lease_of("a")
    cpu.release(original)  # a second release: nothing
    assert free_of(cpu) == [[0, 1, 4, 5, 6, 7]] and cpu.nodes["n0"].free_cores == 6

    grown_from = cpu.reserve("c", "n0", 1, True)
    current = cpu.resize("c", 5)
    assert len(current.cores) == 5 and cpu.nodes["n0"].free_cores == 1
    cpu.release(grown_from)
    assert cpu.nodes["n0"].free_cores == 6 and free_of(cpu) == [[0, 1, 4, 5, 6, 7]]
    cpu.release(current)  # the resized lease, after its original: nothing either
    assert cpu.nodes["n0"].free_cores == 6
    cpu.release(b)
    assert free_of(cpu) == [list(range(8))]


OPS = st.lists(st.tuples(st.sampled_from(["reserve", "resize", "release", "again"]),
                         st.integers(0, 5), st.integers(1, 8), st.booleans()), max_size=80)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(8, 1), (8, 2), (12, 3)]), OPS)
def test_no_core_is_granted_twice_through_resizes_and_releases(shape, ops):
    """Random reserves, resizes and releases (of a lease as reserved, or a second time):
    every core is free or held by exactly one live lease, the free counts match the free
    lists, a NUMA-local lease stays in one domain, a growth comes from the lease's domain,
    a shrink keeps its lowest cores; once every lease is released every core is free."""
    cores, numa = shape
    cpu = manager(cores, numa)
    node = cpu.nodes["n0"]
    size = node.domain_size
    first: dict[str, CpuLease] = {}  # as reserved (what the core releases)
    local: dict[str, bool] = {}
    released: list[CpuLease] = []
    for op, i, n, numa_local in ops:
        aid = f"a{i}"
        if op == "reserve" and aid not in first:
            got = cpu.reserve(aid, "n0", n, numa_local)
            if got is not None:
                assert len(got.cores) == n
                first[aid], local[aid] = got, numa_local
        elif op == "resize" and aid in first:
            old = cpu.lease_of(aid)
            free_before = free_of(cpu)
            got = cpu.resize(aid, n)
            if got is None:
                assert n > len(old.cores) and len(free_before[old.cores[0] // size]) \
                    < n - len(old.cores)
                assert free_of(cpu) == free_before and cpu.lease_of(aid) == old
            else:
                assert len(got.cores) == n and cpu.lease_of(aid) == got
                if n < len(old.cores):
                    assert got.cores == old.cores[:n]
                else:
                    assert set(old.cores) <= set(got.cores)
                    assert {c // size for c in set(got.cores) - set(old.cores)} <= \
                        {old.cores[0] // size}
        elif op == "release" and aid in first:
            cpu.release(first[aid])
            released.append(first.pop(aid))
        elif op == "again" and released:
            before = free_of(cpu)
            cpu.release(released[i % len(released)])  # (its id may hold a new lease: kept)
            live = released[i % len(released)].action_id in first
            assert not live or free_of(cpu) == before
        # every core free or in exactly one live lease
        held = [c for aid in first for c in cpu.lease_of(aid).cores]
        free = [c for d in node.domains for c in d]
        assert sorted(held + free) == list(range(cores)), (held, free)
        assert node.free_cores == len(free)
        assert all(d == sorted(d) for d in node.domains)
        for aid in first:
            got = cpu.lease_of(aid).cores
            assert not local[aid] or len({c // size for c in got}) == 1
    for lease in first.values():
        cpu.release(lease)
    assert free_of(cpu) == [list(range(d * size, (d + 1) * size)) for d in range(numa)]
    assert node.free_cores == cores and cpu.in_use("n0") == 0


# -- the core ---------------------------------------------------------------------------------
def core_of(policy: str = "tangram-malleable", resizes: bool = True, **spec) -> Tangram:
    core = Tangram(cluster(**spec), make_policy(policy))
    if resizes:
        core.handle(RESIZES, 0.0)
    return core


def resized(effects) -> list[Resized]:
    return [e for e in effects if isinstance(e, Resized)]


def dispatched(effects) -> list[Dispatch]:
    return [e for e in effects if isinstance(e, Dispatch)]


def scenario(core: Tangram) -> list:
    """A full node, an elastic test started on what is left, the other action ending, an
    arrival: every effect in order."""
    for t in "abcd":
        open_trajectory(core, t)
    out = [submit(core, shell("a", t1=5.0, cores=3, aid="s"), 0.0),
           submit(core, test_run("b", 40.0, lo=1, hi=4, p=0.95, aid="r"), 1.0),
           finish(core, "s", 5.0),
           submit_many(core, [shell("c", t1=2.0, aid="s2"), shell("d", t1=2.0, aid="s3")], 6.0),
           finish(core, "s2", 8.0),
           poll(core, 9.0)]
    for aid in sorted(core.snapshot().running):
        out.append(finish(core, aid, 60.0))
    return out


def test_without_a_resizing_backend_the_malleable_policy_is_the_default_one():
    """Not attached to a backend that re-pins: the same effects as tangram (grants fixed), no
    Resized, workers 0 (its command starts as many workers as cores); attached, the
    same scenario resizes (so the comparison can tell them apart)."""
    default = scenario(core_of("tangram-malleable", resizes=False, cores=4))
    rigid = scenario(core_of("tangram", resizes=False, cores=4))
    assert default == rigid
    flat = [e for step in default for e in step]
    assert not resized(flat) and all(d.workers == 0 for d in dispatched(flat))
    attached = scenario(core_of("tangram-malleable", cores=4))
    assert resized([e for step in attached for e in step])
    # tangram (grants fixed) attached to a resizing backend: still no resize
    rigid_attached = scenario(core_of("tangram", cores=4))
    assert rigid_attached == rigid


def test_a_test_started_narrow_grows_once_the_node_frees_and_nothing_is_queued():
    core = core_of(cores=4)
    for t in "ab":
        open_trajectory(core, t)
    assert len(dispatched(submit(core, shell("a", t1=5.0, cores=3, aid="s"), 0.0))) == 1
    (d,) = submit(core, test_run("b", 40.0, lo=1, hi=4, p=0.95, aid="r"), 1.0)
    assert isinstance(d, Dispatch) and d.lease.cores == (3,)  # no waiting for a wider grant
    assert d.workers == 4
    assert counts(core).counters["grants_resized"] == 0
    out = finish(core, "s", 5.0)
    assert out == [Resized("r", "n0", (0, 1, 2, 3))]
    assert counts(core).counters["grants_resized"] == 1
    assert cpu_node(core, "n0").free == frozenset()
    # what the status page draws: the cores it holds now, not those it started on
    held = core.snapshot().running["r"].lease
    assert held.cores == (0, 1, 2, 3) and held.units == 4


def test_a_test_does_not_grow_while_something_is_queued():
    """Idle cores go to a running grant only once nothing is queued: while a 3-core
    command waits, the 2 cores freed stay idle for it (the test cannot shrink below its
    1 core to admit it): no Resized."""
    core = core_of(cores=4)
    for t in "abcd":
        open_trajectory(core, t)
    submit(core, shell("a", t1=5.0, cores=2, aid="s"), 0.0)
    submit(core, shell("c", t1=50.0, cores=1, aid="long"), 0.0)
    (d,) = submit(core, test_run("b", 40.0, lo=1, hi=4, p=0.95, aid="r"), 1.0)
    assert len(d.lease.cores) == 1
    assert submit(core, shell("d", t1=5.0, cores=3, aid="big"), 2.0) == []  # 3 of 4 held
    out = finish(core, "s", 5.0)  # 2 free: "big" still does not fit, r must not take them
    assert not resized(out) and queued_ids(core) == {"big"}


def test_a_queued_test_that_fits_gets_its_width_before_a_running_grant_grows():
    """Two tests on a node held by a 3-core command: the first starts on the core left, the
    second waits (the first is at its minimum). When the command ends, the waiting test
    starts first, as wide as the plan gives it (not the 1 core a grant grown first would
    leave it); only then does the running one grow, onto what is left."""
    core = core_of(cores=4)
    for t in "abc":
        open_trajectory(core, t)
    submit(core, shell("a", t1=5.0, cores=3, aid="s"), 0.0)
    (first,) = submit(core, test_run("b", 40.0, lo=1, hi=4, p=0.95, aid="r"), 1.0)
    assert first.lease.cores == (3,)
    assert submit(core, test_run("c", 40.0, lo=1, hi=4, p=0.95, aid="r2"), 2.0) == []
    out = finish(core, "s", 5.0)
    assert isinstance(out[0], Dispatch) and out[0].action.id == "r2"
    assert len(out[0].lease.cores) > 1, out[0].lease
    for e in out[1:]:
        assert isinstance(e, Resized) and e.action_id == "r"
        assert not set(e.cores) & set(out[0].lease.cores)


def test_an_arrival_is_admitted_by_a_shrink_in_the_same_effects_never_below_the_minimum():
    """A grown test (2-4 cores, long) holds every core; short 1-core commands arrive: the
    grant shrinks (by its highest cores) and the first starts on a freed core, the shrink
    before the dispatch. With a minimum of 3 it shrinks once only: a second arrival, however
    long it waits, is not admitted by a shrink below the minimum; with a minimum of 2 it is."""
    for lo, admitted in ((2, {"s0", "s1"}), (3, {"s0"})):
        core = core_of(cores=4)
        for t in "abcd":
            open_trajectory(core, t)
        (d,) = submit(core, test_run("b", 600.0, lo=lo, hi=4, p=0.95, aid="r"), 0.0)
        assert d.lease.cores == (0, 1, 2, 3)
        out = submit_many(core, [shell(t, t1=2.0, aid=f"s{i}") for i, t in enumerate("acd")],
                          1.0)
        assert [type(e) for e in out] == [Resized, Dispatch]
        shrink, start = out
        assert shrink == Resized("r", "n0", (0, 1, 2)) and start.lease.cores == (3,)
        later = poll(core, 100.0)  # the queued commands are old now: worth a shrink if any
        for e in resized(later):
            assert len(e.cores) >= lo
        started = {e.action.id for e in dispatched(out + later)}
        assert started == admitted, lo
        if lo == 2:
            assert [type(e) for e in later] == [Resized, Dispatch]
            assert later[0].cores == (0, 1) and later[1].lease.cores == (2,)
        assert counts(core).counters["grants_resized"] == len(resized(out + later))


def test_workers_are_the_fastest_count_of_the_declared_profile_within_the_numa_domain():
    """Two domains of 4 cores. An Amdahl profile over 1-8 is fastest at 8: 4 workers (its
    domain: its cores never leave it). A table whose 3 is fastest: 3 workers. Under
    tangram (grants fixed), and for a non-elastic action: 0 (as many workers as cores)."""
    def start(policy: str, action: Action) -> Dispatch:
        core = core_of(policy, cores=8, numa=2)
        open_trajectory(core, action.trajectory)
        (d,) = submit(core, action, 0.0)
        return d

    amdahl = test_run("a", 40.0, lo=1, hi=8, p=0.95, aid="amdahl")
    assert start("tangram-malleable", amdahl).workers == 4
    table = Elasticity.from_table({1: 1.0, 2: 0.9, 3: 0.8, 4: 0.5})  # 3: t1/2.4, 4: t1/2
    third = Action("third", "t", "a", "test_run", {"cpu": Demand.range(1, 4)}, elastic="cpu",
                   t1_s=40.0, elasticity=table)
    assert start("tangram-malleable", third).workers == 3
    assert start("tangram", amdahl).workers == 0
    assert start("tangram-malleable", shell("a", t1=5.0, cores=2, aid="plain")).workers == 0


def test_a_grant_grows_no_wider_than_its_workers():
    """A test whose profile is fastest at 3 started on 1 core of a full node: once the node
    frees it grows to 3, not 4 (more cores than workers do nothing)."""
    core = core_of(cores=4)
    for t in "ab":
        open_trajectory(core, t)
    submit(core, shell("a", t1=5.0, cores=3, aid="s"), 0.0)
    table = Elasticity.from_table({1: 1.0, 2: 0.9, 3: 0.8, 4: 0.5})
    (d,) = submit(core, Action("r", "t", "b", "test_run", {"cpu": Demand.range(1, 4)},
                               elastic="cpu", t1_s=40.0, elasticity=table), 1.0)
    assert (len(d.lease.cores), d.workers) == (1, 3)
    (grow,) = finish(core, "s", 5.0)
    assert len(grow.cores) == 3 and set(d.lease.cores) <= set(grow.cores)


# A random workload, driven through the core's door: every effect applied to a model of
# who holds which core, checked after every command.
ACTIONS = st.one_of(
    st.tuples(st.just("shell"), st.integers(1, 3), st.sampled_from([1.0, 5.0, 30.0])),
    st.tuples(st.just("test"), st.integers(1, 2), st.sampled_from([10.0, 60.0, 300.0])))
WORKLOAD = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.lists(ACTIONS, min_size=1, max_size=3)),
    st.tuples(st.just("finish"), st.integers(0, 10)),
    st.tuples(st.just("poll"), st.floats(0.0, 30.0))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(4, 1), (8, 2)]), WORKLOAD)
def test_resized_grants_never_hold_a_core_twice(shape, workload):
    """What the backend is told (Dispatch leases, then Resized), carried out in order,
    never has two running actions on one core, nor one on a core the snapshot says is
    free, nor more cores held than the node has; a Resized is for a running malleable
    action, stays in its NUMA domain, between its minimum and its workers, growing by
    adding cores and shrinking by its highest; ``grants_resized`` counts them. Once all
    ended, every core is free."""
    cores, numa = shape
    core = core_of(cores=cores, numa=numa)
    size = cores // numa
    held: dict[str, tuple[int, ...]] = {}
    started: dict[str, Dispatch] = {}
    seen_resizes = 0
    now = 0.0
    ids = iter(range(10_000))

    def apply(effects) -> None:
        nonlocal seen_resizes
        for e in effects:
            if isinstance(e, Dispatch):
                assert not e.lease.lane  # (none is light here)
                held[e.action.id] = e.lease.cores
                started[e.action.id] = e
            elif isinstance(e, Resized):
                seen_resizes += 1
                d = started[e.action_id]
                assert e.action_id in held, "resized an action not running"
                old = held[e.action_id]
                assert d.action.elastic == "cpu" and d.workers >= 1
                assert d.action.min("cpu") <= len(e.cores) <= d.workers
                assert len({c // size for c in e.cores}) == 1, e
                if len(e.cores) > len(old):
                    assert set(old) < set(e.cores)
                else:
                    assert e.cores == old[:len(e.cores)]
                held[e.action_id] = e.cores
            # (carried out in order: a core changes hands only once its holder gave it up)
            every = [c for cs in held.values() for c in cs]
            assert len(every) == len(set(every)), (e, held)
        every = [c for cs in held.values() for c in cs]
        free = cpu_node(core, "n0").free
        assert not free & set(every), (free, held)
        assert len(every) + len(free) == cores
        assert counts(core).counters["grants_resized"] == seen_resizes

    for op, arg in workload:
        if op == "submit":
            batch = []
            for kind, width, t1 in arg:
                aid = f"x{next(ids)}"
                open_trajectory(core, aid)  # (a trajectory of its own)
                if kind == "shell":
                    batch.append(shell(aid, t1=t1, cores=width, aid=aid))
                else:
                    batch.append(test_run(aid, t1, lo=width, hi=size, p=0.9, aid=aid))
            apply(submit_many(core, batch, now))
        elif op == "finish" and held:
            aid = sorted(held)[arg % len(held)]
            del held[aid]
            apply(finish(core, aid, now))
        elif op == "poll":
            now += arg
            apply(poll(core, now))
    while held:  # everything ends, the queue drains
        now += 1.0
        aid = sorted(held)[0]
        del held[aid]
        apply(finish(core, aid, now))
    assert not queued_ids(core)
    assert cpu_node(core, "n0").free == frozenset(range(cores))
    assert counts(core).usage["cpu"] == 0.0


# -- the simulator ----------------------------------------------------------------------------
NODE = ClusterSpec(cpu_nodes=(CpuNodeSpec("n0", 4, 1, 16.0),))


def trace() -> pd.DataFrame:
    """A 3-core command holding the node, a profiled test arriving a second later (it
    starts on the core left), and a 1-core command arriving late (a shrink may admit it)."""
    base = {k: v[2] for k, v in COLUMNS.items()}
    rows = [
        {**base, "task": "t", "trajectory": "hold", "seq": 0, "kind": "shell", "think_s": 0.0,
         "t1_s": 10.0, "cpu_cores": "3", "mem_gb": 1.0},
        {**base, "task": "t", "trajectory": "grow", "seq": 0, "kind": "test_run",
         "think_s": 1.0, "t1_s": 80.0, "cpu_cores": "1-4", "mem_gb": 1.0, "elastic": "cpu",
         "profiled": True, "parallel_fraction": 0.9, "unit_overhead_s": 0.2},
        {**base, "task": "t", "trajectory": "late", "seq": 0, "kind": "shell", "think_s": 20.0,
         "t1_s": 3.0, "cpu_cores": "1", "mem_gb": 1.0},
    ]
    return validate(pd.DataFrame(rows))


def history(text: str) -> list[tuple[float, tuple[int, ...]]]:
    """A record's ``resized``: [(time, cores)]."""
    out = []
    for change in filter(None, text.split(";")):
        t, _, cores = change.partition(":")
        out.append((float(t), tuple(int(c) for c in cores.split(","))))
    return out


def truth_of_row(row) -> Truth:
    pf = float(row.parallel_fraction)
    return Truth(float(row.t1_s), None if np.isnan(pf) else pf, float(row.setup_s),
                 float(row.unit_overhead_s))


def test_simulated_resizes_are_recorded_and_retime_the_action_exactly():
    """The test starts on the one core free, grows when the holder ends (at its end) and
    shrinks for the late command: its record lists each change, and it ends where the
    model says: its progress at its true speed on each width (W workers on c cores go as
    min(c, W) would, each worker's start-up paid), paused RESIZE_S per resize. Under
    tangram (grants fixed) nothing is resized."""
    df = trace()
    result = simulate(df, NODE, SimConfig(policy="tangram-malleable"))
    recs = {r.action_id: r for r in result.records}
    assert all(r.status == "ok" for r in recs.values())
    hold, grow = recs["hold#0"], recs["grow#0"]
    assert hold.resized == "" and recs["late#0"].resized == ""
    changes = history(grow.resized)
    assert grow.units == 1 and grow.cores == "3"
    assert changes, "the test never grew"
    late = recs["late#0"]
    # grown when the holder ended; shrunk to admit the late command on the core it gave
    # up; any other change when that one ended
    first_t, first_cores = changes[0]
    assert first_t == hold.end_s and len(first_cores) == 4 and 3 in first_cores
    assert len(changes) >= 2, "the late command was not admitted by a shrink"
    shrink_t, shrink_cores = changes[1]
    assert shrink_t == late.start_s and len(shrink_cores) == 3
    assert late.cores == "3" and 3 not in shrink_cores
    assert {t for t, _ in changes[2:]} <= {late.end_s}
    assert result.snapshot.counters["grants_resized"] == len(changes)

    row = df[df.trajectory == "grow"].iloc[0]
    truth = truth_of_row(row)
    choices = range(1, 5)
    declared = Elasticity.amdahl(float(row.parallel_fraction)).durations(float(row.t1_s),
                                                                        tuple(choices))
    workers = min(choices, key=lambda u: (declared[u], u))

    def true_s(c: int) -> float:
        used = min(c, workers)
        return truth.duration(used) + truth.unit_overhead_s * (workers - used)

    since, left, width = grow.start_s + grow.overhead_s, 1.0, grow.units
    for t, cores in changes:
        if t > since:
            left -= (t - since) / true_s(width)
            since = t
        left = max(left, 0.0)
        since += RESIZE_S
        width = len(cores)
    assert grow.end_s == pytest.approx(since + left * true_s(width), rel=1e-9)
    # (not the end it would have had on one core throughout)
    assert grow.end_s < grow.start_s + grow.overhead_s + true_s(1)

    rigid = simulate(df, NODE, SimConfig(policy="tangram"))
    assert [r.resized for r in rigid.records] == [""] * len(rigid.records)
    assert rigid.snapshot.counters["grants_resized"] == 0


# -- the runtime: a resize that cannot be carried out -----------------------------------------
class Broken(Exception):
    """What the injected resize raises."""


class NoResize:
    """The simulator's backend without ``resize`` (forwarding the rest)."""

    def __init__(self, inner: ModelledBackend) -> None:
        self.inner = inner
        self.traits = inner.traits

    def start(self, d, on_done) -> None:
        self.inner.start(d, on_done)

    def cancel(self, action_id: str) -> None:
        self.inner.cancel(action_id)


class ResizeFails(ModelledBackend):
    def resize(self, effect) -> None:
        raise Broken("resize")


def grow_scenario(rt: Runtime, clock: SimClock, results: dict) -> None:
    """On 2 cores: a command holds one, a test starts on the other and grows when the
    command ends (at 2 s); another command arrives at 5 s."""
    for t in "abc":
        rt.open_trajectory(t)
    keep = lambda rec, out: results.__setitem__(out.action_id, out)  # noqa: E731
    rt.submit(shell("a", t1=2.0, aid="hold"), keep)
    rt.submit(test_run("b", 30.0, lo=1, hi=2, p=0.95, aid="grow"), keep)
    clock.call_later(5.0, lambda: rt.submit(shell("c", t1=1.0, aid="after"), keep))


@pytest.mark.parametrize("backend", ["no-resize", "resize-raises"])
def test_a_resize_that_fails_ends_its_action_failed_and_the_runtime_goes_on(backend):
    """A backend without resize attached as one that resizes (capabilities_of never says
    so; the runtime refuses it all the same), or a resize that raises: the grown action
    ends failed with the error, the driver is told, its cores come back, and the next
    action runs."""
    clock, seen, results = SimClock(), [], {}
    core = Tangram(cluster(cores=2), make_policy("tangram-malleable"))
    model = (ResizeFails if backend == "resize-raises" else ModelledBackend)(
        clock, np.random.default_rng(0))
    rt = Runtime(core, clock, NoResize(model) if backend == "no-resize" else model,
                 on_error=seen.append)
    assert rt.capabilities.resizes == (backend == "resize-raises")
    core.handle(RESIZES, clock.now())  # (what a Runtime attaches for a resizing backend)
    grow_scenario(rt, clock, results)
    clock.run()
    want = ("Resized: TypeError: the NoResize backend has no resize"
            if backend == "no-resize" else "Resized: Broken: resize")
    assert results["grow"].status == "failed" and want in results["grow"].error
    assert seen == [EffectFailed("Resized", "grow", results["grow"].error)]
    assert results["hold"].status == "ok" and results["after"].status == "ok"
    assert core.snapshot(detail=False).usage["cpu"] == 0.0  # its cores came back


def test_without_a_driver_sink_a_failed_resize_raises():
    """A simulation has no one to tell: a backend's failed resize is a bug, raised."""
    clock = SimClock()
    rt = Runtime(Tangram(cluster(cores=2), make_policy("tangram-malleable")), clock,
                 ResizeFails(clock, np.random.default_rng(0)))
    grow_scenario(rt, clock, {})
    with pytest.raises(Broken):
        clock.run()


class ProcessResizeFails(ProcessBackend):
    def resize(self, effect) -> None:
        raise Broken("resize")


def test_live_a_failed_resize_fails_its_action_and_stops_a_run(tmp_path: Path):
    """As a failed move (tests/test_effect_failures.py), on the real process backend: a
    test started on the core left grows when the other command ends, its resize raises:
    the test is stopped and ends failed with the error (not left running on cores given
    to others), the other command ends ok, a replay's wait stops with RunFailed, and the
    executor goes on serving."""

    async def main() -> tuple:
        core = Tangram(cluster(cores=2), make_policy("tangram-malleable"))
        reachable_by_sandboxes(tmp_path)
        ex = LiveExecutor(core, OutputLog(ProcessResizeFails(tmp_path)))
        assert ex.runtime.capabilities.resizes
        for t in "abc":
            ex.open_trajectory(t)
        holder = ex.submit(Action("hold", "t", "a", "shell", {"cpu": Demand.fixed(1)},
                                  t1_s=1.0, payload={"argv": ["sleep", "1"]}))
        grower = ex.submit(Action("grow", "t", "b", "test_run", {"cpu": Demand.range(1, 2)},
                                  elastic="cpu", t1_s=30.0, elasticity=Elasticity.amdahl(0.95),
                                  payload={"argv": ["sleep", "300"]}))
        with pytest.raises(RunFailed) as info:
            await asyncio.wait_for(until_failure(ex, asyncio.gather(
                asyncio.shield(holder), asyncio.shield(grower))), 120)
        _, grown = await asyncio.wait_for(grower, 120)  # stopped: its outcome came
        _, held = await asyncio.wait_for(holder, 120)
        _, after = await asyncio.wait_for(ex.submit(Action(
            "after", "t", "c", "shell", {"cpu": Demand.fixed(1)}, t1_s=1.0,
            payload={"argv": ["true"]})), 120)
        ex.shutdown()
        return grown, held, after, str(info.value), core.snapshot(detail=False)

    grown, held, after, message, snap = asyncio.run(main())
    assert grown.status == "failed" and "Resized: Broken: resize" in grown.error, grown
    assert held.status == "ok" and after.status == "ok"
    assert "Resized of action 'grow' failed" in message
    assert snap.usage["cpu"] == 0.0
