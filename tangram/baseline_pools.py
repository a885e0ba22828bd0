"""Pool kinds of today's ways of holding external resources (the baselines).

Each is a Pool (or a manager a pool uses) implementing the extension points of
tangram/pools.py; the policies in tangram/policies.py assemble them. None of
them overrides the core.

* pods (Kubernetes): a trajectory's pod holds its cores and memory from binding
  until it closes; every action of the trajectory runs on the pod's cores.
* static deployments (SGLang-like): each GPU service on fixed dedicated replicas
  of a fixed DoP, with its own queue; no restores, no sharing.
* cold-started instances (ServerlessLLM-like): one model per GPU; starting an
  instance evicts the models it overlaps and pays an init time on top of the load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tangram.batching import DEFAULT_BATCHING, BatchModel
from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.managers.cpu import CpuLease, CpuManager
from tangram.managers.gpu import GpuManager, GpuNode
from tangram.model import Action
from tangram.pools import CpuNodePool, Grant, Pending, Pool, batch_expected, take_riders
from tangram.scheduler import FixedDopScheduler


# -- Kubernetes: a pod per trajectory -------------------------------------------------------
class PodManager(CpuManager):
    """Binding a trajectory = creating its pod: memory *and* cores held until close."""

    def __init__(self, specs: Iterable[CpuNodeSpec], pod_cores: int) -> None:
        super().__init__(specs)
        self.pod_cores = pod_cores
        self.pods: dict[str, CpuLease] = {}

    def bind(self, trajectory: str, mem_gb: float, min_cores: int) -> str | None:
        if trajectory in self._binding:
            return self._binding[trajectory][0]
        cores = max(self.pod_cores, min_cores)
        # kube-scheduler's default scoring spreads pods: most free cores first
        fits = [n for n in self.nodes.values() if n.mem_free >= mem_gb and n.free_cores >= cores]
        if not fits:
            return None
        node = max(fits, key=lambda n: (n.free_cores, -n.mem_reserved))
        lease = self.reserve(f"pod:{trajectory}", node.name, cores, numa_local=False)
        if lease is None:
            return None
        node.mem_reserved += mem_gb
        self._binding[trajectory] = (node.name, mem_gb)
        self.pods[trajectory] = lease
        return node.name

    def unbind(self, trajectory: str) -> None:
        pod = self.pods.pop(trajectory, None)
        if pod is not None:
            self.release(pod)
        super().unbind(trajectory)


class PodPool(CpuNodePool):
    """Actions run on their trajectory's pod: nothing to allocate per action."""

    def __init__(self, name: str, node: str, manager: PodManager, dop: int | None = None) -> None:
        # the DoP an elastic action runs at inside its pod (the lease's units; the
        # executor's `-n`): the pod's cores stay the trajectory's either way
        super().__init__(name, node, manager, FixedDopScheduler(dop or manager.pod_cores))
        self.pods = manager

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        return tuple(int(c) for c in action.cost["cpu"].choices)

    def fits_min(self, scratch: Any, p: Pending) -> bool:
        return True  # the pod is the trajectory's own; its actions come one at a time

    def elastic_capacity(self, nonelastic: list[Pending]) -> int:
        return 0

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        # the lease records the DoP the scheduler chose; the pod's cores are all the action sees
        return Grant(None, self.node, cores=self.pods.pods[p.action.trajectory].cores)


# -- static GPU deployments -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Replica:
    service: str
    node: str
    start: int
    size: int

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))


class ServicePool(Pool):
    """One service's fixed replicas and its own FIFO queue."""

    key = "gpu"

    def __init__(self, service: str, replicas: list[Replica],
                 batching: BatchModel = DEFAULT_BATCHING) -> None:
        super().__init__(f"gpu:{service}", FixedDopScheduler(replicas[0].size))
        self.batching = batching
        self.replicas = replicas
        self.idle = list(replicas)
        self.dop = replicas[0].size

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        return (self.dop,)

    def new_scratch(self) -> list[int]:
        return [len(self.idle)]

    def fits_min(self, scratch: list[int], p: Pending) -> bool:
        if scratch[0] == 0:
            return False
        scratch[0] -= 1
        return True

    def free_units(self) -> int:
        return len(self.idle) * self.dop

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        if not self.idle:
            return None
        r = self.idle.pop(0)
        return Grant(r, r.node, gpus=r.gpus)

    def release(self, part: Any) -> None:
        if part not in self.idle and part in self.replicas:
            self.idle.append(part)

    def batch(self, p: Pending, units: int, now: float,
              estimates: Any) -> tuple[list[Pending], float | None]:
        # continuous batching, the same model as every GPU pool: a replica that starts
        # takes the queued requests no other idle replica will start now
        riders = take_riders(self.queue, p, units, estimates, self.batching)
        if not riders:
            return [], None
        return riders, batch_expected(p, riders, units, estimates, self.batching)

    def usage(self) -> dict[str, float]:
        return {"gpu": float(sum(r.size for r in self.replicas if r not in self.idle))}


def static_placement(cluster: ClusterSpec, services: list[str], dop: int | None,
                     replicas: int | dict[str, int] | None = None) -> dict[str, list[Replica]]:
    """Replicas per service: each service at the smallest DoP its weights fit
    (at least ``dop``), one replica each first, then more round-robin while
    aligned chunks remain (at most ``replicas`` each, or ``replicas[service]`` for a
    split sized to each service's demand) — how a team sizes fixed SGLang deployments."""
    if dop is not None and dop not in (1, 2, 4, 8):
        raise ValueError(f"static dop: must be 1, 2, 4 or 8, got {dop}")
    carve = GpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps)
    sizes: dict[str, int] = {}
    for s in services:
        fits = [k for k in (1, 2, 4, 8) if carve.check(s, k) is None and k >= (dop or 1)]
        if not fits:
            raise ValueError(f"static: service {s!r} fits on no GPU chunk of this cluster")
        sizes[s] = fits[0]
    per: dict[str, list[Replica]] = {s: [] for s in services}
    order = sorted(services, key=lambda s: -sizes[s])  # widest first: less fragmentation
    round_no = 0
    while True:
        placed = False
        for s in order:
            cap = replicas.get(s, 1) if isinstance(replicas, dict) else replicas
            if cap is not None and len(per[s]) >= cap:
                continue
            lease = carve.reserve(f"{s}/{round_no}", s, sizes[s])
            if lease is None:
                if round_no == 0:
                    raise ValueError(f"static: no GPUs left for one replica of {s!r} "
                                     f"({len(services)} services on "
                                     f"{sum(n.gpus for n in cluster.gpu_nodes)} GPUs)")
                continue
            per[s].append(Replica(s, lease.node, lease.start, lease.size))
            placed = True
        if not placed:
            return per
        round_no += 1


# -- serverless GPU -------------------------------------------------------------------------
class ExclusiveGpuManager(GpuManager):
    """One model per GPU (an instance owns its GPUs' memory); cold start adds init."""

    def __init__(self, *args, init_s: float = 2.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.init_s = init_s

    def _restore(self, node: GpuNode, variant: tuple[str, int, int]) -> float:
        _, k, start = variant
        for other in list(node.resident):
            _, ok, os_ = other
            if os_ < start + k and start < os_ + ok:
                self._evict(node, other)
        return super()._restore(node, variant) + self.init_s


