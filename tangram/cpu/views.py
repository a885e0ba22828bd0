"""What the core's snapshot shows of the CPU nodes (tangram/protocol.py CpuNodeView), and
the point query of a node's busy cores."""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

from tangram.cpu.manager import CpuManager
from tangram.pool import PoolPoints, light_lane
from tangram.protocol import CpuNodeView


def cpu_views(cpu: CpuManager, pools: Iterable[PoolPoints]) -> tuple[CpuNodeView, ...]:
    """Every CPU node of ``cpu``: its cores, memory, free cores, the cores pods hold
    between actions, and its pool's light-lane slots (``pools``: every pool)."""
    slots = {p.name.removeprefix("cpu:"): lane.lane_slots for p in pools
             if (lane := light_lane(p)) is not None}
    pods: dict[str, dict[int, str]] = {}
    for trajectory, lease in cpu.held_between_actions().items():
        for c in lease.cores:
            pods.setdefault(lease.node, {})[c] = trajectory
    return tuple(
        CpuNodeView(name, node.spec.cores, node.spec.numa, node.domain_size,
                    node.spec.mem_gb, node.mem_reserved,
                    frozenset(c for dom in node.domains for c in dom),
                    MappingProxyType(pods.get(name, {})), slots.get(name, 0))
        for name, node in cpu.nodes.items())


def busy_fraction(cpu: CpuManager, node: str) -> float:
    """Fraction of ``node``'s cores held exclusively (what a light-lane action shares)."""
    spec = cpu.nodes.get(node)
    return cpu.in_use(node) / spec.spec.cores if spec and spec.spec.cores else 0.0
