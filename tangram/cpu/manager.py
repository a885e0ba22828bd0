"""CPU manager (paper 5.2, allocate-on-execution).

Nodes x NUMA domains x cores. Cores are exclusive and granted per action;
an elastic action's cores come from one NUMA domain (parallel efficiency
depends on core distance). A trajectory is bound at its first action to a
node with memory for the whole trajectory, chosen by memory balance among the
nodes where that action can start now (free cores), else among all of them:
binding never waits for a free core (an ``ls`` waited for a whole test
run to be *placed*); the action then queues on its node like any other. Its
memory stays reserved until it is closed (its container keeps its state between
actions). Whether a node has
room for a trajectory's memory is ``admission``'s rule (tangram/cpu/admission.py:
declared limits reserved in full unless the node's free memory is observed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tangram.cluster import CpuNodeSpec
from tangram.cpu.admission import RESERVE, MemoryAdmission
from tangram.cpu.images import ImageBook
from tangram.model import slot_init


@slot_init
@dataclass(frozen=True, slots=True)
class CpuLease:
    action_id: str
    node: str
    cores: tuple[int, ...]


class CpuNode:
    __slots__ = ("name", "spec", "domains", "mem_reserved", "domain_size", "mem_observed_free",
                 "mem_since", "free_cores")

    def __init__(self, spec: CpuNodeSpec) -> None:
        self.name = spec.name
        self.spec = spec
        if spec.numa < 1 or spec.cores % spec.numa:  # (cores past the domains: unschedulable)
            raise ValueError(f"cpu node {spec.name}: cores {spec.cores} not divisible by numa "
                             f"{spec.numa}")
        self.domain_size = spec.cores // spec.numa
        self.domains: list[list[int]] = [
            list(range(d * self.domain_size, (d + 1) * self.domain_size)) for d in range(spec.numa)
        ]
        self.mem_reserved = 0.0
        #: free memory last observed on the node (None: never observed) and the assumed
        #: use of the trajectories bound to it since (MemoryAdmission.start_gb each)
        self.mem_observed_free: float | None = None
        self.mem_since = 0.0
        #: the cores in ``domains``, kept with them by the manager (binding a trajectory
        #: asks it of every node: a burst binds thousands)
        self.free_cores: int = self.domain_size * spec.numa

    @property
    def mem_free(self) -> float:
        return self.spec.mem_gb - self.mem_reserved

    def free_per_domain(self) -> list[int]:
        return list(map(len, self.domains))


def pick_domains(free: list[int], n: int, numa_local: bool) -> list[tuple[int, int]] | None:
    """Which domains give ``n`` cores: [(domain, count)], or None.

    NUMA-local requests take the best-fitting single domain (least free that
    still fits), keeping large domains whole for later elastic actions; others
    take from the fullest domains first.
    """
    if numa_local or n <= 0:
        best = -1
        for d, f in enumerate(free):
            if f >= n and (best < 0 or f < free[best]):
                best = d
        return None if best < 0 else [(best, n)]
    if n == 1:  # (most actions: the fullest domain, the first of equals, as below)
        most = max(free, default=0)
        return None if most < 1 else [(free.index(most), 1)]
    if sum(free) < n:
        return None
    out = []
    for d in sorted(range(len(free)), key=lambda d: -free[d]):
        take = min(free[d], n)
        if take:
            out.append((d, take))
            n -= take
        if n == 0:
            break
    return out


class CpuManager:
    def __init__(self, specs: Iterable[CpuNodeSpec],
                 admission: MemoryAdmission = RESERVE) -> None:
        self.nodes = {s.name: CpuNode(s) for s in specs}
        self.admission = admission
        #: counts every change to what memory admission reads (a node's memory held or
        #: observed, a node joining or leaving), and the last request no node took, as
        #: (mem_gb, min_cores, the count then, the admission rule): a trajectory waiting
        #: for memory is asked for again before every pass, and on a fleet whose memory is
        #: spoken for every node refused it the same way the last time
        self._mem_changes = 0
        self._refused: tuple[float, float, int, MemoryAdmission] | None = None
        #: trajectory -> the node it is bound to, and the memory it holds there
        self._binding: dict[str, str] = {}
        self._held: dict[str, float] = {}
        #: ``_binding``, read-only and live: a router looks up thousands in a burst
        self.bound: Mapping[str, str] = MappingProxyType(self._binding)
        self._live: dict[str, CpuLease] = {}
        #: a resized action -> its lease as reserved (what its holder releases: ``resize``)
        self._reserved_as: dict[str, CpuLease] = {}
        #: the core's image book (tangram/cpu/images.py), set once a trajectory naming an
        #: image opens: it is told of every binding, and a trajectory it placed at open
        #: binds to that node when the node takes it (None: no trajectory named one)
        self.images: ImageBook | None = None

    # -- trajectories -------------------------------------------------------------
    def node_of(self, trajectory: str) -> str | None:
        return self._binding.get(trajectory)

    def bind(self, trajectory: str, mem_gb: float, min_cores: int) -> str | None:
        """Bind a trajectory to the least memory-loaded node that takes its memory,
        preferring nodes with ``min_cores`` free (its first action starts at once)."""
        got = self.bind_many(((trajectory, mem_gb, min_cores),))
        return got[0] if got else None

    def bind_many(self, requests: Iterable[tuple[str, float, int]]) -> list[str]:
        """``bind`` each (trajectory, mem_gb, min_cores) in order until one fits no node
        (by memory: free cores only rank the nodes); the node of each bound, in order (one
        loop for a batch: a burst binds thousands). ``min_cores`` is a whole number, an int
        or a float (a Demand's)."""
        binding = self._binding
        planned = self.images.planned if self.images is not None else {}
        done: list[str] = []
        for trajectory, mem_gb, min_cores in requests:
            bound = binding.get(trajectory)
            if bound is None and self._refused == (mem_gb, min_cores, self._mem_changes,
                                                   self.admission):
                break  # (no node's memory changed since every node refused the same)
            if bound is None and trajectory in planned:  # placed at open (ImageAware)
                host = self.nodes.get(planned[trajectory])
                if host is not None and host.spec.cores >= min_cores \
                        and self.mem_refusal(host, mem_gb) is None:
                    bound = host.name
                    self.hold_memory(trajectory, bound, mem_gb)
            if bound is None:
                best: CpuNode | None = None
                best_idle = False
                for node in self.nodes.values():
                    if node.spec.cores < min_cores:  # (never: a smaller node of a mixed cluster)
                        continue
                    if self.mem_refusal(node, mem_gb) is not None:
                        continue
                    # a node where the first action starts now first, then memory balance
                    idle = node.free_cores >= min_cores
                    if best is None or idle > best_idle or (
                            idle == best_idle and node.mem_reserved / node.spec.mem_gb
                            < best.mem_reserved / best.spec.mem_gb):
                        best, best_idle = node, idle
                if best is None:
                    self._refused = (mem_gb, min_cores, self._mem_changes, self.admission)
                    break
                bound = best.name
                self.hold_memory(trajectory, bound, mem_gb)
            done.append(bound)
        return done

    def hold_memory(self, trajectory: str, node: str, mem_gb: float) -> None:
        """Bind ``trajectory`` to ``node``, holding ``mem_gb`` there until it is unbound
        (what ``bind`` does once it chose the node; a subclass choosing otherwise calls it)."""
        host = self.nodes[node]
        self._mem_changes += 1
        host.mem_reserved += mem_gb
        host.mem_since += min(mem_gb, self.admission.start_gb)
        self._binding[trajectory] = node
        self._held[trajectory] = mem_gb
        if self.images is not None:
            self.images.bound(trajectory, node)

    def mem_refusal(self, node: CpuNode, mem_gb: float) -> str | None:
        """Why ``node`` cannot take a trajectory declaring ``mem_gb`` now (None: it can)."""
        return self.admission.refusal(node.name, node.spec.mem_gb, node.mem_reserved, mem_gb,
                                      node.mem_observed_free, node.mem_since)

    def why_unbound(self, mem_gb: float) -> str:
        """Why no node takes a trajectory declaring ``mem_gb`` (for a client waiting on
        it; binding waits for memory only, never for a free core)."""
        reasons = []
        for node in self.nodes.values():
            why = self.mem_refusal(node, mem_gb)
            reasons.append(why or f"node {node.name}: room now (next scheduling pass)")
        return "waiting for a node: " + "; ".join(reasons) if reasons else "no CPU node"

    def observe_free(self, node: str, free_gb: float) -> None:
        """The node's free memory as just observed (e.g. MemAvailable): admission from
        now on goes by it (MemoryAdmission), not by the declared limits alone."""
        host = self.nodes.get(node)
        if host is not None:
            self._mem_changes += 1
            host.mem_observed_free = max(0.0, float(free_gb))
            host.mem_since = 0.0

    def unbind(self, trajectory: str) -> None:
        """Release a closed trajectory's memory (idempotent)."""
        node = self._binding.pop(trajectory, None)
        if node is not None:
            self._mem_changes += 1
            self.nodes[node].mem_reserved -= self._held.pop(trajectory)
            if self.images is not None:
                self.images.unbound(trajectory)

    # -- cores ---------------------------------------------------------------------
    def reserve(self, action_id: str, node: str, n: int, numa_local: bool) -> CpuLease | None:
        if action_id in self._live:
            raise ValueError(f"action_id: {action_id!r} already holds a lease")
        host = self.nodes[node]
        plan = pick_domains(host.free_per_domain(), n, numa_local)
        if plan is None:
            return None
        cores: list[int] = []
        for d, count in plan:
            dom = host.domains[d]
            cores.extend(dom[:count])
            del dom[:count]
            host.free_cores -= count
        lease = CpuLease(action_id, node, tuple(sorted(cores)))
        self._live[action_id] = lease
        return lease

    def lease_of(self, action_id: str) -> CpuLease:
        """The cores ``action_id`` holds now (KeyError: none)."""
        return self._live[action_id]

    def resize(self, action_id: str, n: int) -> CpuLease | None:
        """The live lease of ``action_id`` grown or shrunk to ``n`` cores (a malleable
        grant, tangram/cpu/malleable.py): it grows from its own NUMA domain (an elastic
        action's cores stay in one, as ``reserve`` placed them) and shrinks by its highest
        cores. The new lease (it replaces the old one: releasing it, or the lease as
        reserved, releases it), or None when its domain has not ``n`` cores for it."""
        old = self._live[action_id]
        have = len(old.cores)
        if n < 1:
            raise ValueError(f"cores: a grant keeps at least 1 core, got {n}")
        host = self.nodes[old.node]
        if n > have:
            dom = host.domains[old.cores[0] // host.domain_size]
            if len(dom) < n - have:
                return None
            cores = old.cores + tuple(dom[:n - have])
            del dom[:n - have]
            host.free_cores -= n - have
        elif n < have:
            cores = old.cores[:n]
            for core in old.cores[n:]:
                host.domains[core // host.domain_size].append(core)
            for d in {core // host.domain_size for core in old.cores[n:]}:
                host.domains[d].sort()
            host.free_cores += have - n
        else:
            return old
        lease = CpuLease(action_id, old.node, tuple(sorted(cores)))
        self._live[action_id] = lease
        self._reserved_as.setdefault(action_id, old)
        return lease

    def release(self, lease: CpuLease) -> None:
        """Idempotent: a second release of the same lease does nothing. A lease that was
        resized since (``resize``) releases the cores its action holds now; a lease
        released already does nothing, also once its action id holds a new one."""
        aid = lease.action_id
        live = self._live.get(aid)
        if live is not lease:
            if live is None or self._reserved_as.get(aid) is not lease:
                return
            lease = live
        if self._reserved_as:
            self._reserved_as.pop(aid, None)
        del self._live[aid]
        host = self.nodes[lease.node]
        size = host.domain_size
        cores = lease.cores
        domains = host.domains
        if cores and cores[0] // size == cores[-1] // size:  # one domain (sorted cores)
            dom = domains[cores[0] // size]
            dom.extend(cores)
            dom.sort()
        else:
            for core in cores:
                domains[core // size].append(core)
            # (the others are sorted already: every change ends sorted)
            for d in {core // size for core in cores}:
                domains[d].sort()
        host.free_cores += len(cores)

    def in_use(self, node: str) -> int:
        host = self.nodes.get(node)
        if host is None:  # removed (remove_node): nothing in use there any more
            return 0
        return host.spec.cores - host.free_cores

    def held_between_actions(self) -> dict[str, CpuLease]:
        """Trajectory -> the cores it holds while no action of it runs (a pod; none here)."""
        return {}

    # -- membership (multi-node executors: a node joins or leaves) -------------------
    def add_node(self, spec: CpuNodeSpec) -> None:
        """A node joined: its cores and memory become grantable."""
        if spec.name in self.nodes:
            raise ValueError(f"node: {spec.name!r} is already in the cluster")
        self.nodes[spec.name] = CpuNode(spec)
        self._mem_changes += 1
        if self.images is not None:
            self.images.add_node(spec)

    def remove_node(self, name: str) -> list[str]:
        """A node left (its machine or its agent died): forget its cores, the leases
        on them (releasing one later is a no-op) and its bindings. Returns the
        trajectories that were bound there, whose environments are gone."""
        host = self.nodes.pop(name, None)
        if host is None:
            return []
        self._mem_changes += 1
        if self.images is not None:
            self.images.remove_node(name)
        host.domains = [[] for _ in host.domains]  # a stale holder sees no free core
        host.free_cores = 0
        for aid in [a for a, lease in self._live.items() if lease.node == name]:
            del self._live[aid]
            self._reserved_as.pop(aid, None)
        lost = [t for t, node in self._binding.items() if node == name]
        for t in lost:
            del self._binding[t]
            del self._held[t]
        return lost
