"""Nodes joining and leaving the core (multi-node executors), and the pure parts of
the Ray backend: core splitting, CPU lists, NUMA order, inventory -> cluster spec."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import cluster, cores_in_use, counts, finish, open_trajectory, shell, submit

from executor.backends.ray.agent import NodeInfo, numa_order
from executor.backends.ray.backend import cluster_of
from executor.backends.ray.cluster import RaySpec, format_cpus, parse_cpus, split_cores
from tangram.cluster import CpuNodeSpec
from tangram.core import Tangram
from tangram.model import Outcome
from tangram.policies import make_policy
from tangram.protocol import NodeJoined, NodeLost


def test_remove_node_rebinds_queued_actions_and_drops_capacity():
    core = Tangram(cluster(cores=1, nodes=2, mem_gb=8.0))
    for t in ("a", "b"):
        open_trajectory(core, t, "t", 1.0)
    started = submit(core, shell("a", aid="a1"), 0.0) + submit(core, shell("b", aid="b1"), 0.0)
    nodes = {d.action.trajectory: d.lease.node for d in started}
    assert set(nodes.values()) == {"n0", "n1"}
    assert submit(core, shell("a", aid="a2"), 1.0) == []  # queued behind a1 on a's node
    lost = nodes["a"]
    assert core.handle(NodeLost(lost), 2.0) == []  # the other node is busy with b1
    assert core.handle(NodeLost(lost), 2.0) == []  # idempotent
    assert counts(core).capacity["cpu"] == 1.0 and lost not in {n.name for n in core.snapshot().cpu_nodes}
    # unbound from the lost node (its environment is gone) and bound again at once where
    # its memory fits, its queued action waiting there for a core (issue 30: placing a
    # trajectory never waits for a free core)
    assert core.node_of("a") == nodes["b"]
    # a1 is still running (the executor reports it); finishing it releases nothing
    assert finish(core, "a1", 3.0, Outcome("a1", "failed", None)) == []
    assert cores_in_use(core, nodes["b"]) == 1
    # b1 ends: a2 (queued first) is bound to the surviving node and starts
    (d,) = finish(core, "b1", 4.0)
    assert (d.action.id, d.lease.node, d.submit_s) == ("a2", nodes["b"], 1.0)
    assert core.node_of("a") == nodes["b"]


def test_add_node_starts_waiting_trajectories():
    core = Tangram(cluster(cores=1, nodes=1, mem_gb=4.0))
    open_trajectory(core, "a", "t", 3.0)
    open_trajectory(core, "b", "t", 3.0)  # cannot share n0's memory with a
    assert len(submit(core, shell("a", aid="a1"), 0.0)) == 1
    assert submit(core, shell("b", aid="b1"), 0.0) == []
    (d,) = core.handle(NodeJoined(CpuNodeSpec("n9", 2, 1, 4.0)), 1.0)
    assert (d.action.id, d.lease.node) == ("b1", "n9")
    assert counts(core).capacity["cpu"] == 3.0
    with pytest.raises(ValueError, match="already"):
        core.handle(NodeJoined(CpuNodeSpec("n9", 2, 1, 4.0)), 1.0)
    # a removed node's name can come back (an agent restarted on a live Ray node)
    finish(core, "b1", 2.0)
    core.handle(NodeLost("n9"), 3.0)
    core.handle(NodeJoined(CpuNodeSpec("n9", 4, 1, 4.0)), 4.0)
    assert counts(core).capacity["cpu"] == 5.0
    # validation follows the nodes present: 4 cores fit now
    core.validate(shell("a", cores=4, aid="a2"))


def test_a_pod_policy_grows_too():
    """add_node asks the policy's CPU part for the new node's pool: pods grow as well."""
    core = Tangram(cluster(cores=2, nodes=1, mem_gb=4.0), make_policy("k8s", {"pod_cores": 2}))
    open_trajectory(core, "a", "t", 1.0)
    open_trajectory(core, "b", "t", 1.0)  # n0's two cores are a's pod
    assert core.node_of("b") is None
    assert core.handle(NodeJoined(CpuNodeSpec("n9", 2, 1, 4.0)), 1.0) == []
    assert core.node_of("b") == "n9"  # its pod was created on the new node
    (d,) = submit(core, shell("b", aid="b1"), 1.0)
    assert d.lease.node == "n9" and counts(core).capacity["cpu"] == 4.0


def test_split_cores_disjoint_or_round_robin():
    assert split_cores([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cores([0, 1], 3) == [[0], [1], [0]]  # more nodes than cores: shared


def test_cpu_lists_and_ray_spec():
    assert format_cpus([0, 1, 2, 5, 7, 8]) == "0-2_5_7-8"
    assert parse_cpus("0-2_5_7-8") == parse_cpus("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ValueError, match="tangram-cpus"):
        parse_cpus("3-1")
    assert RaySpec.parse("local:3") == RaySpec("local", None, 3)
    assert RaySpec.parse("ray://head:10001").address == "ray://head:10001"
    for bad in ("local:0", "local:x", "", "a b"):
        with pytest.raises(ValueError, match="--ray"):
            RaySpec.parse(bad)


def test_numa_order_groups_by_domain(tmp_path: Path):
    for node, cpus in (("node0", "0-1,4-5"), ("node1", "2-3,6-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert numa_order(list(range(8)), tmp_path) == ([0, 1, 4, 5, 2, 3, 6, 7], 2)
    # unequal domains (a cpuset across them) count as one
    assert numa_order([0, 1, 2], tmp_path) == ([0, 1, 2], 1)


def test_inventory_becomes_the_cluster_spec():
    infos = [NodeInfo("cpu-a", "a" * 56, "cpu", tuple(range(16)), 2, 64.0, 0, 0.0, "process"),
             NodeInfo("gpu-b", "b" * 56, "gpu", tuple(range(8)), 1, 512.0, 8, 80.0, "process"),
             NodeInfo("gpu-c", "c" * 56, "gpu", (), 1, 512.0, 4, 24.0, "process")]
    spec = cluster_of(infos)
    assert [(n.name, n.cores, n.numa) for n in spec.cpu_nodes] == [("cpu-a", 16, 2),
                                                                   ("gpu-b", 8, 1)]
    # only 8-GPU nodes become GPU nodes (the core's aligned chunks of 1/2/4/8)
    assert [(n.name, n.gpus, n.gpu_mem_gb) for n in spec.gpu_nodes] == [("gpu-b", 8, 80.0)]
