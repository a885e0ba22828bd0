"""Policies: how a cluster's resources are held and scheduled, as values.

A policy is a frozen value that both drivers accept by name (``tangram
simulate/run/serve --policy NAME``). It says

* how the CPU side is held (:class:`SharedCores`, allocate-on-execution per
  action, or :class:`Pods`, a Kubernetes pod per trajectory),
* how the GPU side is held (:class:`SharedGpus`, evict-on-execution from one
  pool; :class:`StaticDeployments`, fixed replicas per service;
  :class:`ColdStart`, serverless instances),
* who admits API calls (``api``: :class:`TangramAdmits`, the quota manager
  holds calls until the quota has room; :class:`ProviderAdmits`, every call is sent at
  once and the provider answers 429 past its quota, the caller retrying),
* which scheduler runs each pool (a pool kind may bring its own: a pod or a
  static replica runs at a fixed DoP), and
* when a trajectory's environment starts (``env``: :class:`AtFirstAction`, or
  :class:`AtOpen`: when the trajectory opens, as a pod per trajectory is created).

These are parts (values with behaviour), never mode flags tested by the core or the
drivers: the core asks the policy's parts (``build``, ``route``, ``env.opened``,
``api.core_quotas``, ``grow``) and the simulator asks ``api.provider``.

The pools a policy builds implement the extension points of tangram/pool.py (PoolPoints).
Baselines never subclass the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol

from tangram.api.quota import QuotaManager
from tangram.cluster import ClusterSpec, CpuNodeSpec, QuotaSpec
from tangram.cpu.manager import CpuManager
from tangram.cpu.pods import PodManager, PodPool
from tangram.cpu.pool import CpuNodePool
from tangram.gpu.cold import ExclusiveGpuManager
from tangram.gpu.eoe import EoeScheduler, NoAffinity, NoOrdering
from tangram.gpu.manager import GpuManager
from tangram.gpu.pool import EoeGpuPool, GpuPool
from tangram.gpu.static import ServicePool, static_placement
from tangram.model import Action
from tangram.pool import Pool
from tangram.scheduler import (
    FCFS,
    ElasticScheduler,
    FixedDopScheduler,
    Ordering,
    PaperScheduler,
    ShortestExpectedFirst,
)

API_POOL = "api"
GPU_POOL = "gpu"


@dataclass(slots=True)
class Resources:
    """What a policy builds from a cluster: the managers and the pools over them."""

    cpu: CpuManager
    gpu: GpuManager
    quota: QuotaManager
    pools: dict[str, Pool]


# -- the CPU side -------------------------------------------------------------------------
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
class Pods:
    """A Kubernetes pod per trajectory holding ``pod_cores`` cores and its memory from
    binding until it closes; each action runs on the pod's cores.

    ``pod_dop``: processes an elastic test runs with inside its pod. The paper's
    dataset runs its tests single-process (rewriting ``pytest`` to ``pytest -n`` is
    Tangram's contribution, section 5.2), so 1 by default; ``pod_dop = pod_cores``
    models a baseline that already runs ``pytest -n <pod cores>``."""

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


# -- the GPU side -------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedGpus:
    """Evict-on-execution from one pool of aligned chunks (paper 5.3) with the
    burst-proof rules of tangram/gpu/eoe.py (residency affinity, per-service batches,
    restore-aware ordering). Requests are batched
    (tangram/gpu/batching.py)."""

    def build(self, cluster: ClusterSpec) -> tuple[GpuManager, list[Pool]]:
        gpu = GpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps)
        return gpu, [EoeGpuPool(GPU_POOL, gpu, self.scheduler())]

    def scheduler(self) -> EoeScheduler:
        return EoeScheduler()

    def route(self, action: Action) -> str:
        return GPU_POOL


@dataclass(frozen=True)
class GpusNoAffinity(SharedGpus):
    """Ablation: :class:`SharedGpus` without residency affinity."""

    def scheduler(self) -> EoeScheduler:
        return NoAffinity()


@dataclass(frozen=True)
class GpusNoOrdering(SharedGpus):
    """Ablation: :class:`SharedGpus` without restore-aware ordering."""

    def scheduler(self) -> EoeScheduler:
        return NoOrdering()


@dataclass(frozen=True)
class PaperGpus(SharedGpus):
    """Evict-on-execution with the paper's placement (the manager's smallest-chunk rule)
    and the policy's scheduler; requests are batched like every GPU pool."""

    def build(self, cluster: ClusterSpec) -> tuple[GpuManager, list[Pool]]:
        gpu = GpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps)
        return gpu, [GpuPool(GPU_POOL, gpu)]


@dataclass(frozen=True)
class StaticDeployments:
    """Each service on fixed replicas (SGLang-like), its own queue, batching its
    requests like every GPU pool. ``gpu_dop``: the tensor-parallel size of every
    replica, raised for a model whose weights do not fit. None (default): the paper's
    baseline, every model on 4 GPUs, when the cluster has a 4-GPU replica for every
    service; on a smaller cluster each service at the smallest DoP its weights fit."""

    gpu_dop: int | None = None
    #: replicas per service (None: as many as the GPUs hold, round-robin). The paper's
    #: baselines: 9 teachers x 4 GPUs (MOPD), 5 judge replicas (DeepSearch).
    replicas: int | None = None
    #: replicas per service, ((service, count), ...): an operator's split sized to the
    #: demand it observed (the hot teacher gets more); overrides ``replicas``
    split: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.replicas is not None and (not isinstance(self.replicas, int) or self.replicas < 1):
            raise ValueError(f"replicas: must be an integer >= 1, got {self.replicas!r}")
        for entry in self.split:
            if (len(entry) != 2 or not isinstance(entry[0], str)
                    or not isinstance(entry[1], int) or entry[1] < 1):
                raise ValueError(f"split: each entry must be (service, replicas >= 1), "
                                 f"got {entry!r}")

    #: the paper's static deployment: each model on 4 GPUs (tensor parallel)
    PAPER_DOP: ClassVar[int] = 4

    def build(self, cluster: ClusterSpec) -> tuple[GpuManager, list[Pool]]:
        gpu = GpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps)
        services = [s.name for s in cluster.services]
        if not services:
            return gpu, []
        dop = self.gpu_dop
        if dop is None:
            gpus = sum(n.gpus for n in cluster.gpu_nodes)
            dop = self.PAPER_DOP if len(services) * self.PAPER_DOP <= gpus else None
        per = static_placement(cluster, services, dop,
                               {k: int(v) for k, v in self.split} if self.split else self.replicas)
        fleet = tuple(r for rs in per.values() for r in rs)
        return gpu, [ServicePool(s, r, gpu, fleet) for s, r in per.items()]

    def route(self, action: Action) -> str:
        return f"gpu:{action.service}"


@dataclass(frozen=True)
class ColdStart:
    """One instance of ``gpu_dop`` GPUs per request, cold-started from host memory and
    kept warm until its GPUs are needed (ServerlessLLM-like)."""

    gpu_dop: int = 1
    init_s: float = 2.0

    def build(self, cluster: ClusterSpec) -> tuple[GpuManager, list[Pool]]:
        gpu = ExclusiveGpuManager(cluster.gpu_nodes, cluster.services, cluster.restore_gbps,
                                  init_s=self.init_s)
        return gpu, [GpuPool(GPU_POOL, gpu, FixedDopScheduler(self.gpu_dop))]

    def route(self, action: Action) -> str:
        return GPU_POOL


# -- who admits API calls ------------------------------------------------------------------
class ProviderLimit(Protocol):
    """A provider's own quota, as a simulator models it (it answers 429 past it)."""

    def reserve(self, action_id: str, demands: Mapping[str, float], now: float) -> Any: ...

    def release(self, lease: Any) -> None: ...

    def next_expiry(self, now: float) -> float | None: ...


@dataclass(frozen=True)
class TangramAdmits:
    """The quota manager holds API calls until the quota has room."""

    name: ClassVar[str] = "tangram"

    def core_quotas(self, quotas: tuple[QuotaSpec, ...]) -> tuple[QuotaSpec, ...]:
        return quotas

    def provider(self, quotas: tuple[QuotaSpec, ...]) -> ProviderLimit | None:
        """The provider's limit a simulator models (None: we never exceed it)."""
        return None


@dataclass(frozen=True)
class ProviderAdmits:
    """Every call is sent at once; the provider answers 429 past its quota and the caller
    retries (tangram/api/backoff.py)."""

    name: ClassVar[str] = "provider"

    def core_quotas(self, quotas: tuple[QuotaSpec, ...]) -> tuple[QuotaSpec, ...]:
        # quotas are the provider's to enforce (with 429s), not ours: admit every call
        return tuple(replace(q, mode="concurrency", limit=float("inf")) for q in quotas)

    def provider(self, quotas: tuple[QuotaSpec, ...]) -> ProviderLimit | None:
        return QuotaManager(quotas)


# -- when a trajectory's environment starts -------------------------------------------------
@dataclass(frozen=True)
class AtFirstAction:
    """A trajectory's environment (container) starts with its first action, on the node
    that action binds it to."""

    name: ClassVar[str] = "first_action"
    #: an idle trajectory may give its node to one waiting for memory (Tangram's
    #: MemoryObserved): its next action binds it again, like a first action
    reclaimable: ClassVar[bool] = True

    def opened(self, trajectory: str, request: Callable[[str], None]) -> None:
        """At open: nothing is started (its first action binds it)."""
        return None


@dataclass(frozen=True)
class AtOpen:
    """The RL framework requests the environment (a pod) when the trajectory opens: it is
    bound to a node in open order and holds its memory (and pod cores) until it closes."""

    name: ClassVar[str] = "open"
    #: the pod holds its place (memory, cores) until the trajectory closes
    reclaimable: ClassVar[bool] = False

    def opened(self, trajectory: str, request: Callable[[str], None]) -> None:
        request(trajectory)


# -- policies -----------------------------------------------------------------------------
ORDERINGS = ("fcfs", "sef")


@dataclass(frozen=True)
class Policy:
    """The ``tangram`` policy; the others are named variations of it."""

    name: ClassVar[str] = "tangram"
    description: ClassVar[str] = (
        "action-level elastic scheduling with our extensions: closed-loop arrivals, "
        "bounded waiting for a wider grant, restore-aware DP, squared completion times "
        "(the tail as well as the mean) (default)")
    #: who admits API calls: the quota manager, or the provider (429s, retries)
    api: ClassVar[TangramAdmits | ProviderAdmits] = TangramAdmits()
    #: when a trajectory's environment (container, pod) starts
    env: ClassVar[AtFirstAction | AtOpen] = AtFirstAction()

    depth: int = 2
    lookahead: int = 32
    ordering: str = "fcfs"
    #: ``sef`` ordering: an action waiting this long jumps ahead of younger ones
    max_wait_s: float = 30.0
    cpu: Any = field(default_factory=SharedCores)
    gpu: Any = field(default_factory=SharedGpus)

    def __post_init__(self) -> None:
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering: unknown {self.ordering!r} (one of {', '.join(ORDERINGS)})")

    @property
    def label(self) -> str:
        return self.name

    def scheduler(self) -> ElasticScheduler:
        return ElasticScheduler(self.depth, self.lookahead, self._ordering())

    def _ordering(self) -> Ordering:
        return ShortestExpectedFirst(self.max_wait_s) if self.ordering == "sef" else FCFS()

    def build(self, cluster: ClusterSpec) -> Resources:
        cpu, cpu_pools = self.cpu.build(cluster)
        gpu, gpu_pools = self.gpu.build(cluster)
        quotas = self.api.core_quotas(cluster.quotas)
        pools = [*cpu_pools, *gpu_pools, Pool(API_POOL)]
        return Resources(cpu, gpu, QuotaManager(quotas), {p.name: p for p in pools})

    def route(self, action: Action, res: Resources) -> Pool | None:
        """The pool whose queue ``action`` waits in (None: not bound to a node yet)."""
        return self.route_many((action,), res)[0]

    def route_many(self, actions: Iterable[Action], res: Resources) -> list[Pool | None]:
        """:meth:`route` each of ``actions`` (one loop for a batch: a burst routes thousands)."""
        pools, bound = res.pools, res.cpu.bound
        out: list[Pool | None] = []
        append = out.append
        for action in actions:
            if action.min("gpu") > 0:
                append(pools[self.gpu.route(action)])
            elif action.min("cpu") > 0:
                # (``in`` then ``[]``: a mappingproxy's ``get`` is a method call on its dict,
                # ~3x the cost; a burst's trajectories are mostly not bound yet)
                t = action.trajectory
                append(self.node_pool(bound[t], res) if t in bound else None)
            else:
                append(pools[API_POOL])
        return out

    def node_pool(self, node: str, res: Resources) -> Pool:
        """The pool ``route`` gives a CPU action of a trajectory bound to ``node`` (the core
        asks it for the trajectories it just bound)."""
        return res.pools[f"cpu:{node}"]

    def params(self) -> dict[str, Any]:
        """The policy's parameters (for config.json)."""
        out: dict[str, Any] = {"name": self.label, "env_start": self.env.name,
                               "api_admission": self.api.name}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = {"kind": type(v).__name__, **v.__dict__} if f.name in ("cpu", "gpu") else v
        return out


@dataclass(frozen=True)
class NoAffinityPolicy(Policy):
    name: ClassVar[str] = "tangram-no-affinity"
    description: ClassVar[str] = "ablation: tangram without GPU residency affinity"
    gpu: Any = field(default_factory=GpusNoAffinity)


@dataclass(frozen=True)
class NoOrderingPolicy(Policy):
    name: ClassVar[str] = "tangram-no-ordering"
    description: ClassVar[str] = "ablation: tangram without restore-aware GPU ordering"
    gpu: Any = field(default_factory=GpusNoOrdering)


@dataclass(frozen=True)
class PaperPolicy(Policy):
    name: ClassVar[str] = "tangram-paper"
    description: ClassVar[str] = ("the paper's Alg. 1-2 rules: the objective sees only the "
                                  "queue, no waiting, durations-only DP; the paper's GPU "
                                  "placement (no residency affinity)")
    gpu: Any = field(default_factory=PaperGpus)

    def scheduler(self) -> ElasticScheduler:
        return PaperScheduler(self.depth, self.lookahead, self._ordering())


@dataclass(frozen=True)
class FixedDopPolicy(Policy):
    name: ClassVar[str] = "fixed-dop:N"
    description: ClassVar[str] = "Tangram with elasticity off: every elastic action at exactly N units"
    units: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.units, int) or self.units < 1:
            raise ValueError(f"fixed-dop: units must be an integer >= 1, got {self.units!r}")

    @property
    def label(self) -> str:
        return f"fixed-dop:{self.units}"

    def scheduler(self) -> ElasticScheduler:
        return FixedDopScheduler(self.units, depth=self.depth, lookahead=self.lookahead,
                                 ordering=self._ordering())


@dataclass(frozen=True)
class K8sPolicy(Policy):
    name: ClassVar[str] = "k8s"
    description: ClassVar[str] = ("a Kubernetes pod per trajectory, created when the trajectory "
                                  "opens and holding its cores and memory until it closes; "
                                  "tests single-process")
    #: the RL framework requests the pod when the rollout starts the trajectory (paper 2.2:
    #: environments are created for the whole rollout, not at the first action)
    env: ClassVar[AtFirstAction | AtOpen] = AtOpen()
    cpu: Any = field(default_factory=Pods)


@dataclass(frozen=True)
class StaticPolicy(Policy):
    name: ClassVar[str] = "static"
    description: ClassVar[str] = ("each GPU service on fixed dedicated GPUs with its own queue "
                                  "(SGLang-like)")
    gpu: Any = field(default_factory=StaticDeployments)


@dataclass(frozen=True)
class ServerlessPolicy(Policy):
    name: ClassVar[str] = "serverless"
    description: ClassVar[str] = "GPU instances started on demand with a cold start (ServerlessLLM-like)"
    gpu: Any = field(default_factory=ColdStart)


@dataclass(frozen=True)
class PerTrajectoryApiPolicy(Policy):
    name: ClassVar[str] = "per-trajectory-api"
    description: ClassVar[str] = ("API calls sent by each trajectory on its own; 429s retried "
                                  "with exponential backoff")
    api: ClassVar[TangramAdmits | ProviderAdmits] = ProviderAdmits()


@dataclass(frozen=True)
class BaselinePolicy(Policy):
    name: ClassVar[str] = "baseline"
    description: ClassVar[str] = "today's stack: k8s + static GPU services + per-trajectory API calls"
    api: ClassVar[TangramAdmits | ProviderAdmits] = ProviderAdmits()
    env: ClassVar[AtFirstAction | AtOpen] = AtOpen()
    cpu: Any = field(default_factory=Pods)
    gpu: Any = field(default_factory=StaticDeployments)


#: every policy, by the name `tangram policies` lists
REGISTRY: dict[str, type[Policy]] = {p.name: p for p in (
    Policy, PaperPolicy, K8sPolicy, StaticPolicy, ServerlessPolicy, FixedDopPolicy,
    PerTrajectoryApiPolicy, BaselinePolicy, NoAffinityPolicy, NoOrderingPolicy)}

#: the parameters a user may set, and which part of a policy each belongs to
PARAMS: dict[str, str] = {"depth": "scheduler", "lookahead": "scheduler",
                          "ordering": "scheduler", "max_wait_s": "scheduler",
                          "pod_cores": "cpu", "pod_dop": "cpu", "light_s": "cpu",
                          "lane_cores": "cpu", "lane_hold_s": "cpu", "gpu_dop": "gpu", "replicas": "gpu",
                          "split": "gpu",
                          "init_s": "gpu"}


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """The policy ``name`` (``fixed-dop:N`` carries N) with ``params`` applied where the
    policy has them (``pod_cores`` means nothing to ``tangram`` and is ignored there)."""
    params = dict(params or {})
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise ValueError(f"policy parameter: unknown {unknown[0]!r} (known: {', '.join(PARAMS)})")
    top: dict[str, Any] = {}
    if name.startswith("fixed-dop:"):
        try:
            top["units"] = int(name.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"policy: fixed-dop needs an integer, got {name!r}") from None
        cls: type[Policy] = FixedDopPolicy
    elif name in REGISTRY and name != FixedDopPolicy.name:
        cls = REGISTRY[name]
    else:
        raise ValueError(f"policy: unknown policy {name!r} (see `tangram policies`)")
    proto = cls(**top)
    for key, value in params.items():
        if value is None:
            continue
        part = PARAMS[key]
        if part == "scheduler":
            top[key] = value
            continue
        side = top.get(part, getattr(proto, part))
        if key in {f.name for f in fields(side)}:
            top[part] = replace(side, **{key: value})
    return cls(**top)
