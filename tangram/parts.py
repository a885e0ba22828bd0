"""The parts a policy (tangram/policies.py) is made of, each a small protocol its values
implement: the CPU side (tangram/cpu/parts.py), the GPU side (tangram/gpu/parts.py), who
admits API calls (tangram/api/admits.py) and when an environment starts
(tangram/cpu/env.py); and what the sides build from a cluster (:class:`Resources`). Typed
here so a policy names its parts by what they do, not as ``Any``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from tangram.api.admits import ProviderLimit
from tangram.api.quota import QuotaManager
from tangram.cluster import ClusterSpec, CpuNodeSpec, QuotaSpec
from tangram.cpu.manager import CpuManager
from tangram.gpu.manager import GpuManager
from tangram.model import Action
from tangram.pool import Pool


@dataclass(slots=True)
class Resources:
    """What a policy builds from a cluster: the managers and the pools over them."""

    cpu: CpuManager
    gpu: GpuManager
    quota: QuotaManager
    pools: dict[str, Pool]


class CpuSide(Protocol):
    """How the CPU nodes are held (``SharedCores``, ``Pods``)."""

    #: a trajectory's environment is a pod the part holds cores for, from its binding to
    #: its close (a simulator models its start as a pod's: the control plane schedules it
    #: at its own rate); else a container or a working directory on the node
    starts_pods: ClassVar[bool]

    def build(self, cluster: ClusterSpec) -> tuple[CpuManager, list[Pool]]:
        """The CPU manager and a pool per node."""
        ...

    def grow(self, cpu: CpuManager, spec: CpuNodeSpec) -> Pool:
        """A node joined: its capacity in ``cpu`` and the pool ``build`` would have made."""
        ...


class GpuSide(Protocol):
    """How the GPUs are held (``SharedGpus``, ``StaticDeployments``, ``ColdStart``...)."""

    def build(self, cluster: ClusterSpec) -> tuple[GpuManager, list[Pool]]:
        """The GPU manager and the GPU pools."""
        ...

    def route(self, action: Action) -> str:
        """The name of the pool the GPU action ``action`` waits in."""
        ...


class ApiSide(Protocol):
    """Who admits API calls (``TangramAdmits``, ``ProviderAdmits``)."""

    name: str

    def core_quotas(self, quotas: tuple[QuotaSpec, ...]) -> tuple[QuotaSpec, ...]:
        """The quotas the core's quota manager holds calls to."""
        ...

    def provider(self, quotas: tuple[QuotaSpec, ...]) -> ProviderLimit | None:
        """The provider's limit a simulator models (None: we never exceed it)."""
        ...


class EnvStart(Protocol):
    """When a trajectory's environment starts (``AtFirstAction``, ``AtOpen``)."""

    name: str
    #: an idle trajectory may give its node to one waiting for memory
    reclaimable: bool

    def opened(self, trajectory: str, request: Callable[[str], None]) -> None:
        """``trajectory`` opened: ``request`` it when its environment starts now."""
        ...
