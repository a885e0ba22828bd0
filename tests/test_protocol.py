"""The core's door (tangram/protocol.py): commands in, effects out, a frozen snapshot.

A GPU dispatch carries its whole residency plan (what to evict, whether to restore), a
pre-restore is an effect of its own handed to a backend that declares it can carry it out,
a lost worker is a command, and the snapshot is a copy nobody can write through."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import cluster, gpu_call, shell

from sim.clock import SimClock
from sim.modelled import ModelledBackend
from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Dispatch
from tangram.policies import make_policy
from tangram.protocol import (
    Attach,
    Cancel,
    Cancelled,
    Capabilities,
    Finish,
    Open,
    PreRestore,
    Stop,
    Submit,
    Traits,
    WorkerLost,
)
from tangram.runtime import Runtime


def one_gpu(*sizes: tuple[str, float]) -> ClusterSpec:
    """One node of one 80 GB GPU: two 60 GB services never share it."""
    return ClusterSpec(gpu_nodes=(GpuNodeSpec("g0", 1, 80.0),),
                       services=tuple(ServiceSpec(n, s) for n, s in sizes), restore_gbps=10.0)


@pytest.mark.parametrize("policy", ["tangram", "tangram-paper"])
def test_a_gpu_dispatch_carries_its_evictions_and_restore(policy):
    core = Tangram(one_gpu(("a", 60.0), ("b", 60.0)), make_policy(policy))
    core.handle(Open("t"), 0.0)
    plans = []
    for i, service in enumerate("aba"):
        (d,) = core.handle(Submit((gpu_call("t", service, choices=(1,), aid=f"r{i}"),)), i)
        plans.append(d.gpu)
        core.handle(Finish(d.action.id), i + 0.5)
    a, b = ("a", 1, 0), ("b", 1, 0)
    assert [(p.variant, p.evict, p.restore, p.resident) for p in plans] == [
        (a, (), True, frozenset({a})),
        (b, (a,), True, frozenset({b})),  # b evicts a: the backend is told, not left to infer
        (a, (b,), True, frozenset({a}))]
    assert [p.version for p in plans] == sorted({p.version for p in plans})
    # again on the resident variant: nothing to evict, nothing to restore
    (d,) = core.handle(Submit((gpu_call("t", "a", choices=(1,), aid="r3"),)), 4.0)
    assert (d.gpu.evict, d.gpu.restore, d.lease.restore_s) == ((), False, 0.0)


def test_a_lost_worker_makes_the_core_forget_the_node():
    core = Tangram(one_gpu(("a", 60.0)))
    core.handle(Open("t"), 0.0)
    (d,) = core.handle(Submit((gpu_call("t", "a", choices=(1,), aid="r0"),)), 0.0)
    core.handle(Finish("r0"), 1.0)
    assert core.snapshot().gpu_nodes[0].resident == (("a", 1, 0),)
    assert core.handle(WorkerLost("g0"), 2.0) == []
    assert core.snapshot().gpu_nodes[0].resident == ()
    (d,) = core.handle(Submit((gpu_call("t", "a", choices=(1,), aid="r1"),)), 3.0)
    assert d.gpu.restore and d.lease.restore_s > 0  # the next action restores it afresh


def test_cancel_answers_with_an_effect():
    core = Tangram(cluster(cores=1))
    core.handle(Open("t"), 0.0)
    (run,) = core.handle(Submit((shell("t", aid="x"), shell("t", aid="y"))), 0.0)
    assert core.handle(Cancel("y"), 1.0) == [Cancelled("y")]  # queued: dropped
    assert core.handle(Cancel(run.action.id), 1.0) == [Stop(run.action.id)]  # running
    assert core.handle(Cancel("nobody"), 1.0) == []


@pytest.mark.parametrize("declares", [True, False])
def test_pre_restores_are_effects_for_a_backend_that_declares_them(declares):
    """The core loads a variant ahead of demand (the static policy deploys its replicas
    before their first requests) only after a backend with Capabilities.prerestores
    attached, and hands each load to it as a PreRestore effect."""
    sizes = (("a", 60.0), ("b", 60.0))
    core = Tangram(ClusterSpec(gpu_nodes=(GpuNodeSpec("g0", 8, 80.0),),
                               services=tuple(ServiceSpec(n, s) for n, s in sizes),
                               restore_gbps=25.0), make_policy("static"))
    clock = SimClock()
    seen: list[PreRestore] = []

    class Plain:
        """The model's runs without its prerestore: a backend that does not pre-restore."""

        traits = Traits(batches=True)

        def __init__(self) -> None:
            self.model = ModelledBackend(clock, np.random.default_rng(0))

        def start(self, d, on_done) -> None:
            self.model.start(d, on_done)

        def cancel(self, action_id: str) -> None:
            self.model.cancel(action_id)

    class Recording(Plain):
        def prerestore(self, effect: PreRestore) -> None:
            seen.append(effect)

    runtime = Runtime(core, clock, Recording() if declares else Plain())
    core.handle(Open("j0"), clock.now())
    runtime.submit(gpu_call("j0", "a", t1=0.5, choices=(1,), aid="r0"),
                   lambda rec, out: runtime.close_trajectory(rec.trajectory))
    clock.run()
    assert bool(seen) == declares
    # "b", never asked, was loaded ahead of demand ("a"'s replica came with its dispatch's
    # plan); a deployment is charged no restore time
    assert [e.plan.variant[0] for e in seen] == (["b"] if declares else [])
    for e in seen:
        assert e.plan.restore and e.restore_s == 0.0


def test_the_snapshot_is_a_frozen_copy():
    core = Tangram(cluster(cores=2, nodes=1))
    core.handle(Attach(Capabilities()), 0.0)
    core.handle(Open("t", "task"), 0.0)
    (d,) = core.handle(Submit((shell("t", aid="x"),)), 0.0)
    snap = core.snapshot()
    assert isinstance(d, Dispatch) and snap.running["x"] == d
    assert snap.trajectories["t"].task == "task" and snap.trajectories["t"].node == "n0"
    assert snap.cpu_nodes[0].free == frozenset({1}) or snap.cpu_nodes[0].free == frozenset({0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.queued = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.running["y"] = d  # type: ignore[index]
    core.handle(Finish("x"), 1.0)
    assert "x" in snap.running and not core.snapshot().running  # a copy: it did not move
