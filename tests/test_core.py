"""Invariants of the managers, the scheduler and the core on hand-built inputs."""

import pytest
from helpers import (
    EventLoop,
    close_trajectory,
    cluster,
    counts,
    cpu_node,
    finish,
    gpu_call,
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

from tangram.api.quota import QuotaManager
from tangram.cluster import CpuNodeSpec, GpuNodeSpec, QuotaSpec, ServiceSpec
from tangram.core import Tangram
from tangram.cpu.manager import CpuManager
from tangram.estimates import Estimates
from tangram.gpu.manager import GpuManager
from tangram.model import Action, Demand, Pending
from tangram.policies import PaperPolicy, Policy
from tangram.protocol import Cancel


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(0, 6), st.booleans())
def test_pick_domains_follows_its_rule(free, n, local):
    """Fullest domains first, the first of equals (one core: a shortcut of its own); a
    NUMA-local request the least free domain that fits."""
    from tangram.cpu.manager import pick_domains

    if local or n <= 0:
        fits = [d for d, f in enumerate(free) if f >= n]
        want = [(min(fits, key=lambda d: (free[d], d)), n)] if fits else None
    elif sum(free) < n:
        want = None
    else:
        want, left = [], n
        for d in sorted(range(len(free)), key=lambda d: -free[d]):
            if left and free[d]:
                want.append((d, min(free[d], left)))
                left -= min(free[d], left)
    assert pick_domains(list(free), n, local) == want


# -- the pools' bookkeeping ----------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 5), st.integers(0, 4)), max_size=60))
def test_expected_ends_kept_incrementally_match_the_rule(ops):
    """Pool.expected_ends is kept across starts, ends, starts again (a lane action booked a
    core) and time (also time going back): always the rule applied to ``running`` (past its
    expected end: as long again), sorted, the same when asked twice; an action holding no
    units (on a light lane) is not in it: it frees none when it ends."""
    from tangram.pool import Pool

    pool = Pool("p")
    now = 0.0
    for op, x, units in ops:
        if op == 0 or not pool.running:
            # (an id comes back once it ended, as the core may reuse one)
            aid = next(f"a{i}" for i in range(8) if f"a{i}" not in pool.running)
            if len(pool.running) < 7:
                pool.started(aid, now + x, units, now)
        elif op == 1:
            pool.ended(sorted(pool.running)[int(x) % len(pool.running)])
        elif op == 2:
            now = now + x - 1.0  # mostly forward, sometimes back
        else:  # as CpuNodePool.book: the same action, its end and start, on other units
            aid = sorted(pool.running)[int(x) % len(pool.running)]
            end, _, start = pool.running[aid]
            pool.started(aid, end, units, start)
        want = sorted((end if end > now else now + (now - start), u)
                      for end, u, start in pool.running.values() if u)
        assert pool.expected_ends(now) == want
        got = pool.expected_ends(now)
        got.append((0.0, 0))  # (the caller's list: changing it changes nothing kept)
        assert pool.expected_ends(now) == want


# -- managers -------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.booleans()), max_size=40))
def test_cpu_manager_never_over_allocates(ops):
    m = CpuManager([CpuNodeSpec("n", 16, 2, 64)])
    live = []
    for i, (reserve, n, local) in enumerate(ops):
        if reserve or not live:
            lease = m.reserve(f"a{i}", "n", n, local)
            if lease:
                live.append(lease)
                if local:  # one NUMA domain
                    assert len({c // 8 for c in lease.cores}) == 1
        else:
            lease = live.pop(0)
            m.release(lease)
            m.release(lease)  # idempotent
        used = [c for lease in live for c in lease.cores]
        assert len(used) == len(set(used)) <= 16
        assert m.nodes["n"].free_cores == 16 - len(used)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from([1, 2, 4, 8])), max_size=40))
def test_gpu_chunks_aligned_and_exclusive(ops):
    m = GpuManager([GpuNodeSpec("g0"), GpuNodeSpec("g1")],
                   [ServiceSpec("rm", 60), ServiceSpec("judge", 70)], 20.0)
    live = []
    for i, (reserve, k) in enumerate(ops):
        if reserve or not live:
            lease = m.reserve(f"a{i}", "rm" if i % 2 else "judge", k)
            if lease:
                assert lease.start % lease.size == 0 and lease.size == k
                live.append(lease)
        else:
            lease = live.pop()
            m.release(lease)
            m.release(lease)
        gpus = [(lease.node, g) for lease in live for g in lease.gpus]
        assert len(gpus) == len(set(gpus)) <= 16
        assert m.free_gpus() == 16 - len(gpus)
        for node in m.nodes.values():
            assert all(u <= 80 + 1e-9 for u in node.mem_used)
        for service in ("rm", "judge"):  # the per-service lookup is idle_sites' answer
            assert m.idle_sites_of(service) == m.idle_sites().get(service, [])
            for size, starts in node.free.items():
                assert all(s % size == 0 for s in starts)
    for lease in live:
        m.release(lease)
    assert m.chunk_counts() == (0, 0, 0, 2)  # buddies merged back


def test_gpu_prefers_resident_chunk_and_pays_restore_once():
    m = GpuManager([GpuNodeSpec("g0")], [ServiceSpec("rm", 40)], 20.0)
    a = m.reserve("a", "rm", 2)
    assert a.restore_s == pytest.approx(40 / (20 * 2))
    m.release(a)
    b = m.reserve("b", "rm", 2)
    assert (b.start, b.restore_s) == (a.start, 0.0)


def test_quota_modes_and_unknown_key():
    q = QuotaManager([QuotaSpec("quota:c", "concurrency", 2),
                      QuotaSpec("quota:w", "window", 2, 1.0)])
    a, b = q.reserve("a", {"quota:c": 1}, 0), q.reserve("b", {"quota:c": 1}, 0)
    assert q.reserve("c", {"quota:c": 1}, 0) is None
    q.release(a)
    q.release(a)
    assert q.available("quota:c", 0) == 1 and b
    w1 = q.reserve("w1", {"quota:w": 1}, 0.0)
    q.reserve("w2", {"quota:w": 1}, 0.5)
    q.release(w1)  # window mode: a start is not given back
    assert q.reserve("w3", {"quota:w": 1}, 0.9) is None
    assert q.next_expiry(0.9) == pytest.approx(1.0)
    assert q.reserve("w3", {"quota:w": 1}, 1.0) is not None
    # all or nothing
    assert q.reserve("x", {"quota:c": 1, "quota:w": 5}, 1.0) is None
    assert q.available("quota:c", 1.0) == 1
    with pytest.raises(ValueError, match="never configured"):
        q.available("quota:nope", 0)


def test_memory_reserved_until_close():
    core = Tangram(cluster(cores=8, nodes=2, mem_gb=10))
    open_trajectory(core, "j1", mem_gb=8)
    open_trajectory(core, "j2", mem_gb=8)
    [d1] = submit(core, shell("j1", 1.0), 0)
    [d2] = submit(core, shell("j2", 1.0), 0)
    assert d1.lease.node != d2.lease.node  # memory balance
    finish(core, d1.action.id, 1)
    assert cpu_node(core, d1.lease.node).mem_reserved_gb == 8  # held between actions
    close_trajectory(core, "j1", 1)
    assert cpu_node(core, d1.lease.node).mem_reserved_gb == 0
    [d3] = submit(core, shell("j2", 1.0), 2)
    assert d3.lease.node == d2.lease.node  # a trajectory stays on its node


# -- scheduler ------------------------------------------------------------------------
def test_fcfs_head_dispatched_first_once_it_fits():
    core = Tangram(cluster(cores=8))
    for j in ("a", "b", "c"):
        open_trajectory(core, j)
    [big] = submit(core, shell("a", 5.0, cores=6), 0)
    assert submit(core, shell("b", 1.0, cores=4), 0) == []  # head does not fit
    assert submit(core, shell("c", 1.0, cores=1), 0) == []  # no overtaking of the head
    out = finish(core, big.action.id, 5)
    assert [d.action.trajectory for d in out] == ["b", "c"] or \
        {d.action.trajectory for d in out} == {"b", "c"}
    assert out[0].action.trajectory == "b"


def test_elastic_gets_more_units_when_queue_is_short():
    core = Tangram(cluster(cores=16, numa=1))
    open_trajectory(core, "j")
    [d] = submit(core, test_run("j", 32.0, 1, 16), 0)
    assert d.units == 16


def test_elastic_gets_minimum_when_queue_is_long():
    core = Tangram(cluster(cores=8, numa=1))
    trajs = [f"j{i}" for i in range(20)]
    for j in trajs:
        open_trajectory(core, j)
    # the queue filled first, then one pass: one batch
    out = submit_many(core, [test_run(j, 32.0, 1, 8, p=0.5) for j in trajs], 0)
    assert len(out) == 8 and all(d.units == 1 for d in out)


def _golden(depth):
    core = Tangram(cluster(cores=8, numa=1), Policy(depth=depth))
    open_trajectory(core, "j")
    # both queued at once, then one pass (what it starts is its plan: 8 cores, NUMA 1)
    out = submit_many(core, [test_run("j", 8.0, 1, 8, aid="A"),
                             test_run("j", 4.0, 1, 8, aid="B")], 0.0)
    return [(d.action.id, d.units) for d in out]


def test_golden_alg1_depth2():
    """Hand-computed, 8 cores, dur(m) = T1 / m:
    all at minimum: 8 + 4 = 12; DP over both: A=5, B=3 -> 1.6 + 1.333 = 2.933;
    evict B (depth 2 lets B pick 8 cores after A): A=8 -> 1, B starts at 1 on 8
    cores -> 1 + 0.5 = 1.5; total 2.5 < 2.933, so only A starts, on 8 cores.
    With depth 0, B is estimated at its minimum (1 + 4 = 5; total 6), so both start
    with the DP split."""
    assert _golden(2) == [("A", 8)]
    assert _golden(0) == [("A", 5), ("B", 3)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3), st.booleans(),
                          st.floats(0.1, 20)), min_size=1, max_size=40))
def test_scheduler_never_exceeds_any_resource(items):
    spec = cluster(cores=8, numa=2, nodes=2, mem_gb=16, gpu_nodes=1,
                   quotas=[("quota:api", "concurrency", 2)], services=[("rm", 40)])
    core = Tangram(spec)
    cap = counts(core).capacity

    def check(c):
        use = counts(c).usage
        for k, v in use.items():
            assert v <= cap[k] + 1e-9, (k, v)

    loop = EventLoop(core, check)
    for j in range(6):
        open_trajectory(core, f"j{j}", mem_gb=4)
    for j, cores, elastic, t1 in items:
        traj = f"j{j}"
        if j == 5:
            loop.submit(gpu_call(traj, "rm", t1))
        elif elastic:
            loop.submit(test_run(traj, t1, 1, 4))
        else:
            loop.submit(shell(traj, t1, cores=cores, **({"quota:api": 1} if j == 4 else {})))
        if counts(core).running_count > 3:
            loop.step()
    loop.run()
    assert not counts(core).queued and not counts(core).running_count
    assert len({r.action_id for r in loop.records}) == len(loop.records) == len(items)
    assert counts(core).usage["cpu"] == 0 and counts(core).usage["gpu"] == 0


def test_bad_submissions_name_the_field_and_leave_nothing():
    core = Tangram(cluster(cores=8, quotas=[("quota:api", "concurrency", 1)]))
    open_trajectory(core, "j")
    with pytest.raises(ValueError, match="never configured"):
        submit(core, shell("j", 1.0, **{"quota:nope": 1}), 0)
    with pytest.raises(ValueError, match="can never fit"):
        submit(core, shell("j", 1.0, cores=64), 0)
    with pytest.raises(KeyError, match="unknown trajectory"):
        submit(core, shell("zz", 1.0), 0)
    with pytest.raises(ValueError, match="service"):
        submit(core, gpu_call("j", "rm"), 0)
    assert not counts(core).queued and counts(core).usage["cpu"] == 0
    a = shell("j", 1.0)
    submit(core, a, 0)
    with pytest.raises(ValueError, match="duplicate"):
        submit(core, a, 0)
    with pytest.raises(ValueError, match="in flight"):
        close_trajectory(core, "j", 0)


def test_a_declared_profile_gives_the_table_profile_gives():
    # the core queues an action with a declared E(m) by its profile (E, T1) and reads the
    # table on first use: the same table the scheduler's profile() computes
    est = Estimates()
    choices = (1, 2, 3, 4, 5, 6, 7, 8)
    declared = test_run("j", 12.0, 1, 8, p=0.9)
    for sched in (Policy().scheduler(), PaperPolicy().scheduler()):
        profile = sched.declared_profile(declared, est)
        assert profile == (declared.elasticity, 12.0)
        p = Pending(declared, 0.0, 1, elastic=True, choices=choices, profile=profile)
        assert dict(p.durations) == sched.profile(declared, choices, est)
        assert p.durations[8] == pytest.approx(12.0 * (0.1 + 0.9 / 8))
    # E(m) without T1: the policy's scheduler uses the T1 learnt of its kind, the paper's none
    unknown = test_run("j", None, 1, 8, p=0.9)
    assert Policy().scheduler().declared_profile(unknown, est) is None
    est.durations.observe(test_run("j", 6.0, 1, 8, p=0.9), 1, 6.0, "cpu:n", True)
    assert Policy().scheduler().declared_profile(unknown, est) == (unknown.elasticity, 6.0)
    assert PaperPolicy().scheduler().declared_profile(unknown, est) is None
    assert PaperPolicy().scheduler().profile(unknown, choices, est) == {}


def test_running_mean_learned_for_unprofiled_actions():
    est = Estimates()
    core = Tangram(cluster(), estimates=est)
    open_trajectory(core, "j")
    [d] = submit(core, shell("j", None, kind="edit"), 0)
    finish(core, d.action.id, 3.0)
    p = Pending(shell("j", None, kind="edit"), 0, 1)
    assert est.estimate(p) == pytest.approx(3.0)


def _waiting_case(paper_exact: bool):
    core = Tangram(cluster(cores=4, numa=1), PaperPolicy() if paper_exact else Policy())
    for j in ("s", "a"):
        open_trajectory(core, j)
    [shell_d] = submit(core, shell("s", 0.5, cores=3), 0.0)
    out = submit(core, test_run("a", 8.0, 1, 4, p=1.0, aid="A"), 0.0)
    return core, shell_d, out


def test_elastic_head_waits_for_a_wider_grant_when_it_pays():
    # 1 core free now (finish at 8 s) vs 4 cores in 0.5 s (finish at 2.5 s)
    core, shell_d, out = _waiting_case(paper_exact=False)
    assert out == []
    [d] = finish(core, shell_d.action.id, 0.5)
    # wider than the one core it would have had at once; one of the four is left for
    # the action the now-thinking trajectory "s" is expected to submit during A's run
    # (the width cap: a grant is irrevocable)
    assert (d.action.id, d.units) == ("A", 3)
    _, _, out = _waiting_case(paper_exact=True)  # the paper's Alg. 1 starts it at once
    assert [(d.action.id, d.units) for d in out] == [("A", 1)]


def test_width_cap_splits_with_expected_arrivals_rather_than_falling_to_the_minimum():
    """A grant is irrevocable, so an elastic action leaves room for the elastic actions
    the trajectories now thinking will submit during its run: an equal share with them of
    what is free, not the minimum. (Issue 30: the rule before reserved a whole fair share
    per expected arrival; on a pool that had held one elastic action at a time that is
    the whole pool, so a long suite started on 1 core of 24 free.)"""
    est = Estimates()
    core = Tangram(cluster(cores=24, numa=1), estimates=est)
    for j in range(8):  # eight trajectories that each ran a short elastic test, now thinking
        open_trajectory(core, f"j{j}")
        [d] = submit(core, test_run(f"j{j}", 2.0, 1, 16, p=0.9, aid=f"w{j}"), 10.0 * j)
        finish(core, d.action.id, 10.0 * j + 2.0 / d.units)
    open_trajectory(core, "x")
    [d] = submit(core, test_run("x", 40.0, 1, 16, p=0.9, aid="X"), 100.0)
    coming = est.arrivals.thinking("cpu:n0") * est.durations.elastic_share("cpu:n0")
    assert coming > 1  # (the case: more than one elastic arrival expected during its run)
    assert 1 < d.units and d.units * (1 + coming) <= 24


def test_a_waiting_head_is_weighed_again_only_when_what_it_waits_on_changes(monkeypatch):
    """Weighing a waiting head at every event of a saturated node was most of a large
    simulation's cost: it is weighed again when what it weighs changes (units free, its
    candidates, the queue behind it) or the units it waits for were due, not at events
    that change none of these."""
    from tangram.scheduler import ElasticScheduler
    weighed = []
    real = ElasticScheduler._allocate

    def counted(self, pool, fixed, elastic, rest, *args):
        weighed.append(([p.action.id for p in elastic], [p.action.id for p in rest]))
        return real(self, pool, fixed, elastic, rest, *args)

    monkeypatch.setattr(ElasticScheduler, "_allocate", counted)
    core, shell_d, out = _waiting_case(paper_exact=False)
    assert out == [] and weighed == [(["A"], [])]  # A waits for the 3 cores the shell holds
    assert poll(core, 0.1) == [] and poll(core, 0.2) == []  # nothing it weighs changed
    assert len(weighed) == 1
    open_trajectory(core, "b")
    assert submit(core, shell("b", 1.0, aid="B"), 0.3) == []  # the queue behind it changed
    assert weighed[1:] == [(["A"], ["B"])]
    # the shell ends: the units A waits for are free, so A is weighed again and starts
    started = {d.action.id: d.units for d in finish(core, shell_d.action.id, 0.4)}
    assert len(weighed) == 3 and started["A"] > 1


def test_a_waiting_head_is_weighed_again_once_the_units_it_waits_for_were_due(monkeypatch):
    from tangram.scheduler import ElasticScheduler
    weighed = []
    real = ElasticScheduler._allocate

    def counted(self, *args):
        weighed.append(args[4])  # now
        return real(self, *args)

    monkeypatch.setattr(ElasticScheduler, "_allocate", counted)
    core, _, out = _waiting_case(paper_exact=False)
    assert out == [] and poll(core, 0.3) == [] and weighed == [0.0]  # the shell is due at 0.5
    assert poll(core, 0.6) == [] and weighed == [0.0, 0.6]  # overdue: weighed again


def test_waiting_is_bounded_by_the_actions_own_run_at_minimum():
    core, _, out = _waiting_case(paper_exact=False)
    assert out == [] and poll(core, 1.0) == []  # overrunning shell: expected done at 2.0
    # once waiting stops paying (the shell has overrun so long that it is expected to
    # run as long again), A starts on what is free
    [d] = poll(core, 6.5)
    assert (d.action.id, d.units) == ("A", 1)
    # and however good waiting looks, an action that has waited as long as its own run
    # at the minimum (8 s) starts now: A waits behind two shells; when the one-core shell
    # ends, the other is expected to end 0.5 s later (4 cores then: done 2 s later), yet A
    # takes the one core free
    assert _bounded_wait_case(7.5) == []  # (waiting pays: it waits when it has waited less)
    [d] = _bounded_wait_case(8.5)
    assert (d.action.id, d.units) == ("A", 1)


def _bounded_wait_case(waited: float):
    """What starts when A (8 s on one core, 4 at most) has waited ``waited`` s behind a
    3-core shell ending at ``waited`` + 0.5 s and a 1-core shell ending now."""
    core = Tangram(cluster(cores=4, numa=1))
    for j in ("s", "r", "a"):
        open_trajectory(core, j)
    submit(core, shell("s", waited + 0.5, cores=3), 0.0)
    [short] = submit(core, shell("r", waited, cores=1), 0.0)
    assert submit(core, test_run("a", 8.0, 1, 4, p=1.0, aid="A"), 0.0) == []
    return finish(core, short.action.id, waited)


def test_dp_prices_gpu_restores_unless_paper_exact():
    from dataclasses import replace

    spec = replace(cluster(cores=0, nodes=0, gpu_nodes=1, services=[("rm", 40)]),
                   restore_gbps=1.0)
    picks = {}
    for paper_exact in (False, True):
        core = Tangram(spec, PaperPolicy() if paper_exact else Policy())
        open_trajectory(core, "j")
        [first] = submit(core, gpu_call("j", "rm", t1=1.0, choices=(1,), aid="warm"), 0.0)
        assert first.lease.restore_s == pytest.approx(40.0)  # rm now resident on 1 GPU
        finish(core, "warm", 41.0)
        [d] = submit(core, gpu_call("j", "rm", t1=4.0, choices=(1, 2), p=1.0, aid="next"), 41.0)
        picks[paper_exact] = (d.units, d.lease.restore_s)
    assert picks[False] == (1, 0.0)  # 4 s on the resident variant beats 2 s + a 20 s restore
    assert picks[True] == (2, pytest.approx(20.0))  # the paper's DP sees durations only


def test_submit_many_is_all_or_nothing():
    core = Tangram(cluster(cores=8))
    open_trajectory(core, "j")
    good, bad = shell("j", 1.0), shell("j", 1.0, cores=64)
    with pytest.raises(ValueError, match="can never fit"):
        submit_many(core, [good, bad], 0.0)
    assert not counts(core).queued and not counts(core).running_count
    out = submit_many(core, [good, shell("j", 2.0)], 0.0)
    assert len(out) == 2


@pytest.mark.parametrize("first", ["cores", "trajectory", "duplicate"])
def test_a_batch_is_refused_for_its_first_refused_action(first):
    """A batch (large enough for its ids and trajectories to be checked all at once) is
    refused for the first action refused in submit order, whichever check refuses it,
    and queues nothing."""
    core = Tangram(cluster(cores=8))
    for t in "abcdef":
        open_trajectory(core, t)
    submit(core, shell("a", 1.0, aid="queued", cores=8), 0.0)
    submit(core, shell("a", 1.0, aid="waits"), 0.0)  # (no core left: it stays queued)
    refused = {"cores": (shell("c", 1.0, cores=1.5), ValueError, "cores must be whole"),
               "trajectory": (shell("zz", 1.0), KeyError, "unknown trajectory 'zz'"),
               "duplicate": (shell("d", 1.0, aid="waits"), ValueError, "duplicate id 'waits'")}
    action, error, message = refused[first]
    later = [a for k, (a, _, _) in refused.items() if k != first]
    batch = [shell("b", 1.0), shell("c", 1.0), action, *later, shell("e", 1.0)]
    with pytest.raises(error, match=message):
        submit_many(core, batch, 0.0)
    assert queued_ids(core) == {"waits"}
    assert all(core.trajectory(t).in_flight == 0 for t in "bcdef")


def test_a_batch_binds_first_actions_in_order_until_one_fits_no_node():
    """First actions of unbound trajectories in one batch are bound in submit order; the
    first that fits no node waits, and every one behind it waits behind it (FCFS, paper
    5.2), one that would fit too; they are bound as memory is freed."""
    core = Tangram(cluster(cores=8, mem_gb=10.0))
    mems = {"a": 4.0, "b": 4.0, "c": 4.0, "d": 1.0, "e": 1.0}
    for t, mem in mems.items():
        open_trajectory(core, t, mem_gb=mem)
    out = submit_many(core, [shell(t, 1.0, aid=t) for t in mems], 0.0)
    assert [d.action.id for d in out] == ["a", "b"]
    assert [core.node_of(t) for t in mems] == ["n0", "n0", None, None, None]
    assert all(core.why_queued(t).startswith("waiting for a node") for t in "cde")
    assert finish(core, "a", 1.0) == []
    out = close_trajectory(core, "a", 1.0)  # 4 GB freed: c, d and e fit (4 + 4 + 1 + 1)
    assert [d.action.id for d in out] == ["c", "d", "e"]


@pytest.mark.parametrize("cpu_first", [True, False])
def test_pools_touched_together_pass_in_submit_order(cpu_first):
    """Pools sharing a quota pass in a fixed order (the order they were touched), not in
    the order of a set of their names (string hashing differs between processes, so
    same-seed runs differed)."""
    core = Tangram(cluster(cores=2, quotas=[("quota:x", "concurrency", 1)]))
    open_trajectory(core, "t")
    finish(core, submit(core, shell("t", aid="bind"), 0.0)[0].action.id, 0.0)  # bound to n0
    cpu = shell("t", aid="cpu", **{"quota:x": 1})
    api = Action("api", "t", "t", "search", {"quota:x": Demand.fixed(1)})
    out = submit_many(core, [cpu, api] if cpu_first else [api, cpu], 1.0)
    assert [d.action.id for d in out] == (["cpu"] if cpu_first else ["api"])


@pytest.mark.parametrize("policy", [Policy(), PaperPolicy()], ids=["tangram", "paper"])
def test_cancelling_a_queued_head_starts_what_waited_behind_it(policy):
    """A cancel passes the pool again: the 1-core test behind a 4-core one that cannot
    fit starts at the cancel, not at the next end (5 s later)."""
    core = Tangram(cluster(cores=4), policy)
    for t in "abc":
        open_trajectory(core, t)
    submit(core, test_run("a", 5.0, lo=3, hi=3, aid="a1"), 0.0)
    submit(core, test_run("b", 5.0, lo=4, hi=4, aid="b1"), 0.1)
    submit(core, test_run("c", 5.0, lo=1, hi=1, aid="c1"), 0.2)
    assert queued_ids(core) == {"b1", "c1"}
    out = core.handle(Cancel("b1"), 0.3)
    assert [type(e).__name__ for e in out] == ["Cancelled", "Dispatch"]
    assert out[1].action.id == "c1" and queued_ids(core) == set()
    # a cancel of what is not queued passes nothing
    assert core.handle(Cancel("b1"), 0.4) == []
