"""Today's ways of holding external resources, as cores with the same interface
as :class:`tangram.core.Tangram`, so every policy runs the same trace through
the same driver.

* ``K8sCore``: a pod per trajectory. Its cores and memory are held from its
  first action until it closes; a trajectory whose pod does not fit waits.
  Every action of the trajectory runs on the pod's cores (a test run uses all
  of them: ``pytest -n <pod cores>``).
* ``StaticGpuCore``: each GPU service on fixed dedicated GPUs (replicas of a
  fixed DoP, like SGLang deployments), each service with its own queue; no
  restores, no sharing.
* ``ServerlessGpuCore``: one instance per request of a fixed DoP, started on
  demand from host memory (cold start = load + init) and kept warm until its
  GPUs are needed by another model (ServerlessLLM-like); one model per GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from tangram.cluster import ClusterSpec, CpuNodeSpec
from tangram.core import API_POOL, GPU_POOL, Tangram
from tangram.managers.cpu import CpuLease, CpuManager
from tangram.managers.gpu import GpuManager, GpuNode
from tangram.model import Action
from tangram.pools import CpuNodePool, GpuPool, Grant, Pending, Pool
from tangram.scheduler import ElasticScheduler, FixedDopScheduler, ShortestExpectedFirst


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

    def __init__(self, name: str, node: str, manager: PodManager) -> None:
        super().__init__(name, node, manager)
        self.pods = manager
        self.scheduler = FixedDopScheduler(manager.pod_cores)

    def unit_choices(self, action: Action) -> tuple[int, ...]:
        return tuple(int(c) for c in action.cost["cpu"].choices)

    def fits_min(self, scratch: Any, p: Pending) -> bool:
        return True  # the pod is the trajectory's own; its actions come one at a time

    def elastic_capacity(self, nonelastic: list[Pending]) -> int:
        return 0

    def reserve(self, p: Pending, units: int, now: float) -> Grant | None:
        # the lease records the DoP the scheduler chose; the pod's cores are all the action sees
        return Grant(None, self.node, cores=self.pods.pods[p.action.trajectory].cores)


class K8sCore(Tangram):
    name = "k8s"

    def __init__(self, cluster: ClusterSpec, pod_cores: int = 4, **kw) -> None:
        if pod_cores < 1:
            raise ValueError(f"pod_cores: must be >= 1, got {pod_cores}")
        self.pod_cores = pod_cores
        super().__init__(cluster, **kw)

    def _build_pools(self) -> list[Pool]:
        self.cpu = PodManager(self.cluster.cpu_nodes, self.pod_cores)
        pools: list[Pool] = [PodPool(f"cpu:{n}", n, self.cpu) for n in self.cpu.nodes]
        return pools + [GpuPool(GPU_POOL, self.gpu), Pool(API_POOL)]

    def usage(self) -> dict[str, float]:
        out = super().usage()
        out["cpu"] = float(sum(len(p.cores) for p in self.cpu.pods.values()))
        return out


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

    def __init__(self, service: str, replicas: list[Replica]) -> None:
        super().__init__(f"gpu:{service}")
        self.replicas = replicas
        self.idle = list(replicas)
        self.dop = replicas[0].size
        self.scheduler = FixedDopScheduler(self.dop)

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


class StaticGpuMixin:
    """Adds one ServicePool per service and routes GPU actions to it."""

    cluster: ClusterSpec
    pools: dict[str, Pool]
    dop: int | None
    services: tuple[str, ...] | None

    def _build_pools(self) -> list[Pool]:
        pools = super()._build_pools()  # type: ignore[misc]
        services = list(self.services if self.services is not None
                        else [s.name for s in self.cluster.services])
        if not services:
            return pools
        per = static_placement(self.cluster, services, self.dop)
        return pools + [ServicePool(s, r) for s, r in per.items()]

    def _route(self, action: Action) -> Pool | None:
        if action.min("gpu") > 0:
            return self.pools[f"gpu:{action.service}"]
        return super()._route(action)  # type: ignore[misc]

    def usage(self) -> dict[str, float]:
        out = super().usage()  # type: ignore[misc]
        out["gpu"] = float(sum(r.size for p in self.pools.values() if isinstance(p, ServicePool)
                               for r in p.replicas if r not in p.idle))
        return out


def static_placement(cluster: ClusterSpec, services: list[str],
                     dop: int | None) -> dict[str, list[Replica]]:
    """Replicas per service: each service at the smallest DoP its weights fit
    (at least ``dop``), one replica each first, then more round-robin while
    aligned chunks remain — how a team sizes fixed SGLang deployments."""
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


class StaticGpuCore(StaticGpuMixin, Tangram):
    name = "static"

    def __init__(self, cluster: ClusterSpec, dop: int | None = None,
                 services: tuple[str, ...] | None = None, **kw) -> None:
        self.dop = dop
        self.services = services
        super().__init__(cluster, **kw)


class BaselineCore(StaticGpuMixin, K8sCore):
    """Today's stack: k8s pods + static GPU deployments (per-trajectory API calls
    are modelled by the driver: the provider answers 429 past its quota)."""

    name = "baseline"

    def __init__(self, cluster: ClusterSpec, pod_cores: int = 4, dop: int | None = None,
                 services: tuple[str, ...] | None = None) -> None:
        self.dop = dop
        self.services = services
        super().__init__(cluster, pod_cores=pod_cores)


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


class ServerlessGpuCore(Tangram):
    name = "serverless"

    def __init__(self, cluster: ClusterSpec, dop: int = 1, init_s: float = 2.0, **kw) -> None:
        self.dop = dop
        self.init_s = init_s
        super().__init__(cluster, **kw)

    def _build_pools(self) -> list[Pool]:
        self.gpu = ExclusiveGpuManager(self.cluster.gpu_nodes, self.cluster.services,
                                       self.cluster.restore_gbps, init_s=self.init_s)
        pools = super()._build_pools()
        gpu = next(p for p in pools if p.name == GPU_POOL)
        gpu.scheduler = FixedDopScheduler(self.dop)
        return pools


def make_core(policy: str, cluster: ClusterSpec, options: dict[str, Any] | None = None,
              depth: int = 2) -> Tangram:
    """Build the core a policy name stands for (see ``POLICIES``)."""
    options = options or {}
    pod_cores = int(options.get("pod_cores", 4))
    dop = int(options["gpu_dop"]) if options.get("gpu_dop") else None
    services = tuple(options["services"]) if "services" in options else None
    if api_retries(policy):
        # quotas are the provider's to enforce (with 429s), not ours: admit every call
        cluster = replace(cluster, quotas=tuple(replace(q, mode="concurrency", limit=float("inf"))
                                                for q in cluster.quotas))
    if policy in ("tangram", "tangram-paper", "per-trajectory-api"):
        core = Tangram(cluster, ElasticScheduler(depth=depth,
                                                 paper_exact=policy == "tangram-paper"))
        if options.get("ordering") == "sef":  # shortest expected first, aging-bounded
            core.scheduler.ordering = ShortestExpectedFirst(
                core.estimate, float(options.get("max_wait_s", 30.0)))
        elif options.get("ordering", "fcfs") != "fcfs":
            raise ValueError(f"ordering: unknown {options['ordering']!r} (fcfs or sef)")
        return core
    if policy.startswith("fixed-dop:"):
        try:
            units = int(policy.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"policy: fixed-dop needs an integer, got {policy!r}") from None
        return Tangram(cluster, FixedDopScheduler(units, depth=depth))
    if policy == "k8s":
        return K8sCore(cluster, pod_cores=pod_cores)
    if policy == "static":
        return StaticGpuCore(cluster, dop=dop, services=services)
    if policy == "serverless":
        return ServerlessGpuCore(cluster, dop=dop or 1,
                                 init_s=float(options.get("serverless_init_s", 2.0)))
    if policy == "baseline":
        return BaselineCore(cluster, pod_cores=pod_cores, dop=dop, services=services)
    raise ValueError(f"policy: unknown policy {policy!r} (see `tangram policies`)")


#: name -> (what it models, whether API calls go straight to the provider with retries)
POLICIES: dict[str, tuple[str, bool]] = {
    "tangram": ("action-level elastic scheduling with our extensions: closed-loop arrivals, "
                "bounded waiting for a wider grant, restore-aware DP (default)", False),
    "tangram-paper": ("the paper's Alg. 1-2 exactly: the objective sees only the queue", False),
    "k8s": ("a Kubernetes pod per trajectory holding its cores and memory", False),
    "static": ("each GPU service on fixed dedicated GPUs with its own queue (SGLang-like)", False),
    "serverless": ("GPU instances started on demand with a cold start (ServerlessLLM-like)", False),
    "fixed-dop:N": ("Tangram with elasticity off: every elastic action at exactly N units", False),
    "per-trajectory-api": ("API calls sent by each trajectory on its own; 429s retried "
                           "with exponential backoff", True),
    "baseline": ("today's stack: k8s + static GPU services + per-trajectory API calls", True),
}


def api_retries(policy: str) -> bool:
    key = "fixed-dop:N" if policy.startswith("fixed-dop:") else policy
    return POLICIES.get(key, ("", False))[1]
