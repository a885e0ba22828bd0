"""Kubernetes (a baseline): a trajectory's pod holds its cores and memory from binding
until it closes; every action of the trajectory runs on the pod's cores. None of the
baseline pools overrides the core: they implement the extension points of
tangram/pool.py and the policies in tangram/policies.py assemble them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tangram.cluster import CpuNodeSpec
from tangram.cpu.manager import CpuLease, CpuManager
from tangram.cpu.pool import CpuNodePool
from tangram.model import Action, Pending
from tangram.pool import Grant
from tangram.scheduler import FixedDopScheduler


class PodManager(CpuManager):
    """Binding a trajectory = creating its pod: memory *and* cores held until close."""

    def __init__(self, specs: Iterable[CpuNodeSpec], pod_cores: int) -> None:
        super().__init__(specs)
        self.pod_cores = pod_cores
        self.pods: dict[str, CpuLease] = {}

    def bind(self, trajectory: str, mem_gb: float, min_cores: int) -> str | None:
        bound = self.node_of(trajectory)
        if bound is not None:
            return bound
        cores = max(self.pod_cores, min_cores)
        # kube-scheduler's default scoring spreads pods: most free cores first
        fits = [n for n in self.nodes.values() if n.mem_free >= mem_gb and n.free_cores >= cores]
        if not fits:
            return None
        images = self.images
        if images is None:
            node = max(fits, key=lambda n: (n.free_cores, -n.mem_reserved))
        else:  # (a trajectory named an image) kube-scheduler's sum of scores, each 0-100:
            # least allocated cores, plus its image locality where the policy scores it
            score = images.side.score
            node = max(fits, key=lambda n: (100.0 * n.free_cores / n.spec.cores
                                            + score(images, trajectory, n.name),
                                            -n.mem_reserved))
        lease = self.reserve(f"pod:{trajectory}", node.name, cores, numa_local=False)
        if lease is None:
            return None
        self.hold_memory(trajectory, node.name, mem_gb)
        self.pods[trajectory] = lease
        return node.name

    def bind_many(self, requests: Iterable[tuple[str, float, int]]) -> list[str]:
        # (this class's ``bind``, one at a time: a pod's cores are held at binding)
        done: list[str] = []
        for trajectory, mem_gb, min_cores in requests:
            node = self.bind(trajectory, mem_gb, int(min_cores))  # (a pod's cores: an int)
            if node is None:
                break
            done.append(node)
        return done

    def held_between_actions(self) -> dict[str, CpuLease]:
        return dict(self.pods)

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
