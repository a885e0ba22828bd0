"""The CPU side of a policy (tangram/policies.py): how the CPU nodes are held. Each part
builds the CPU manager and the node pools from a cluster, and the pool of a node that
joins (``grow``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.cpu.malleable import MalleableNodePool
from tangram.cpu.manager import CpuManager
from tangram.cpu.pods import PodManager, PodPool
from tangram.cpu.pool import CpuNodePool
from tangram.pool import Pool


@dataclass(frozen=True)
class SharedCores:
    """Allocate-on-execution: one pool per node, cores granted per action (paper 5.2),
    plus a light lane per node (tangram/cpu/pool.py, CpuNodePool): actions expected to take
    at most ``light_s`` start at once on shared cores, at most one per ``lane_cores``
    cores of the node at a time (at least one). ``light_s`` 0: no lane.

    ``light_s`` = 0.25 s (assumption, swept in tests): a quarter of a second is below
    what a whole-core wait behind a test run costs (seconds) and long enough for the
    shell commands agents issue most (ls, cat, grep, git status: tens of ms).
    ``lane_cores`` = 4 bounds the lane to a quarter of a node's cores' time.
    ``lane_hold_s`` = 1 s (4 x ``light_s``, assumption): an action still running that long
    after it started on the lane is moved off it (CpuNodePool), so a light action waits
    at most that long per lane slot's worth of actions ahead of it, and a command slower
    than expected costs the lane at most that."""

    #: environments are the backend's containers or working directories, not pods
    starts_pods: ClassVar[bool] = False
    light_s: float = 0.25
    lane_cores: int = 4
    lane_hold_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.light_s >= 0:
            raise ValueError(f"light_s: must be >= 0, got {self.light_s!r}")
        if not self.lane_hold_s > 0:
            raise ValueError(f"lane_hold_s: must be > 0, got {self.lane_hold_s!r}")
        if not isinstance(self.lane_cores, int) or self.lane_cores < 1:
            raise ValueError(f"lane_cores: must be an integer >= 1, got {self.lane_cores!r}")

    def build(self, cluster: ClusterSpec) -> tuple[CpuManager, list[Pool]]:
        cpu = CpuManager(cluster.cpu_nodes)
        return cpu, [self._pool(cpu, n) for n in cpu.nodes]

    def _pool(self, cpu: CpuManager, node: str) -> Pool:
        return CpuNodePool(f"cpu:{node}", node, cpu, light_s=self.light_s,
                           lane_slots=max(1, cpu.nodes[node].spec.cores // self.lane_cores),
                           hold_s=self.lane_hold_s)

    def grow(self, cpu: CpuManager, spec: CpuNodeSpec) -> Pool:
        """A node joined: its capacity in ``cpu`` and the pool ``build`` would have made."""
        cpu.add_node(spec)
        return self._pool(cpu, spec.name)


@dataclass(frozen=True)
class MalleableCores(SharedCores):
    """:class:`SharedCores` whose elastic grants resize while they run
    (tangram/cpu/malleable.py): a running test grows onto cores that free up and shrinks
    to admit arrivals, where the backend re-pins a running action's processes."""

    def _pool(self, cpu: CpuManager, node: str) -> Pool:
        return MalleableNodePool(f"cpu:{node}", node, cpu, light_s=self.light_s,
                                 lane_slots=max(1, cpu.nodes[node].spec.cores // self.lane_cores),
                                 hold_s=self.lane_hold_s)


@dataclass(frozen=True)
class Pods:
    """A Kubernetes pod per trajectory holding ``pod_cores`` cores and its memory from
    binding until it closes; each action runs on the pod's cores.

    ``pod_dop``: processes an elastic test runs with inside its pod. The paper's
    dataset runs its tests single-process (rewriting ``pytest`` to ``pytest -n`` is
    Tangram's contribution, section 5.2), so 1 by default; ``pod_dop = pod_cores``
    models a baseline that already runs ``pytest -n <pod cores>``."""

    starts_pods: ClassVar[bool] = True
    pod_cores: int = 4
    pod_dop: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.pod_cores, int) or self.pod_cores < 1:
            raise ValueError(f"pod_cores: must be an integer >= 1, got {self.pod_cores!r}")
        if not isinstance(self.pod_dop, int) or not 1 <= self.pod_dop <= self.pod_cores:
            raise ValueError(f"pod_dop: must be an integer in 1..pod_cores ({self.pod_cores}), "
                             f"got {self.pod_dop!r}")

    def build(self, cluster: ClusterSpec) -> tuple[CpuManager, list[Pool]]:
        largest = max((n.cores for n in cluster.cpu_nodes), default=0)
        if cluster.cpu_nodes and self.pod_cores > largest:
            raise ValueError(f"pod_cores: a pod of {self.pod_cores} cores fits on no node "
                             f"(largest: {largest} cores)")
        cpu = PodManager(cluster.cpu_nodes, self.pod_cores)
        return cpu, [self._pool(cpu, n) for n in cpu.nodes]

    def _pool(self, cpu: PodManager, node: str) -> Pool:
        return PodPool(f"cpu:{node}", node, cpu, self.pod_dop)

    def grow(self, cpu: CpuManager, spec: CpuNodeSpec) -> Pool:
        """A node joined: its capacity in ``cpu`` (a PodManager) and the pool ``build``
        would have made for it."""
        cpu.add_node(spec)
        assert isinstance(cpu, PodManager)
        return self._pool(cpu, spec.name)
