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

Each part lives beside the resource it holds (tangram/cpu/parts.py, tangram/gpu/parts.py,
tangram/api/admits.py, tangram/cpu/env.py), typed by its protocol in tangram/parts.py: this
module is the registry of policies made of them, and imports no pool or manager itself. The
pools a policy builds implement the extension points of tangram/pool.py (PoolPoints).
Baselines never subclass the core.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

# the parts, re-exported: a policy is built of them, and callers name them from here
from tangram.api.admits import ProviderAdmits, ProviderLimit, TangramAdmits
from tangram.api.quota import QuotaManager
from tangram.cluster import ClusterSpec
from tangram.cpu.env import AtFirstAction, AtOpen
from tangram.cpu.images import ImageAware, ImageLocality, ImageSide, PrePulled, PullOnDemand
from tangram.cpu.parts import MalleableCores, Pods, SharedCores
from tangram.gpu.parts import (
    GPU_POOL,
    ColdStart,
    GpusNoAffinity,
    GpusNoOrdering,
    PaperGpus,
    SharedGpus,
    StaticDeployments,
)
from tangram.model import Action
from tangram.parts import ApiSide, CpuSide, EnvStart, GpuSide, Resources
from tangram.pool import Pool
from tangram.scheduler import (
    FCFS,
    ElasticScheduler,
    FixedDopScheduler,
    Ordering,
    PaperScheduler,
    ShortestExpectedFirst,
)

__all__ = [
    "API_POOL", "GPU_POOL", "PARAMS", "REGISTRY", "AtFirstAction", "AtOpen", "ColdStart",
    "GpusNoAffinity", "GpusNoOrdering", "MalleableCores", "PaperGpus", "Pods", "Policy",
    "ProviderAdmits", "ProviderLimit", "Resources", "SharedCores", "SharedGpus", "StaticDeployments",
    "TangramAdmits", "make_policy",
]

API_POOL = "api"


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
    api: ClassVar[ApiSide] = TangramAdmits()
    #: when a trajectory's environment (container, pod) starts
    env: ClassVar[EnvStart] = AtFirstAction()
    #: how trajectories that name a container image are placed
    images: ClassVar[ImageSide] = ImageAware()

    depth: int = 2
    lookahead: int = 32
    ordering: str = "fcfs"
    #: ``sef`` ordering: an action waiting this long jumps ahead of younger ones
    max_wait_s: float = 30.0
    cpu: CpuSide = field(default_factory=SharedCores)
    gpu: GpuSide = field(default_factory=SharedGpus)

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
                               "api_admission": self.api.name, "images": self.images.name}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = {"kind": type(v).__name__, **v.__dict__} if f.name in ("cpu", "gpu") else v
        return out


@dataclass(frozen=True)
class MalleablePolicy(Policy):
    name: ClassVar[str] = "tangram-malleable"
    description: ClassVar[str] = (
        "tangram with malleable CPU grants: a running elastic test grows onto "
        "cores that free up and shrinks to admit arrivals, where the backend re-pins it "
        "(process, docker). Not the default: better on the quick regret matrix, worse on "
        "mean ACT at the paper's size (docs/evidence/decisions.md)")
    cpu: CpuSide = field(default_factory=MalleableCores)


@dataclass(frozen=True)
class NoAffinityPolicy(Policy):
    name: ClassVar[str] = "tangram-no-affinity"
    description: ClassVar[str] = "ablation: tangram without GPU residency affinity"
    gpu: GpuSide = field(default_factory=GpusNoAffinity)


@dataclass(frozen=True)
class NoOrderingPolicy(Policy):
    name: ClassVar[str] = "tangram-no-ordering"
    description: ClassVar[str] = "ablation: tangram without restore-aware GPU ordering"
    gpu: GpuSide = field(default_factory=GpusNoOrdering)


@dataclass(frozen=True)
class PaperPolicy(Policy):
    name: ClassVar[str] = "tangram-paper"
    description: ClassVar[str] = ("the paper's Alg. 1-2 rules: the objective sees only the "
                                  "queue, no waiting, durations-only DP; the paper's GPU "
                                  "placement (no residency affinity)")
    gpu: GpuSide = field(default_factory=PaperGpus)

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
    env: ClassVar[EnvStart] = AtOpen()
    #: kube-scheduler's default profile scores ImageLocality too; this baseline is the pod
    #: without it (pulled on demand), ``k8s-image-locality`` the pod with it
    images: ClassVar[ImageSide] = PullOnDemand()
    cpu: CpuSide = field(default_factory=Pods)


@dataclass(frozen=True)
class K8sImageLocalityPolicy(K8sPolicy):
    name: ClassVar[str] = "k8s-image-locality"
    description: ClassVar[str] = ("k8s with kube-scheduler's ImageLocality score: a pod's node "
                                  "scored by the bytes of its image already there")
    images: ClassVar[ImageSide] = ImageLocality()


@dataclass(frozen=True)
class PrePulledPolicy(Policy):
    name: ClassVar[str] = "tangram-prepulled"
    description: ClassVar[str] = ("ideal: tangram with every container image on every node "
                                  "before the run (unbounded disk)")
    images: ClassVar[ImageSide] = PrePulled()


@dataclass(frozen=True)
class ImagesOnDemandPolicy(Policy):
    name: ClassVar[str] = "tangram-images-on-demand"
    description: ClassVar[str] = ("ablation: tangram placing trajectories without regard to "
                                  "their images, each pulled when its environment starts")
    images: ClassVar[ImageSide] = PullOnDemand()


@dataclass(frozen=True)
class StaticPolicy(Policy):
    name: ClassVar[str] = "static"
    description: ClassVar[str] = ("each GPU service on fixed dedicated GPUs with its own queue "
                                  "(SGLang-like)")
    gpu: GpuSide = field(default_factory=StaticDeployments)


@dataclass(frozen=True)
class ServerlessPolicy(Policy):
    name: ClassVar[str] = "serverless"
    description: ClassVar[str] = "GPU instances started on demand with a cold start (ServerlessLLM-like)"
    gpu: GpuSide = field(default_factory=ColdStart)


@dataclass(frozen=True)
class PerTrajectoryApiPolicy(Policy):
    name: ClassVar[str] = "per-trajectory-api"
    description: ClassVar[str] = ("API calls sent by each trajectory on its own; 429s retried "
                                  "with exponential backoff")
    api: ClassVar[ApiSide] = ProviderAdmits()


@dataclass(frozen=True)
class BaselinePolicy(Policy):
    name: ClassVar[str] = "baseline"
    description: ClassVar[str] = "today's stack: k8s + static GPU services + per-trajectory API calls"
    api: ClassVar[ApiSide] = ProviderAdmits()
    env: ClassVar[EnvStart] = AtOpen()
    images: ClassVar[ImageSide] = PullOnDemand()
    cpu: CpuSide = field(default_factory=Pods)
    gpu: GpuSide = field(default_factory=StaticDeployments)


#: every policy, by the name `tangram policies` lists
REGISTRY: dict[str, type[Policy]] = {p.name: p for p in (
    Policy, MalleablePolicy, PaperPolicy, K8sPolicy, StaticPolicy, ServerlessPolicy, FixedDopPolicy,
    PerTrajectoryApiPolicy, BaselinePolicy, NoAffinityPolicy, NoOrderingPolicy,
    K8sImageLocalityPolicy, PrePulledPolicy, ImagesOnDemandPolicy)}

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
