"""Static GPU deployments (a baseline, SGLang-like): each GPU service on fixed dedicated
replicas of a fixed DoP, with its own queue; no restores, no sharing.

Each replica's residency lives in the policy's GPU manager (``GpuManager.deploy`` and
``use_pinned``), so a dispatch carries a residency plan a live GPU worker carries out:
the replica is deployed (loaded) ahead of its first request when the backend
pre-restores, else on its first dispatch; it is never evicted; a replica whose worker
died is loaded again (a restore) on its next dispatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tangram.cluster import ClusterSpec
from tangram.estimates import Estimates
from tangram.gpu.batching import DEFAULT_BATCHING, BatchModel
from tangram.gpu.manager import GpuManager
from tangram.gpu.pool import batch_expected, take_riders
from tangram.model import Action, Pending
from tangram.pool import Grant, Pool
from tangram.scheduler import FixedDopScheduler


@dataclass(frozen=True, slots=True)
class Replica:
    service: str
    node: str
    start: int
    size: int

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))

    @property
    def site(self) -> tuple[str, int, int]:
        """(node, first GPU, GPUs): where the GPU manager holds it resident."""
        return (self.node, self.start, self.size)


class ServicePool(Pool):
    """One service's fixed replicas and its own FIFO queue."""

    key = "gpu"

    def __init__(self, service: str, replicas: list[Replica], manager: GpuManager,
                 fleet: tuple[Replica, ...] = (),
                 batching: BatchModel = DEFAULT_BATCHING) -> None:
        super().__init__(f"gpu:{service}", FixedDopScheduler(replicas[0].size))
        self.manager = manager
        #: every service's replicas (the deployment the first pass of any pool loads)
        self.fleet = fleet or tuple(replicas)
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
        # a replica whose node left (GpuManager.fence) serves nothing until it is back
        up = [r for r in self.idle if not self.manager.is_down(r.node)]
        if not up:
            return None
        r = up[0]
        self.idle.remove(r)
        restore_s, plan = self.manager.use_pinned(r.service, r.site, now)
        return Grant(r, r.node, gpus=r.gpus, restore_s=restore_s, plan=plan)

    def release(self, part: Any) -> None:
        if part not in self.idle and part in self.replicas:
            self.idle.append(part)

    def batch(self, p: Pending, units: int, now: float,
              estimates: Estimates) -> tuple[list[Pending], float | None]:
        # continuous batching, the same model as every GPU pool: a replica that starts
        # takes the queued requests no other idle replica will start now
        riders = take_riders(self.queue, p, units, estimates, self.batching)
        if not riders:
            return [], None
        return riders, batch_expected(p, riders, units, estimates, self.batching)

    def usage(self) -> dict[str, float]:
        return {"gpu": float(sum(r.size for r in self.replicas if r not in self.idle))}

    def after_pass(self, now: float, estimates: Estimates) -> None:
        # deploy every replica (of every service) ahead of its first request on a backend
        # that loads ahead of demand (a live GPU worker: the loads start with the run's
        # first requests, as a static deployment is up before them); deploy() skips one
        # deployed already (a dispatch's plan loaded it)
        if self.manager.prerestore_ok:
            for r in self.fleet:
                if not self.manager.is_down(r.node):
                    self.manager.deploy(r.service, r.site, now)


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
