"""The GPU nodes as the core sees them (tangram/sides.py): the pre-restores the manager
decided, a node fenced when it leaves and unfenced when it is back, a worker's residency
reset, the submit-time check that some GPU count can serve a request, and what the
snapshot shows (counters, node views, figures)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tangram.cluster import CpuNodeSpec, GpuNodeSpec
from tangram.gpu.manager import GpuManager
from tangram.gpu.views import gpu_views
from tangram.model import Action
from tangram.pool import PoolPoints
from tangram.protocol import Capabilities, Effect, PreRestore
from tangram.sides import Check, Figures
from tangram.trajectory import TrajectoryState


@dataclass(frozen=True, slots=True)
class GpuNodes:
    """The GPU side of a core: its manager, the cluster's GPU nodes and every pool (the
    core's own dict: the GPU pools are those keyed on ``gpu``)."""

    gpu: GpuManager
    nodes: tuple[GpuNodeSpec, ...]
    pools: Mapping[str, PoolPoints]

    def owed(self, out: list[Effect], now: float) -> None:
        gpu = self.gpu
        if gpu.has_prerestores():
            for plan, at, restore_s in gpu.take_prerestores():
                out.append(PreRestore(plan, at, restore_s))

    def joined(self, spec: CpuNodeSpec | GpuNodeSpec) -> Iterable[PoolPoints] | None:
        """A GPU node of the cluster that was lost is back: its free GPUs rejoin the pool
        (nothing resident). A GPU node the cluster never had is refused (the GPU pools
        are built from the cluster's nodes)."""
        if not isinstance(spec, GpuNodeSpec):
            return None
        node = spec.name
        if node not in self.gpu.nodes:
            raise ValueError(f"spec.name: unknown GPU node {node!r} (known: "
                             f"{sorted(self.gpu.nodes)}); a new GPU node needs a restart")
        self.gpu.unfence(node)
        return [p for p in self.pools.values() if p.key == "gpu"]

    def lost(self, node: str) -> Iterable[PoolPoints] | None:
        if node in self.gpu.nodes:  # a GPU node (it may have cores too: the CPU side's)
            self.gpu.fence(node)
        return None

    def worker_lost(self, node: str) -> None:
        if node in self.gpu.nodes:
            self.gpu.reset_node(node)

    def attached(self, capabilities: Capabilities) -> None:
        # pre-restores only for a backend that carries them out: another would not hold
        # what the core then believes resident
        self.gpu.prerestore_ok = capabilities.prerestores

    def checker(self) -> Check:
        """Takes the GPU requests: refused when no feasible GPU count can serve one."""
        # feasible's answers for this batch (the manager caches them too, behind a call
        # and a key built per action: without this, ~10 more opcodes per GPU request of a
        # burst)
        seen: dict[tuple[str, tuple[float, ...]], str | None] = {}
        feasible = self.gpu.feasible

        def check(action: Action, state: TrajectoryState) -> bool:
            if not action.min("gpu") > 0:
                return False
            k = (action.service or "", action.cost["gpu"].choices)
            why = seen.get(k, False)
            if why is False:
                why = seen[k] = feasible(*k)[1]
            if why:  # no feasible GPU count can serve it
                raise ValueError(why)
            return True

        return check

    def counters(self) -> dict[str, float]:
        gpu = self.gpu
        return {"gpu_restores": gpu.restores, "gpu_restore_hits": gpu.hits,
                "gpu_restore_s_total": gpu.restore_s_total}

    def views(self) -> dict[str, object]:
        gpu = self.gpu
        return {"gpu_nodes": gpu_views(gpu),
                "service_gb": MappingProxyType({n: s.size_gb for n, s in gpu.services.items()})}

    def usage(self) -> Figures:
        return Figures({"gpu": 0.0}, {})

    def capacity(self) -> Figures:
        return Figures({"gpu": float(sum(n.gpus for n in self.nodes))}, {})
