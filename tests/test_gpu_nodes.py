"""GPU nodes in the core: a GPU node lost and back (NodeLost / NodeJoined with its
GpuNodeSpec), and the residency plans of static replicas (deployed once, never evicted,
reloaded after their worker was lost). Through the one door (Tangram.handle), no backend."""

from __future__ import annotations

import pytest
from helpers import free_gpus, gpu_invariants, gpu_node

from tangram.cluster import ClusterSpec, GpuNodeSpec, ServiceSpec
from tangram.core import Tangram
from tangram.model import Action, Demand, Dispatch, Outcome
from tangram.policies import StaticPolicy
from tangram.protocol import (
    Attach,
    Capabilities,
    Finish,
    NodeJoined,
    NodeLost,
    Open,
    PreRestore,
    Submit,
    WorkerLost,
)

NODES = (GpuNodeSpec("g0", 2, 10.0), GpuNodeSpec("g1", 2, 10.0))
CLUSTER = ClusterSpec(gpu_nodes=NODES, services=(ServiceSpec("a", 4.0), ServiceSpec("b", 4.0)),
                      restore_gbps=10.0)


def act(aid: str, service: str = "a") -> Action:
    return Action(aid, "mopd", "t", "teacher_logprob", {"gpu": Demand.fixed(1)},
                  service=service, t1_s=1.0)


def dispatches(effects: list) -> list[Dispatch]:
    return [e for e in effects if isinstance(e, Dispatch)]


def test_a_gpu_node_lost_leaves_the_pool_and_comes_back_empty() -> None:
    core = Tangram(CLUSTER)
    core.handle(Open("t"), 0.0)
    (d,) = dispatches(core.handle(Submit((act("x"),)), 0.0))
    node = d.lease.node
    assert node is not None and gpu_node(core, node).resident
    core.handle(NodeLost(node), 1.0)
    # its GPUs left (the free one at once, the leased one stays out when released) and
    # the core forgot what was resident there
    assert gpu_node(core, node).down and not gpu_node(core, node).resident
    assert free_gpus(core) == 2
    core.handle(Finish("x", Outcome("x", "failed", None, error="node_lost")), 2.0)
    assert free_gpus(core) == 2
    gpu_invariants(core)
    other = "g1" if node == "g0" else "g0"
    placed = dispatches(core.handle(Submit((act("y"), act("z"), act("w", "b"))), 3.0))
    assert {e.lease.node for e in placed} == {other} and len(placed) == 2
    # back: every GPU no action holds is free again, nothing resident; what waited starts
    (back,) = dispatches(core.handle(NodeJoined(next(n for n in NODES if n.name == node)),
                                     4.0))
    assert back.lease.node == node and back.gpu is not None and back.gpu.restore
    assert not gpu_node(core, node).down
    gpu_invariants(core)
    with pytest.raises(ValueError, match="unknown GPU node 'g9'"):
        core.handle(NodeJoined(GpuNodeSpec("g9", 2, 10.0)), 5.0)


def test_static_replicas_are_deployed_once_never_evicted_and_reloaded_after_a_lost_worker(
) -> None:
    cluster = ClusterSpec(gpu_nodes=(GpuNodeSpec("g0", 2, 10.0),),
                          services=CLUSTER.services, restore_gbps=10.0)
    core = Tangram(cluster, StaticPolicy())
    core.handle(Attach(Capabilities(gpu=True, prerestores=True, batches=True)), 0.0)
    core.handle(Open("t"), 0.0)
    effects = core.handle(Submit((act("a1"),)), 0.0)
    (d,) = dispatches(effects)
    # the first load of a replica is its deployment: in the plan, at no modelled cost
    assert d.gpu is not None and d.gpu.restore and d.gpu.evict == () and d.lease.restore_s == 0
    # the idle replica of b is deployed ahead of its first request (a pre-restore)
    deployed = [e.plan.variant for e in effects if isinstance(e, PreRestore)]
    assert deployed == [("b", 1, 1)]
    core.handle(Finish("a1", Outcome("a1")), 1.0)
    (d,) = dispatches(core.handle(Submit((act("a2"),)), 1.0))
    assert d.gpu is not None and not d.gpu.restore and d.gpu.evict == ()
    core.handle(Finish("a2", Outcome("a2")), 2.0)
    assert core.snapshot().counters["gpu_restores"] == 0
    # the worker died: the replica is loaded again on its next dispatch, a modelled restore
    core.handle(WorkerLost("g0"), 3.0)
    (d,) = dispatches(core.handle(Submit((act("a3"),)), 3.0))
    assert d.gpu is not None and d.gpu.restore and d.lease.restore_s == pytest.approx(0.4)
    assert core.snapshot().counters["gpu_restores"] == 1
    assert gpu_node(core, "g0").resident == (("a", 1, 0),)
