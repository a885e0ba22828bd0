"""What the CPU nodes can ever hold: a CPU action or a trajectory's memory refused for good
(validation at submit and open), as opposed to one that waits for room."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tangram.cluster import CpuNodeSpec
from tangram.model import Action


@dataclass(frozen=True, slots=True)
class NodeLimits:
    """The largest CPU node's cores and memory and the largest NUMA domain's cores."""

    nodes: int = 0
    max_node_cores: int = 0
    max_domain: int = 0
    max_node_mem: float = 0.0
    #: the core counts within both limits (a NUMA domain's is the smaller): the common
    #: case, decided by one set test per action
    whole_fits: frozenset[float] = frozenset()

    @classmethod
    def of(cls, cpu_nodes: Iterable[CpuNodeSpec]) -> NodeLimits:
        nodes = tuple(cpu_nodes)
        max_domain = max((n.cores // n.numa for n in nodes), default=0)
        return cls(len(nodes), max((n.cores for n in nodes), default=0), max_domain,
                   max((n.mem_gb for n in nodes), default=0.0),
                   frozenset(range(1, max_domain + 1)))

    def check_open(self, mem_gb: float | None) -> None:
        """Raise ValueError when a trajectory declaring ``mem_gb`` fits no node."""
        if mem_gb is not None and self.nodes and mem_gb > self.max_node_mem:
            raise ValueError(f"mem_gb: {mem_gb} GB exceeds the largest node ({self.max_node_mem})")

    def check(self, action: Action, mem_gb: float | None) -> None:
        """Raise ValueError naming the field when the CPU action ``action`` (of a trajectory
        declaring ``mem_gb``; None: its first action's) can never run on a node."""
        cpu = action.cost.get("cpu")
        if cpu is None:
            return
        need = cpu.choices[0]
        if need > 0:
            if need not in self.whole_fits:  # (mostly: a whole count any NUMA domain holds)
                if need != int(need):
                    raise ValueError(f"cost['cpu']: cores must be whole, got {need}")
                limit = self.max_domain if action.elastic == "cpu" else self.max_node_cores
                if need > limit:
                    raise ValueError(
                        f"cost['cpu']: minimum {need} cores can never fit (largest "
                        f"{'NUMA domain' if action.elastic else 'node'}: {limit})")
            mem = mem_gb
            if mem is None:
                mem = action.min("mem_gb")
            if mem > self.max_node_mem:
                raise ValueError(f"cost['mem_gb']: {mem} GB exceeds the largest node "
                                 f"({self.max_node_mem} GB)")
