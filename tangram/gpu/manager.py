"""GPU manager (paper 5.3, evict-on-execution).

Every 8-GPU node is carved into aligned power-of-two chunks (start % size ==
0), split and merged buddy-style; a GPU runs at most one action at a time.
Services are staged in host memory; a service variant (service, DoP) is
resident on the exact chunk it was restored into, and stays there after its
action until it is evicted (LRU, no write-back: weights do not change).
Restoring a variant of ``size_gb`` onto ``k`` GPUs costs
``size_gb / (restore_gbps * k)`` seconds (k shards load in parallel).

Several variants stay co-resident on a GPU while their memory fits; a restore evicts
only what is needed, least recently used first, among the variants on the GPUs that
are short of memory. A static replica is loaded ahead of its first request
(:meth:`GpuManager.deploy`: a pre-restore effect for the backend).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tangram.arrange import CHUNK_SIZES
from tangram.cluster import GpuNodeSpec, ServiceSpec, gpu_misfit
from tangram.model import GpuPlan, Variant, slot_init


@slot_init
@dataclass(frozen=True, slots=True)
class GpuLease:
    action_id: str
    node: str
    start: int
    size: int
    service: str
    restore_s: float
    #: the residency plan behind this lease (what it evicted, whether it restores)
    plan: GpuPlan | None = None

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))


Chunk = tuple[int, int]  # (start, size)


class GpuNode:
    __slots__ = ("name", "spec", "free", "nfree", "resident", "mem_used", "down")

    def __init__(self, spec: GpuNodeSpec) -> None:
        self.name = spec.name
        self.spec = spec
        self.free: dict[int, set[int]] = {s: set() for s in CHUNK_SIZES}
        # a node has 8 GPUs, or 1/2/4 (a workstation found by NVML): one whole chunk
        self.free[spec.gpus].add(0)
        #: GPUs in its free blocks (0: no free chunk, what most passes ask of a node)
        self.nfree = spec.gpus
        # (service, size, start) -> None, in LRU order (oldest first)
        self.resident: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self.mem_used = [0.0] * spec.gpus
        #: the node left (GpuManager.fence): no free chunk, nothing resident
        self.down = False


#: where a variant lives: (node name, first GPU, GPUs)
Site = tuple[str, int, int]


class GpuManager:
    def __init__(self, nodes: Iterable[GpuNodeSpec], services: Iterable[ServiceSpec],
                 restore_gbps: float) -> None:
        self.nodes = {n.name: GpuNode(n) for n in nodes}
        self.services = {s.name: s for s in services}
        self.restore_gbps = restore_gbps
        self._live: dict[str, GpuLease] = {}
        self.restores = 0
        self.hits = 0
        #: whether the backend running the dispatches can restore ahead of demand (the
        #: runtime sets it from the backend; a live GPU worker restores only on dispatch)
        self.prerestore_ok = False
        #: seconds of every restore made (on demand and ahead of it), in full
        self.restore_s_total = 0.0
        #: service -> its resident variants' sites
        self._sites: dict[str, set[Site]] = {}
        #: service -> ids of the actions running on it
        self._live_of: dict[str, set[str]] = {}
        #: numbers the residency decisions (GpuPlan.version), over all nodes
        self._version = 0
        #: deployments decided and not yet handed out (the core turns them into pre-restore
        #: effects)
        self._prerestored: list[tuple[GpuPlan, float, float]] = []
        #: (node, variant) of static replicas deployed once (a later load is a restore)
        self._deployed: set[tuple[str, Variant]] = set()
        self._counts: tuple[int, int, int, int] | None = None
        self._nfree = sum(n.spec.gpus for n in self.nodes.values())
        #: restore estimates of the current state; cleared with _counts on any change
        self._restore_est: dict[tuple[str, int], float] = {}
        self._checks: dict[tuple[str, int], str | None] = {}
        self._feasible: dict[tuple[str, tuple[float, ...]], tuple[tuple[int, ...], str | None]] = {}
        #: the victims restore_site found for the site it chose: (residency version, node,
        #: variant, victims), taken by the restore that follows (it evicts them) instead of
        #: looking again; any residency change bumps ``_version`` (every change ends in
        #: ``_plan`` or ``reset_node``), which voids it
        #: the variants the last restore evicted (LRU order)
        self._evicted: list[Variant] = []
        self._chosen: tuple[int, str, Variant, list[Variant]] | None = None

    def check(self, service: str, units: int) -> str | None:
        """Why ``units`` GPUs can never serve ``service`` (None when they can)."""
        key = (service, units)
        if key not in self._checks:
            self._checks[key] = self._check(service, units)
        return self._checks[key]

    def feasible(self, service: str, choices: tuple[float, ...]
                 ) -> tuple[tuple[int, ...], str | None]:
        """The chunk sizes among ``choices`` that can serve ``service``, and why none can
        (None when one can). Cached per known service: every request of a burst asks."""
        key = (service, choices)
        got = self._feasible.get(key)
        if got is None:
            reasons = [self.check(service, int(u)) for u in choices]
            ok = tuple(int(u) for u, why in zip(choices, reasons, strict=True)
                       if why is None and u in CHUNK_SIZES)
            got = (ok, reasons[-1] if all(reasons) else None)
            if service in self.services:  # bounded: unknown names are not kept
                self._feasible[key] = got
        return got

    def _check(self, service: str, units: int) -> str | None:
        return gpu_misfit((n.spec for n in self.nodes.values()), self.services, service, units)

    def chunk_counts(self) -> tuple[int, int, int, int]:
        """Free chunks of each size over all nodes (cached until the next change)."""
        if self._counts is not None:
            return self._counts
        counts = [0, 0, 0, 0]
        for node in self.nodes.values():
            for i, size in enumerate(CHUNK_SIZES):
                counts[i] += len(node.free[size])
        self._counts = tuple(counts)  # type: ignore[assignment]
        return self._counts  # type: ignore[return-value]

    def restore_estimate(self, service: str, k: int) -> float:
        """Restore time a grant of ``k`` GPUs for ``service`` would pay now: zero when a
        free chunk (or part of one) already holds that variant, else a full restore."""
        key = (service, k)
        est = self._restore_est.get(key)
        if est is None:
            est = self.services[service].size_gb / (self.restore_gbps * k)
            for node in self.nodes.values():
                if any(svc == service and size == k and self._is_free(node, start, size)
                       for svc, size, start in node.resident):
                    est = 0.0
                    break
            self._restore_est[key] = est
        return est

    @staticmethod
    def _is_free(node: GpuNode, start: int, size: int) -> bool:
        while size <= 8:
            if start in node.free.get(size, ()):
                return True
            start, size = start - start % (size * 2), size * 2
        return False

    def free_gpus(self) -> int:
        return self._nfree

    def idle_sites(self) -> dict[str, list[Site]]:
        """Resident variants whose chunk is free, by service (what can start at once
        without a restore)."""
        out: dict[str, list[Site]] = {}
        for node in self.nodes.values():
            free = node.free
            if not (free[1] or free[2] or free[4] or free[8]):
                continue
            blocks = [(st, size) for size, starts in free.items() for st in starts]
            for svc, k, st in node.resident:
                for bst, bsize in blocks:
                    if bst <= st and st + k <= bst + bsize:
                        out.setdefault(svc, []).append((node.name, st, k))
                        break
        return out

    def idle_sites_of(self, service: str) -> list[Site]:
        """``idle_sites().get(service, [])`` at the cost of that service's variants only
        (a pass looks at one or two services, not at every resident variant): nodes in
        order, each node's variants least recently used first."""
        sites = self._sites.get(service)
        if not sites:
            return []
        nodes = self.nodes
        # a node with no free GPU has no idle site (under a queue most are full): its
        # sites are not looked at one by one
        out = [site for site in sites
               if nodes[site[0]].nfree and self.free_block(nodes[site[0]], site[1], site[2])]
        if len(out) > 1:  # the set's order is arbitrary: put them in idle_sites' order
            order = {name: i for i, name in enumerate(nodes)}
            lru = {name: {v: i for i, v in enumerate(nodes[name].resident)}
                   for name in {site[0] for site in out}}
            out.sort(key=lambda st: (order[st[0]], lru[st[0]][(service, st[2], st[1])]))
        return out

    # -- allocation ----------------------------------------------------------------
    def reserve(self, action_id: str, service: str, k: int,
                now: float = 0.0) -> GpuLease | None:
        """One aligned chunk of ``k`` GPUs for ``service``.

        The smallest free chunk level that fits wins; among equal chunks, one
        where the variant is already resident (no restore) is preferred.
        """
        if action_id in self._live:
            raise ValueError(f"action_id: {action_id!r} already holds a lease")
        why = self.check(service, k)
        if why:
            raise ValueError(why)
        self._restore_est.clear()
        best: tuple[int, bool, GpuNode, int, int] | None = None  # (level, resident, node, ...)
        for node in self.nodes.values():
            for size in CHUNK_SIZES:
                if size < k or not node.free[size]:
                    continue
                for start in sorted(node.free[size]):
                    # any aligned k-sub-chunk of this free chunk is legal
                    sub = next((s for s in range(start, start + size, k)
                                if (service, k, s) in node.resident), start)
                    resident = (service, k, sub) in node.resident
                    key = (size, not resident)
                    if best is None or key < (best[0], not best[1]):
                        best = (size, resident, node, start, sub)
                break  # smallest level with a free chunk on this node
        if best is None:
            return None
        size, resident, node, start, sub = best
        return self._take(action_id, node, start, size, sub, service, k, now)

    def _take(self, action_id: str, node: GpuNode, start: int, size: int, sub: int,
              service: str, k: int, now: float) -> GpuLease:
        self._carve(node, start, size, sub, k)
        restore_s = 0.0
        variant = (service, k, sub)
        restored = variant not in node.resident
        if not restored:
            self.hits += 1
            node.resident.move_to_end(variant)
            gone: tuple[Variant, ...] = ()  # a hit evicts nothing
        else:
            self.restores += 1
            restore_s = self._restore(node, variant)
            self.restore_s_total += restore_s
            # the evicted, oldest first: restore_victims lists them in LRU order
            gone = tuple(self._evicted)
        lease = GpuLease(action_id, node.name, sub, k, service, restore_s,
                         self._plan(node, variant, (), restored, gone))
        self._live[action_id] = lease
        live = self._live_of.get(service)
        if live is None:  # (not setdefault: that builds a set per call)
            live = self._live_of[service] = set()
        live.add(action_id)
        return lease

    def _plan(self, node: GpuNode, variant: Variant, before: Iterable[Variant],
              restored: bool, gone: tuple[Variant, ...] | None = None) -> GpuPlan:
        """The residency plan of a decision just carried out on ``node``: what it evicted
        (``gone``; None: those of ``before``, the resident variants before it, now gone)."""
        self._version += 1
        if gone is None:
            gone = tuple(v for v in before if v not in node.resident)
        return GpuPlan(node.name, variant, gone, restored, frozenset(node.resident),
                       self._version)

    def has_prerestores(self) -> bool:
        """Whether pre-restores were decided since the last take_prerestores."""
        return bool(self._prerestored)

    def take_prerestores(self) -> list[tuple[GpuPlan, float, float]]:
        """The pre-restores decided since the last call: (plan, at, restore seconds)."""
        out, self._prerestored = self._prerestored, []
        return out

    def live_of(self, service: str) -> set[str]:
        """Ids of the actions running on ``service``'s variants."""
        return self._live_of.get(service, set())

    # -- placement by site (the ``tangram`` policy's EOE scheduler) ------------------------
    def free_block(self, node: GpuNode, start: int, k: int) -> tuple[int, int] | None:
        """The free buddy block holding the aligned chunk (start, k), if it is free."""
        free = node.free
        size = k
        while size <= 8:
            starts = free.get(size)
            if starts and start in starts:
                return start, size
            start, size = start - start % (size * 2), size * 2
        return None

    def reserve_at(self, action_id: str, service: str, site: Site,
                   now: float = 0.0) -> GpuLease | None:
        """The chunk ``site`` for ``service`` (None: it is not free)."""
        if action_id in self._live:
            raise ValueError(f"action_id: {action_id!r} already holds a lease")
        name, sub, k = site
        why = self.check(service, k)
        if why:
            raise ValueError(why)
        node = self.nodes[name]
        block = self.free_block(node, sub, k)
        if block is None:
            return None
        self._restore_est.clear()
        return self._take(action_id, node, block[0], block[1], sub, service, k, now)

    def sites(self, service: str) -> set[Site]:
        """Where ``service``'s variants are resident (any DoP)."""
        return self._sites.get(service, set())

    def variant_restore_s(self, service: str, k: int) -> float:
        """What restoring ``service`` onto ``k`` GPUs takes."""
        return self.services[service].size_gb / (self.restore_gbps * k)

    def restore_site(self, service: str, k: int, protect: frozenset[str] | set[str] = frozenset()
                     ) -> Site | None:
        """The best free aligned chunk of ``k`` GPUs to restore ``service`` into: one that
        evicts nothing, else the fewest variants of unprotected services (``protect``:
        services with requests waiting), least recently used first; among equals the
        smallest free block (buddy: keep large blocks whole). None: no free chunk."""
        need = self.services[service].size_gb / k
        best: tuple[tuple, Site, list[Variant]] | None = None
        sizes = [size for size in CHUNK_SIZES if size >= k]
        for node in self.nodes.values():
            if not node.nfree:
                continue  # no free chunk (under a queue most nodes are full)
            free = node.free
            cap = node.spec.gpu_mem_gb
            lru: list[tuple[str, int, int]] | None = None  # built for nodes with a chunk
            for size in sizes:
                if not free[size]:
                    continue
                if lru is None:
                    lru = list(node.resident)
                for bstart in free[size]:
                    for sub in range(bstart, bstart + size, k):
                        victims = self._victims(node, lru, sub, k, need, cap)
                        if victims is None:
                            continue
                        if victims:
                            hurt = sum(1 for v in victims if v[0] in protect)
                            age = max(lru.index(v) for v in victims)
                        else:
                            hurt, age = 0, -1
                        key = (hurt, len(victims), age, size, node.name, sub)
                        if best is None or key < best[0]:
                            best = (key, (node.name, sub, k), victims)
        if best is None:
            return None
        name, sub, _ = site = best[1]
        self._chosen = (self._version, name, (service, k, sub), best[2])
        return site

    def _victims(self, node: GpuNode, lru: list[tuple[str, int, int]], start: int, k: int,
                 need: float, cap: float) -> list[tuple[str, int, int]] | None:
        """Variants to evict (LRU first, only those on GPUs short of memory) so that
        ``need`` GB fits on each of GPUs start..start+k; None if it never fits."""
        used = node.mem_used[start:start + k]  # (a slice: a copy)
        if max(used) + need <= cap + 1e-9:  # the common case: it fits as things are
            return []
        out = []
        end = start + k
        # the GPUs still short of memory: they change only when a victim is taken
        short = [g for g in range(start, end) if used[g - start] + need > cap + 1e-9]
        for v in lru:
            svc, vk, vs = v
            if not (vs < end and start < vs + vk):
                continue
            if not short:
                break
            if not any(vs <= g < vs + vk for g in short):
                continue
            share = self.services[svc].size_gb / vk
            for g in range(max(vs, start), min(vs + vk, end)):
                used[g - start] -= share
            out.append(v)
            short = [g for g in range(start, end) if used[g - start] + need > cap + 1e-9]
        if all(u + need <= cap + 1e-9 for u in used):
            return out
        return None

    def _carve(self, node: GpuNode, start: int, size: int, sub: int, k: int) -> None:
        self._counts = None
        self._nfree -= k
        node.nfree -= k
        node.free[size].discard(start)
        while size > k:  # split, keeping the half that holds ``sub``
            size //= 2
            left, right = start, start + size
            if sub >= right:
                node.free[size].add(left)
                start = right
            else:
                node.free[size].add(right)
                start = left

    # -- extension points of a manager variant (tangram/gpu/cold.py) ---------------
    def restore_victims(self, node: GpuNode, variant: tuple[str, int, int]
                        ) -> list[tuple[str, int, int]] | None:
        """What restoring ``variant`` on ``node`` evicts (None: it never fits): the least
        recently used variants on the GPUs short of memory, until it fits."""
        chosen = self._chosen
        if chosen is not None:
            self._chosen = None  # (once: the caller may change the list)
            if chosen[0] == self._version and chosen[1] == node.name and chosen[2] == variant:
                return chosen[3]  # restore_site just found them, nothing changed since
        service, k, start = variant
        return self._victims(node, list(node.resident), start, k,
                             self.services[service].size_gb / k, node.spec.gpu_mem_gb)

    def start_overhead_s(self, variant: tuple[str, int, int]) -> float:
        """Seconds a restore pays besides loading the weights (an instance's init)."""
        return 0.0

    def victims_at(self, service: str, site: Site) -> list[tuple[str, int, int]] | None:
        """What restoring ``service`` at ``site`` would evict now (None: never fits)."""
        name, start, k = site
        return self.restore_victims(self.nodes[name], (service, k, start))

    def _restore(self, node: GpuNode, variant: tuple[str, int, int]) -> float:
        service, k, start = variant
        need = self.services[service].size_gb / k
        victims = self.restore_victims(node, variant)
        if victims is None:  # pragma: no cover - check() guarantees a lone variant fits
            raise AssertionError("restore: GPU memory still short after eviction")
        for other in victims:
            self._evict(node, other)
        self._evicted = victims
        for g in range(start, start + k):
            node.mem_used[g] += need
        node.resident[variant] = None
        self._sites.setdefault(service, set()).add((node.name, start, k))
        return self.services[service].size_gb / (self.restore_gbps * k) + \
            self.start_overhead_s(variant)

    def _evict(self, node: GpuNode, variant: tuple[str, int, int]) -> None:
        service, k, start = variant
        share = self.services[service].size_gb / k
        for g in range(start, start + k):
            node.mem_used[g] -= share
        del node.resident[variant]
        self._sites.get(service, set()).discard((node.name, start, k))

    def release(self, lease: GpuLease) -> None:
        """Idempotent; merges the chunk with its free buddies."""
        if self._live.get(lease.action_id) is not lease:
            return
        del self._live[lease.action_id]
        self._live_of[lease.service].discard(lease.action_id)
        self._counts = None
        self._restore_est.clear()
        node = self.nodes[lease.node]
        if node.down:  # its GPUs come back with the node (unfence), not one by one
            return
        self._nfree += lease.size
        self._free_chunk(node, lease.start, lease.size)

    def _free_chunk(self, node: GpuNode, start: int, size: int) -> None:
        """Add the aligned chunk to the free blocks, merged with its free buddies."""
        node.nfree += size
        while size < node.spec.gpus:
            buddy = start ^ size
            if buddy not in node.free[size]:
                break
            node.free[size].discard(buddy)
            start = min(start, buddy)
            size *= 2
        node.free[size].add(start)

    def busy_gpus(self) -> int:
        return sum(lease.size for lease in self._live.values())

    # -- variants that own their GPUs (static replicas, tangram/gpu/static.py) -----------
    def deploy(self, service: str, site: Site, now: float) -> bool:
        """Load ``service``'s replica at ``site`` ahead of its first request: the
        deployment of a static replica, which the baseline has up before the run starts
        (modelled at no cost and not counted as a restore). The worker is told with a
        pre-restore effect. False: it was deployed already (a replica its node lost is
        loaded again by its next dispatch, a restore)."""
        name, sub, k = site
        node = self.nodes[name]
        variant = (service, k, sub)
        if (name, variant) in self._deployed:
            return False
        before = list(node.resident)
        self._pin(node, variant)
        self._prerestored.append((self._plan(node, variant, before, True), now, 0.0))
        return True

    def use_pinned(self, service: str, site: Site, now: float) -> tuple[float, GpuPlan]:
        """A dispatch on ``service``'s replica at ``site``, whose GPUs no other variant
        shares (its pool carves them; this manager's chunks stay free, so nothing is ever
        evicted): (seconds of restore it pays, its plan). Resident: a reuse. Not resident:
        its first load is the deployment (as :meth:`deploy`, no cost); a load after the
        node lost it (its worker died: :meth:`reset_node`) is a restore, modelled."""
        name, sub, k = site
        node = self.nodes[name]
        variant = (service, k, sub)
        before = list(node.resident)
        restore_s = 0.0
        restored = variant not in node.resident
        if not restored:
            self.hits += 1
            node.resident.move_to_end(variant)
        elif (name, variant) in self._deployed:
            self.restores += 1
            restore_s = self.variant_restore_s(service, k)
            self.restore_s_total += restore_s
            self._pin(node, variant)
        else:
            self._pin(node, variant)
        return restore_s, self._plan(node, variant, before, restored)

    def _pin(self, node: GpuNode, variant: Variant) -> None:
        service, k, start = variant
        for g in range(start, start + k):
            node.mem_used[g] += self.services[service].size_gb / k
        node.resident[variant] = None
        self._sites.setdefault(service, set()).add((node.name, start, k))
        self._deployed.add((node.name, variant))
        self._restore_est.clear()

    # -- for the live GPU backend (executor/backends/gpu): read the model, reset a lost node -------
    def resident_variants(self, node: str) -> frozenset[tuple[str, int, int]]:
        """The variants ``(service, DoP, first GPU)`` the core holds resident on ``node``."""
        return frozenset(self.nodes[node].resident)

    def fence(self, node: str) -> None:
        """The node left (its machine or its GPU worker is gone): its free chunks leave
        the pool and its residency is forgotten; GPUs of running actions come back only
        with the node (:meth:`unfence`). Idempotent."""
        n = self.nodes[node]
        if n.down:
            return
        self.reset_node(node)
        free = sum(size * len(starts) for size, starts in n.free.items())
        for starts in n.free.values():
            starts.clear()
        n.nfree = 0
        n.down = True
        self._nfree -= free
        self._counts = None

    def unfence(self, node: str) -> None:
        """The node is back (a fresh worker, nothing resident): every GPU no running
        action holds is free again. Idempotent."""
        n = self.nodes[node]
        if not n.down:
            return
        n.down = False
        held = {g for lease in self._live.values() if lease.node == node for g in lease.gpus}
        for g in range(n.spec.gpus):
            if g not in held:
                self._nfree += 1
                self._free_chunk(n, g, 1)
        self._counts = None
        self._restore_est.clear()

    def is_down(self, node: str) -> bool:
        return self.nodes[node].down

    def reset_node(self, node: str) -> None:
        """Forget every resident variant of ``node`` (its worker died and lost its GPU
        copies); leases stay until their actions are finished."""
        n = self.nodes[node]
        for service, k, start in n.resident:
            self._sites.get(service, set()).discard((node, start, k))
        n.resident.clear()
        n.mem_used = [0.0] * n.spec.gpus
        self._restore_est.clear()
        self._version += 1
