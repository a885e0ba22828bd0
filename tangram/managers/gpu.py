"""GPU manager (paper 5.3, evict-on-execution).

Every 8-GPU node is carved into aligned power-of-two chunks (start % size ==
0), split and merged buddy-style; a GPU runs at most one action at a time.
Services are staged in host memory; a service variant (service, DoP) is
resident on the exact chunk it was restored into, and stays there after its
action until it is evicted (LRU, no write-back: weights do not change).
Restoring a variant of ``size_gb`` onto ``k`` GPUs costs
``size_gb / (restore_gbps * k)`` seconds (k shards load in parallel).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from tangram.arrange import CHUNK_SIZES
from tangram.cluster import GpuNodeSpec, ServiceSpec


@dataclass(frozen=True, slots=True)
class GpuLease:
    action_id: str
    node: str
    start: int
    size: int
    service: str
    restore_s: float

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(range(self.start, self.start + self.size))


Chunk = tuple[int, int]  # (start, size)


class GpuNode:
    __slots__ = ("name", "spec", "free", "resident", "mem_used")

    def __init__(self, spec: GpuNodeSpec) -> None:
        self.name = spec.name
        self.spec = spec
        self.free: dict[int, set[int]] = {s: set() for s in CHUNK_SIZES}
        # a node has 8 GPUs, or 1/2/4 (a workstation found by NVML): one whole chunk
        self.free[spec.gpus].add(0)
        # (service, size, start) -> None, in LRU order (oldest first)
        self.resident: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self.mem_used = [0.0] * spec.gpus


class GpuManager:
    def __init__(self, nodes: Iterable[GpuNodeSpec], services: Iterable[ServiceSpec],
                 restore_gbps: float) -> None:
        self.nodes = {n.name: GpuNode(n) for n in nodes}
        self.services = {s.name: s for s in services}
        self.restore_gbps = restore_gbps
        self._live: dict[str, GpuLease] = {}
        self.restores = 0
        self.hits = 0
        self._counts: tuple[int, int, int, int] | None = None
        #: restore estimates of the current state; cleared with _counts on any change
        self._restore_est: dict[tuple[str, int], float] = {}
        self._checks: dict[tuple[str, int], str | None] = {}

    def check(self, service: str, units: int) -> str | None:
        """Why ``units`` GPUs can never serve ``service`` (None when they can)."""
        key = (service, units)
        if key not in self._checks:
            self._checks[key] = self._check(service, units)
        return self._checks[key]

    def _check(self, service: str, units: int) -> str | None:
        spec = self.services.get(service)
        if spec is None:
            return f"service: unknown service {service!r} (known: {sorted(self.services)})"
        if units not in CHUNK_SIZES:
            return f"cost['gpu']: {units} GPUs is not a chunk size {CHUNK_SIZES}"
        if not self.nodes:
            return "cost['gpu']: the cluster has no GPU nodes"
        if units > max(n.spec.gpus for n in self.nodes.values()):
            return f"cost['gpu']: {units} GPUs is more than any GPU node has"
        mem = min(n.spec.gpu_mem_gb for n in self.nodes.values())
        if spec.size_gb / units > mem:
            return (f"cost['gpu']: service {service!r} ({spec.size_gb} GB) does not fit on "
                    f"{units} GPU(s) of {mem} GB")
        return None

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
        return sum(n * size for n, size in zip(self.chunk_counts(), CHUNK_SIZES, strict=True))

    # -- allocation ----------------------------------------------------------------
    def reserve(self, action_id: str, service: str, k: int) -> GpuLease | None:
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
        self._carve(node, start, size, sub, k)
        restore_s = 0.0
        variant = (service, k, sub)
        if resident:
            self.hits += 1
            node.resident.move_to_end(variant)
        else:
            self.restores += 1
            restore_s = self._restore(node, variant)
        lease = GpuLease(action_id, node.name, sub, k, service, restore_s)
        self._live[action_id] = lease
        return lease

    def _carve(self, node: GpuNode, start: int, size: int, sub: int, k: int) -> None:
        self._counts = None
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

    def _restore(self, node: GpuNode, variant: tuple[str, int, int]) -> float:
        service, k, start = variant
        need = self.services[service].size_gb / k
        gpus = range(start, start + k)
        cap = node.spec.gpu_mem_gb
        # evict least recently used variants overlapping these GPUs until it fits
        for other in list(node.resident):
            if all(node.mem_used[g] + need <= cap + 1e-9 for g in gpus):
                break
            _, ok, os_ = other
            if os_ < start + k and start < os_ + ok:
                self._evict(node, other)
        if not all(node.mem_used[g] + need <= cap + 1e-9 for g in gpus):  # pragma: no cover
            raise AssertionError("restore: GPU memory still short after eviction")
        for g in gpus:
            node.mem_used[g] += need
        node.resident[variant] = None
        return self.services[service].size_gb / (self.restore_gbps * k)

    def _evict(self, node: GpuNode, variant: tuple[str, int, int]) -> None:
        service, k, start = variant
        share = self.services[service].size_gb / k
        for g in range(start, start + k):
            node.mem_used[g] -= share
        del node.resident[variant]

    def release(self, lease: GpuLease) -> None:
        """Idempotent; merges the chunk with its free buddies."""
        if self._live.get(lease.action_id) is not lease:
            return
        del self._live[lease.action_id]
        self._counts = None
        self._restore_est.clear()
        node = self.nodes[lease.node]
        start, size = lease.start, lease.size
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

    # -- for the live GPU backend (executor/gpu): read the model, reset a lost node -------
    def resident_variants(self, node: str) -> frozenset[tuple[str, int, int]]:
        """The variants ``(service, DoP, first GPU)`` the core holds resident on ``node``."""
        return frozenset(self.nodes[node].resident)

    def lru_order(self, node: str) -> tuple[tuple[str, int, int], ...]:
        """Resident variants of ``node``, least recently used first."""
        return tuple(self.nodes[node].resident)

    def live_leases(self, node: str) -> tuple[GpuLease, ...]:
        """Leases of the actions running on ``node``."""
        return tuple(lease for lease in self._live.values() if lease.node == node)

    def gpu_mem_used(self, node: str) -> tuple[float, ...]:
        """GB of resident weights on each GPU of ``node``, as the core accounts them."""
        return tuple(self.nodes[node].mem_used)

    def reset_node(self, node: str) -> None:
        """Forget every resident variant of ``node`` (its worker died and lost its GPU
        copies); leases stay until their actions are finished."""
        n = self.nodes[node]
        n.resident.clear()
        n.mem_used = [0.0] * n.spec.gpus
        self._restore_est.clear()
